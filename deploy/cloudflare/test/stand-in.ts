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
 *   write P T    writes T to the file P under /workspace (its folders implied), exits 0
 *   link P       makes P a symbolic link, exits 0
 *   anything     exits 0
 *
 * A machine's files answer `list` and `read` as the SDK's `listFiles` and `readFileStream`
 * would: a folder's entries one level deep, a missing path null.
 *
 * Faults: `destroyFailures` (the next N destroys reject), `destroyHangs`, `startFails`,
 * `startDelayMs` (a container slow to start).
 */

import type { FileEntry, Launch, Machine, Stream } from "../src/machine";
import type { Command } from "../src/request";

export interface Made {
  launch: Launch;
  started: number;
  /** Every command run on this machine, in order. */
  commands: Command[];
  destroyCalls: number;
  destroyed: boolean;
  /** Its files under /workspace, by path: their bytes, or "link". */
  files: Map<string, Uint8Array | "link">;
}

function listed(files: Map<string, Uint8Array | "link">, folder: string): FileEntry[] | null {
  const prefix = folder === "" ? "" : `${folder}/`;
  const entries = new Map<string, FileEntry>();
  for (const [path, content] of files) {
    if (!path.startsWith(prefix)) continue;
    const [name, ...deeper] = path.slice(prefix.length).split("/");
    if (deeper.length > 0) entries.set(name, { name, type: "directory", size: 0 });
    else if (content === "link") entries.set(name, { name, type: "symlink", size: 4 });
    else entries.set(name, { name, type: "file", size: content.byteLength });
  }
  return entries.size === 0 && folder !== "" ? null : [...entries.values()];
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
    const made: Made = { launch, started: 0, commands: [], destroyCalls: 0, destroyed: false, files: new Map() };
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
        const [name, path, text] = command.argv;
        if (name === "write") made.files.set(path, new TextEncoder().encode(text));
        if (name === "link") made.files.set(path, "link");
        return Promise.race([play(command, output), killed]);
      },
      list: async (path: string): Promise<FileEntry[] | null> => listed(made.files, path),
      read: async (path: string): Promise<ReadableStream<Uint8Array> | null> => {
        const content = made.files.get(path);
        if (content === undefined || content === "link") return null;
        // In two chunks, as a stream does: a cap may fall inside the first.
        const parts = [content.subarray(0, 3), content.subarray(3)];
        return new ReadableStream<Uint8Array>({
          pull(controller) {
            const next = parts.shift();
            if (next === undefined) controller.close();
            else controller.enqueue(next);
          },
        });
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
