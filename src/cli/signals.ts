// One handler for the signals that stop a command: SIGINT (Ctrl-C), SIGTERM (what docker stop, systemd and job
// schedulers send) and SIGHUP (the terminal closed). The first asks the command to stop cleanly (finish or
// abandon the step, checkpoint, release the lock); a second one exits at once, after `last` (synchronous
// cleanup such as releasing the lock). Exit codes are the shell's 128 + signal number.
export const SIGNAL_EXIT_CODES = { SIGHUP: 129, SIGINT: 130, SIGTERM: 143 } as const;
export type StopSignal = keyof typeof SIGNAL_EXIT_CODES;
/** A repeat of the first signal within this long is the same request (see below). */
const REPEAT_MS = 1000;

/** Installs the handler for every stop signal; returns its removal. */
export function onStopSignal(first: (signal: StopSignal) => void, last: () => void): () => void {
  let seen: { signal: StopSignal; at: number } | null = null;
  const handlers = (Object.keys(SIGNAL_EXIT_CODES) as StopSignal[]).map((signal) => {
    const h = () => {
      // The same signal again within REPEAT_MS is the same request delivered twice (sent to the process group
      // and relayed by a parent, as stderr-relay.ts does, or systemd's and a wrapper's), not a second one.
      if (seen && seen.signal === signal && Date.now() - seen.at < REPEAT_MS) return;
      if (seen) {
        last();
        process.exit(SIGNAL_EXIT_CODES[signal]);
      }
      seen = { signal, at: Date.now() };
      first(signal);
    };
    process.on(signal, h);
    return [signal, h] as const;
  });
  return () => {
    for (const [signal, h] of handlers) process.off(signal, h);
  };
}
