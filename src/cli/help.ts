// `--help` and `-h`: every command's usage on stdout with exit 0, before any work (no GPU, no file read). Each
// command's flags are described from the one table that also parses them (args.ts FlagSpec: each flag's value,
// what it does, its default and range); train's settings from the settings schema (pipeline/settings.ts).
import { SETTINGS, settingsHelp } from '../pipeline/settings.ts';
import { flagsHelp, type Flags } from './args.ts';

/** A command's help as its module gives it: the usage line and the flags table it parses with. */
interface CommandHelp {
  usage: string;
  flags: Flags;
}

export const COMMANDS = ['inspect', 'run', 'grad', 'sample', 'grid', 'train', 'export'] as const;

/** A command's usage and flags (loaded from its module: nothing runs). */
export async function helpOf(command: string, inspect: CommandHelp): Promise<CommandHelp> {
  switch (command) {
    case 'inspect':
      return inspect;
    case 'run': {
      const m = await import('./run.ts');
      return { usage: m.RUN_USAGE, flags: m.COMPONENT_FLAGS };
    }
    case 'grad': {
      const m = await import('./run.ts');
      return { usage: m.GRAD_USAGE, flags: m.COMPONENT_FLAGS };
    }
    case 'sample': {
      const m = await import('./sample.ts');
      return { usage: m.SAMPLE_USAGE, flags: m.SAMPLE_FLAGS };
    }
    case 'grid': {
      const m = await import('./grid.ts');
      return { usage: m.GRID_USAGE, flags: m.GRID_FLAGS };
    }
    case 'export': {
      const m = await import('./export.ts');
      return { usage: m.EXPORT_USAGE, flags: m.EXPORT_FLAGS };
    }
    case 'train': {
      // The run's own flags (inputs, folder, --bundle's); the settings' flags are listed from the schema.
      const m = await import('./bundle.ts');
      const settingFlags = new Set(SETTINGS.map((s) => s.flag));
      return { usage: m.BUNDLE_USAGE, flags: Object.fromEntries(Object.entries(m.BUNDLE_FLAGS).filter(([f]) => !settingFlags.has(f))) };
    }
    default:
      throw new Error(`no such command: ${command}`);
  }
}

/** A command's --help: its usage, then every flag with what it does, its default and range. */
async function commandHelp(command: string, inspect: CommandHelp): Promise<string> {
  const { usage, flags } = await helpOf(command, inspect);
  const lines = [usage, '', command === 'train' ? 'inputs:' : 'flags:', ...flagsHelp(flags)];
  if (command === 'train') lines.push('', 'settings (the same schema as the studio):', ...settingsHelp());
  return lines.join('\n');
}

/** `cli --help`: every command's help; `cli <command> --help`: that command's. */
export async function helpText(command: string | undefined, inspect: CommandHelp): Promise<string> {
  if (command !== undefined) return commandHelp(command, inspect);
  const parts = [
    'usage: npm run cli -- <command> [flags]   (each command: <command> --help)',
    "(pretraining the demo model is the lab's: npm run lab:pretrain -- --help, lab/demo-model/README.md)",
  ];
  for (const c of COMMANDS) parts.push(await commandHelp(c, inspect));
  return parts.join('\n\n');
}

/** Whether the arguments ask for help: --help or -h anywhere. */
export const wantsHelp = (args: string[]) => args.includes('--help') || args.includes('-h');
