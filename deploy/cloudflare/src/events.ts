/**
 * A job's live output as NDJSON (openapi.yaml, `GET /v1/jobs/{id}/events`): one JSON object
 * a line, `{"seq", "type": "stdout"|"stderr", "data"}` for output in order, `{"type":
 * "ping"}` after HEARTBEAT_MS of quiet (so no proxy closes an idle stream), and last
 * `{"type": "end", "state", "exit_code", ...}` once the job has ended. `?after=N` skips the first N
 * output events, so a client whose stream was cut follows on where it left off.
 */

import type { JobView, OutputEvent } from "./record";

export const HEARTBEAT_MS = 15_000;

/** What the stream reads of its job (the Job Durable Object). */
export interface Followed {
  snapshot(): { events: readonly OutputEvent[]; final: boolean; view: JobView | null };
  readonly changes: { wait(): Promise<void> };
}

function endOf(view: JobView | null): Record<string, unknown> {
  if (view === null) return { type: "end", state: "lost", exit_code: null, error: null };
  const { state, exit_code, error, stdout_truncated, stderr_truncated, destroyed_at } = view;
  return { type: "end", state, exit_code, error, stdout_truncated, stderr_truncated, destroyed_at };
}

export function outputStream(job: Followed, after: number): ReadableStream<Uint8Array> {
  const encoder = new TextEncoder();
  const line = (value: unknown): Uint8Array => encoder.encode(`${JSON.stringify(value)}\n`);
  let cursor = after;
  let quiet: ReturnType<typeof setTimeout> | undefined;
  return new ReadableStream<Uint8Array>({
    async pull(controller): Promise<void> {
      for (;;) {
        const changed = job.changes.wait();
        const { events, final, view } = job.snapshot();
        if (events.length > cursor) {
          for (const event of events.slice(cursor)) controller.enqueue(line(event));
          cursor = events.length;
          return;
        }
        if (final) {
          controller.enqueue(line(endOf(view)));
          controller.close();
          return;
        }
        const pinged = await Promise.race([
          changed.then(() => false),
          new Promise<boolean>((resolve) => {
            quiet = setTimeout(() => resolve(true), HEARTBEAT_MS);
          }),
        ]);
        if (quiet !== undefined) clearTimeout(quiet);
        if (pinged) {
          controller.enqueue(line({ type: "ping" }));
          return;
        }
      }
    },
    cancel(): void {
      if (quiet !== undefined) clearTimeout(quiet);
    },
  });
}
