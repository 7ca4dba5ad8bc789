/**
 * The container calls, behind one small interface: what the Job Durable Object asks of the
 * container that runs its command. `sandbox.ts` implements it with the Sandbox SDK; the
 * Worker's tests put a stand-in behind it (test/stand-in.ts), since no container runs
 * there. Keeping the SDK to one module is also what makes the SDK's 1.0 migration (see
 * README.md) a change of one file.
 */

import type { Egress } from "./egress";
import type { Command, JobSpec } from "./request";
import type { InstanceType } from "./sizes";

export type Stream = "stdout" | "stderr";

/** What a machine is made for: one job, its instance type and egress, its idle backstop. */
export interface Launch {
  spec: JobSpec;
  instanceType: InstanceType;
  egress: Egress;
  sleepAfterS: number;
}

/** One entry of a folder in the container, as the Sandbox SDK's `listFiles` gives it: a
 * link is `symlink` (never followed), a FIFO, socket or device `other`. */
export interface FileEntry {
  name: string;
  type: "file" | "directory" | "symlink" | "other";
  size: number;
}

export interface Machine {
  /** Applies the egress policy (before the container starts), then starts the container. */
  start(): Promise<void>;
  /**
   * Writes the command's files and stdin, runs it to its end and answers its exit code
   * (124 when the container killed it at its `timeout_s`); output as it comes. Rejects
   * when the container fails under it; a destroy is how a run is stopped early.
   */
  run(command: Command, output: (stream: Stream, text: string) => void): Promise<number>;
  /** The entries of a folder under /workspace (`path` relative to it, "" for itself); null
   * when there is no such folder. */
  list(path: string): Promise<FileEntry[] | null>;
  /** A file under /workspace, its bytes streamed; null when there is no such file. */
  read(path: string): Promise<ReadableStream<Uint8Array> | null>;
  /** Destroys the container (SIGKILL); resolves only once the platform has done it. */
  destroy(): Promise<void>;
}
