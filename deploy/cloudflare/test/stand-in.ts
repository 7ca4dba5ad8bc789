/**
 * The stand-in behind the machine interface (src/machine.ts): no container runs in these
 * tests, so this records what a container would have been asked (egress, the commands it
 * ran) and plays a command by its argv:
 *
 *   echo A B     prints "A B\n", exits 0
 *   fail N       prints "failing\n" to stderr, exits N
 *   print N      prints N "x" characters, exits 0
 *   sleep        runs until its container is destroyed (then the run rejects, as the SDK's)
 *   expire       as the SDK's own timeout: after timeout_s, exits 124
 *   anything     exits 0
 *
 * Faults: `destroyFailures` (the next N destroys reject), `destroyHangs`, `startFails`,
 * `startDelayMs` (a container slow to start).
 */

import type { Launch, Machine, Stream } from "../src/machine";
import type { Command } from "../src/request";

export interface Made {
  launch: Launch;
  started: number;
  /** Every command run on this machine, in order. */
  commands: Command[];
  destroyCalls: number;
  destroyed: boolean;
}

class StandIn {
  /** Every machine made, by job id: one per container the Worker would have started. */
  readonly made = new Map<string, Made[]>();
  destroyFailures = 0;
  destroyHangs = false;
  startFails = false;
  startDelayMs = 0;

  reset(): void {
    this.made.clear();
    this.destroyFailures = 0;
    this.destroyHangs = false;
    this.startFails = false;
    this.startDelayMs = 0;
  }

  /** The machines whose container started. */
  started(id: string): Made[] {
    return (this.made.get(id) ?? []).filter((made) => made.started > 0);
  }

  /** Every command run for the job, whichever machine ran it. */
  commands(id: string): Command[] {
    return (this.made.get(id) ?? []).flatMap((made) => made.commands);
  }

  machine(launch: Launch): Machine {
    const made: Made = { launch, started: 0, commands: [], destroyCalls: 0, destroyed: false };
    this.made.set(launch.spec.id, [...(this.made.get(launch.spec.id) ?? []), made]);
    let kill: (reason: Error) => void = () => {};
    const killed = new Promise<never>((_, reject) => (kill = reject));
    killed.catch(() => {});
    return {
      start: async (): Promise<void> => {
        if (this.startDelayMs > 0) await new Promise((resolve) => setTimeout(resolve, this.startDelayMs));
        if (this.startFails) throw new Error("the container did not start");
        made.started += 1;
      },
      run: async (command: Command, output: (stream: Stream, text: string) => void): Promise<number> => {
        made.commands.push(command);
        return Promise.race([play(command, output), killed]);
      },
      destroy: async (): Promise<void> => {
        made.destroyCalls += 1;
        if (this.destroyHangs) return new Promise<void>(() => {});
        if (this.destroyFailures > 0) {
          this.destroyFailures -= 1;
          throw new Error("the control plane did not answer");
        }
        made.destroyed = true;
        kill(new Error("the container was destroyed"));
      },
    };
  }
}

async function play(command: Command, output: (stream: Stream, text: string) => void): Promise<number> {
  const [name, ...rest] = command.argv;
  await Promise.resolve();
  switch (name) {
    case "echo":
      output("stdout", `${rest.join(" ")}\n`);
      return 0;
    case "fail":
      output("stderr", "failing\n");
      return Number(rest[0]);
    case "print":
      output("stdout", "x".repeat(Number(rest[0])));
      return 0;
    case "sleep":
      return new Promise<number>(() => {});
    case "expire":
      await new Promise((resolve) => setTimeout(resolve, command.timeout_s * 1000));
      output("stderr", `Command timed out after ${command.timeout_s * 1000} ms\n`);
      return 124;
    default:
      return 0;
  }
}

export const standIn = new StandIn();
