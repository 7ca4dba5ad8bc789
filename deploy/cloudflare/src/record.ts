/**
 * What the Job Durable Object keeps about its job, and the one answer built from it
 * (openapi.yaml, `Job`): state, exit code, output kept, and the container's end.
 */

import type { Stream } from "./machine";
import type { Command, JobSpec } from "./request";

export type JobState =
  | "starting"
  | "ready"
  | "running"
  | "exited"
  | "timed_out"
  | "canceled"
  | "lost"
  | "error";
export type DestroyedBy = "exit" | "delete" | "alarm" | "lost";

const FINAL: ReadonlySet<JobState> = new Set(["exited", "timed_out", "canceled", "lost", "error"]);

export function isFinal(state: JobState): boolean {
  return FINAL.has(state);
}

/** Whether work for the job goes on in its object's memory (its start, or its command). */
export function isBusy(state: JobState): boolean {
  return state === "starting" || state === "running";
}

export interface JobRecord {
  spec: JobSpec;
  /** SHA-256 of the canonical request: a retry with the same body is the same job. */
  digest: string;
  /** The command, from the create (one-shot) or its one run (two-step); null until then. */
  command: Command | null;
  /** SHA-256 of the canonical run body: a retried run is the same run. */
  run_digest: string | null;
  /** A two-step job's container outlives its command, until a DELETE or the alarm. */
  keep: boolean;
  instance_type: string;
  state: JobState;
  exit_code: number | null;
  error: { code: string; message: string } | null;
  created_at: number;
  /** created + timeout + grace: the alarm destroys the container then, whatever else. */
  deadline: number;
  started_at: number | null;
  ended_at: number | null;
  destroyed_at: number | null;
  destroyed_by: DestroyedBy | null;
  /** What first asked for the destroy (null: nothing yet); the alarm retries it. */
  destroy_wanted: DestroyedBy | null;
  destroy_failures: number;
  stdout_truncated: boolean;
  stderr_truncated: boolean;
}

export interface OutputEvent {
  seq: number;
  type: Stream;
  data: string;
}

export interface JobView {
  id: string;
  state: JobState;
  exit_code: number | null;
  error: { code: string; message: string } | null;
  stdout: string;
  stderr: string;
  stdout_truncated: boolean;
  stderr_truncated: boolean;
  events: number;
  instance_type: string;
  egress: string[];
  tags: Record<string, string>;
  timeout_s: number;
  grace_s: number;
  created_at: string;
  deadline: string;
  started_at: string | null;
  ended_at: string | null;
  destroyed_at: string | null;
  destroyed_by: DestroyedBy | null;
  destroy_pending: boolean;
}

const iso = (time: number | null): string | null => (time === null ? null : new Date(time).toISOString());

export function viewOf(record: JobRecord, events: readonly OutputEvent[]): JobView {
  const text = (stream: Stream): string =>
    events
      .filter((event) => event.type === stream)
      .map((event) => event.data)
      .join("");
  return {
    id: record.spec.id,
    state: record.state,
    exit_code: record.exit_code,
    error: record.error,
    stdout: text("stdout"),
    stderr: text("stderr"),
    stdout_truncated: record.stdout_truncated,
    stderr_truncated: record.stderr_truncated,
    events: events.length,
    instance_type: record.instance_type,
    egress: record.spec.egress,
    tags: record.spec.tags,
    timeout_s: record.spec.timeout_s,
    grace_s: record.spec.grace_s,
    created_at: new Date(record.created_at).toISOString(),
    deadline: new Date(record.deadline).toISOString(),
    started_at: iso(record.started_at),
    ended_at: iso(record.ended_at),
    destroyed_at: iso(record.destroyed_at),
    destroyed_by: record.destroyed_by,
    destroy_pending: record.destroyed_at === null && record.destroy_wanted !== null,
  };
}

/** The longest prefix of `text` that fits in `limit` UTF-8 bytes (never half a character). */
export function takeBytes(text: string, limit: number): string {
  const encoder = new TextEncoder();
  if (encoder.encode(text).byteLength <= limit) return text;
  let used = 0;
  let end = 0;
  for (const character of text) {
    const size = encoder.encode(character).byteLength;
    if (used + size > limit) break;
    used += size;
    end += character.length;
  }
  return text.slice(0, end);
}

export function byteLength(text: string): number {
  return new TextEncoder().encode(text).byteLength;
}
