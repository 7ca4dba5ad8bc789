/**
 * The stand-in behind the machine interface (src/machine.ts): no container runs in these
 * tests, so this records what a container would have been asked (egress, files, the
 * command) and plays a command by its argv:
 *
 *   echo A B     prints "A B\n", exits 0
 *   fail N       prints "failing\n" to stderr, exits N
 *   print N      prints N "x" characters, exits 0
 *   sleep        runs until its container is destroyed (then the run rejects, as the SDK's)
 *   expire       as the SDK's own timeout: after timeout_s, exits 124
 *   anything     exits 0
 *
 * Faults: `destroyFailures` (the next N destroys reject), `destroyHangs`, `prepareFails`.
 */

import type { Launch, Machine, Stream } from "../src/machine";

export interface Made {
  launch: Launch;
  prepared: number;
  runs: number;
  destroyCalls: number;
  destroyed: boolean;
}

class StandIn {
  /** Every machine made, by job id: one per container the Worker would have started. */
  readonly made = new Map<string, Made[]>();
  destroyFailures = 0;
  destroyHangs = false;
  prepareFails = false;

  reset(): void {
    this.made.clear();
    this.destroyFailures = 0;
    this.destroyHangs = false;
    this.prepareFails = false;
  }

  /** The machines that ran a command (prepare reached). */
  started(id: string): Made[] {
    return (this.made.get(id) ?? []).filter((made) => made.prepared > 0);
  }

  machine(launch: Launch): Machine {
    const made: Made = { launch, prepared: 0, runs: 0, destroyCalls: 0, destroyed: false };
    this.made.set(launch.spec.id, [...(this.made.get(launch.spec.id) ?? []), made]);
    let kill: (reason: Error) => void = () => {};
    const killed = new Promise<never>((_, reject) => (kill = reject));
    killed.catch(() => {});
    return {
      prepare: async (): Promise<void> => {
        if (this.prepareFails) throw new Error("the container did not start");
        made.prepared += 1;
      },
      run: async (output: (stream: Stream, text: string) => void): Promise<number> => {
        made.runs += 1;
        return Promise.race([play(launch, output), killed]);
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

async function play(launch: Launch, output: (stream: Stream, text: string) => void): Promise<number> {
  const [command, ...rest] = launch.spec.argv;
  await Promise.resolve();
  switch (command) {
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
      await new Promise((resolve) => setTimeout(resolve, launch.spec.timeout_s * 1000));
      output("stderr", `Command timed out after ${launch.spec.timeout_s * 1000} ms\n`);
      return 124;
    default:
      return 0;
  }
}

export const standIn = new StandIn();
