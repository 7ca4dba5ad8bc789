/**
 * The Worker's bindings (wrangler.jsonc) and its settings, read once per use with their
 * defaults: `vars` in wrangler.jsonc, the key a secret (`wrangler secret put`).
 */

import type { Job } from "./job";
import type { Registry } from "./registry";
import type { JobSandbox } from "./sandbox";

export type SandboxBinding =
  | "SandboxLite"
  | "SandboxBasic"
  | "SandboxStandard1"
  | "SandboxStandard2"
  | "SandboxStandard3"
  | "SandboxStandard4";

export interface Env extends Partial<Record<SandboxBinding, DurableObjectNamespace<JobSandbox>>> {
  /** The key the relay presents (a secret; the Worker refuses everything without one). */
  JOB_WORKER_KEY?: string;
  JOBS: DurableObjectNamespace<Job>;
  REGISTRY: DurableObjectNamespace<Registry>;
  OUTPUT_LIMIT_BYTES?: string;
  SLEEP_AFTER_S?: string;
  DESTROY_TIMEOUT_S?: string;
  RETENTION_S?: string;
}

export interface Settings {
  /** Output kept per stream (stdout, stderr); the rest is dropped and flagged. */
  outputLimitBytes: number;
  /** The container's inactivity timeout: the second backstop after the deadline alarm. */
  sleepAfterS: number;
  /** How long a destroy may take before it counts as failed (and the alarm retries it). */
  destroyTimeoutS: number;
  /** How long a destroyed job's record is kept (and a retried create answered from it). */
  retentionS: number;
}

export const MAX_BODY_BYTES = 16 * 1024 * 1024;

function bounded(value: string | undefined, fallback: number, low: number, high: number): number {
  const parsed = value === undefined || value.trim() === "" ? fallback : Number(value);
  return Number.isFinite(parsed) ? Math.min(Math.max(parsed, low), high) : fallback;
}

export function settingsOf(env: Env): Settings {
  return {
    outputLimitBytes: bounded(env.OUTPUT_LIMIT_BYTES, 1_048_576, 1024, 8 * 1_048_576),
    sleepAfterS: bounded(env.SLEEP_AFTER_S, 120, 10, 3600),
    destroyTimeoutS: bounded(env.DESTROY_TIMEOUT_S, 20, 1, 120),
    retentionS: bounded(env.RETENTION_S, 86_400, 60, 30 * 86_400),
  };
}
