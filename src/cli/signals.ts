// One handler for the signals that stop a command: SIGINT (Ctrl-C), SIGTERM (what docker stop, systemd and job
// schedulers send) and SIGHUP (the terminal closed). The first asks the command to stop cleanly (finish or
// abandon the step, checkpoint, release the lock); a second one exits at once, after `last` (synchronous
// cleanup such as releasing the lock). Exit codes are the shell's 128 + signal number.
export const SIGNAL_EXIT_CODES = { SIGHUP: 129, SIGINT: 130, SIGTERM: 143 } as const;
export type StopSignal = keyof typeof SIGNAL_EXIT_CODES;

/** Installs the handler for every stop signal; returns its removal. */
export function onStopSignal(first: (signal: StopSignal) => void, last: () => void): () => void {
  let seen = false;
  const handlers = (Object.keys(SIGNAL_EXIT_CODES) as StopSignal[]).map((signal) => {
    const h = () => {
      if (seen) {
        last();
        process.exit(SIGNAL_EXIT_CODES[signal]);
      }
      seen = true;
      first(signal);
    };
    process.on(signal, h);
    return [signal, h] as const;
  });
  return () => {
    for (const [signal, h] of handlers) process.off(signal, h);
  };
}
