/**
 * The bodies of `POST /v1/jobs` and `POST /v1/jobs/{id}/run`, checked field by field
 * (openapi.yaml, `JobRequest` and `RunRequest`): every field typed and bounded, unknown
 * fields refused, paths confined to `/workspace`. A bad body is a 400 naming the field;
 * nothing in it reaches a container unchecked.
 *
 * A job is created with its command (`argv` and what goes with it: the one-shot form) or
 * without (the two-step form: the command comes later, once, by `POST /v1/jobs/{id}/run`).
 */

import { HttpError } from "./http";
import type { Size } from "./sizes";

/** The Sandbox SDK's own rule for a sandbox name (1-63 characters, no hyphen at the end, none
 * of its reserved names), lowercase so it is one Durable Object whatever `normalizeId` says. */
export const JOB_ID = /^[a-z0-9](?:[a-z0-9_.-]{0,61}[a-z0-9_.])?$/;
const RESERVED_IDS = new Set(["www", "api", "admin", "root", "system", "cloudflare", "workers"]);
export const TAG_KEY = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$/;
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]{0,127}$/;
const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;
const CONTROL = /[\u0000-\u001f\u007f]/;

export const LIMITS = {
  argvItems: 256,
  argChars: 16_384,
  envVars: 128,
  envValueChars: 32_768,
  files: 512,
  pathBytes: 1024,
  pathParts: 32,
  nameBytes: 255,
  stdinBytes: 1_048_576,
  timeoutS: 86_400,
  graceS: 3600,
  egressHosts: 64,
  tags: 16,
  tagValueChars: 256,
} as const;

export const DEFAULT_GRACE_S = 30;

/** A job's command: what its container runs, once. */
export interface Command {
  argv: string[];
  env: Record<string, string>;
  /** Paths relative to /workspace, to base64 content. */
  files: Record<string, string>;
  /** Base64, or null for an empty stdin. */
  stdin: string | null;
  /** Relative to /workspace; null is /workspace itself. */
  workdir: string | null;
  /** The command is killed after this long (exit 124). */
  timeout_s: number;
}

/** A job as asked for: what the Job Durable Object records and runs. */
export interface JobSpec {
  id: string;
  /** With the deadline's grace, what the job's whole life is bounded by. */
  timeout_s: number;
  grace_s: number;
  egress: string[];
  size: Size | null;
  tags: Record<string, string>;
  /** Given at create (the one-shot form), else null until `POST /v1/jobs/{id}/run`. */
  command: Command | null;
}

const COMMAND_FIELDS = ["argv", "env", "files", "stdin", "workdir"] as const;
const JOB_FIELDS = new Set(["id", ...COMMAND_FIELDS, "timeout_s", "grace_s", "egress", "size", "tags"]);
const RUN_FIELDS = new Set([...COMMAND_FIELDS, "timeout_s"]);

function invalid(field: string, problem: string): HttpError {
  return new HttpError(400, "invalid_request", `${field}: ${problem}`);
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function text(field: string, value: unknown, maxChars: number): string {
  if (typeof value !== "string") throw invalid(field, "must be a string");
  if (value.length > maxChars) throw invalid(field, `must be at most ${maxChars} characters`);
  if (value.includes("\u0000")) throw invalid(field, "must not contain a NUL character");
  return value;
}

function base64(field: string, value: unknown, maxBytes: number): string {
  if (typeof value !== "string" || !BASE64.test(value)) throw invalid(field, "must be base64");
  if ((value.length / 4) * 3 > maxBytes + 2) throw invalid(field, `must be at most ${maxBytes} bytes`);
  return value;
}

function number(field: string, value: unknown, low: number, high: number, integer = false): number {
  if (typeof value !== "number" || !Number.isFinite(value)) throw invalid(field, "must be a number");
  if (integer && !Number.isInteger(value)) throw invalid(field, "must be a whole number");
  if (value < low || value > high) throw invalid(field, `must be between ${low} and ${high}`);
  return value;
}

function timeout(value: unknown): number {
  const seconds = number("timeout_s", value, 0, LIMITS.timeoutS);
  if (seconds === 0) throw invalid("timeout_s", "must be more than 0");
  return seconds;
}

/** A path relative to /workspace, in canonical form: no `..`, `.`, empty or absolute part. */
export function relativePath(field: string, value: unknown): string {
  const path = text(field, value, LIMITS.pathBytes);
  const parts = path.split("/");
  if (parts.some((part) => part === "" || part === "." || part === "..")) {
    throw invalid(field, "must be a relative path inside /workspace (no '..', '.', or leading '/')");
  }
  if (new TextEncoder().encode(path).byteLength > LIMITS.pathBytes) {
    throw invalid(field, `must be at most ${LIMITS.pathBytes} bytes`);
  }
  if (parts.length > LIMITS.pathParts) throw invalid(field, `must be at most ${LIMITS.pathParts} names deep`);
  if (parts.some((part) => new TextEncoder().encode(part).byteLength > LIMITS.nameBytes)) {
    throw invalid(field, `each name must be at most ${LIMITS.nameBytes} bytes`);
  }
  return path;
}

function strings(field: string, value: unknown, maxItems: number, maxChars: number): string[] {
  if (!Array.isArray(value)) throw invalid(field, "must be an array of strings");
  if (value.length > maxItems) throw invalid(field, `must have at most ${maxItems} items`);
  return value.map((item, index) => text(`${field}[${index}]`, item, maxChars));
}

function mapping(field: string, value: unknown, maxItems: number): [string, unknown][] {
  if (!isObject(value)) throw invalid(field, "must be an object");
  const entries = Object.entries(value);
  if (entries.length > maxItems) throw invalid(field, `must have at most ${maxItems} entries`);
  return entries;
}

function size(value: unknown): Size | null {
  if (value === undefined || value === null) return null;
  const entries = mapping("size", value, 3);
  const keys = entries.map(([key]) => key).sort().join(",");
  if (keys !== "cpu,disk_mb,memory_mb") throw invalid("size", "must have cpu, memory_mb and disk_mb");
  const given = Object.fromEntries(entries);
  return {
    cpu: number("size.cpu", given.cpu, 1 / 64, 1024),
    memory_mb: number("size.memory_mb", given.memory_mb, 1, 16_777_216, true),
    disk_mb: number("size.disk_mb", given.disk_mb, 1, 16_777_216, true),
  };
}

/** Two paths that cannot both be files (the same path, or one a folder of the other). */
function clash(paths: string[]): [string, string] | null {
  const sorted = [...paths].sort();
  const seen = new Set<string>();
  for (const path of sorted) {
    const parts = path.split("/");
    for (let depth = 1; depth < parts.length; depth++) {
      const folder = parts.slice(0, depth).join("/");
      if (seen.has(folder)) return [folder, path];
    }
    seen.add(path);
  }
  return null;
}

function objectOf(body: string): Record<string, unknown> {
  let given: unknown;
  try {
    given = JSON.parse(body);
  } catch {
    throw new HttpError(400, "invalid_body", "the body is not JSON");
  }
  if (!isObject(given)) throw new HttpError(400, "invalid_body", "the body must be a JSON object");
  return given;
}

function onlyFields(given: Record<string, unknown>, fields: ReadonlySet<string>, what: string): void {
  const unknown = Object.keys(given).filter((key) => !fields.has(key));
  if (unknown.length > 0) throw invalid(unknown[0], `is not a field of ${what}`);
}

/** The command fields of a body (argv, env, files, stdin, workdir), with `timeout_s`. */
function commandOf(given: Record<string, unknown>, timeoutS: number): Command {
  const argv = strings("argv", given.argv, LIMITS.argvItems, LIMITS.argChars);
  if (argv.length === 0) throw invalid("argv", "must have at least one item");

  const env: Record<string, string> = {};
  for (const [name, value] of mapping("env", given.env ?? {}, LIMITS.envVars)) {
    if (!ENV_NAME.test(name)) throw invalid("env", `${JSON.stringify(name.slice(0, 64))} is not a variable name`);
    env[name] = text(`env.${name}`, value, LIMITS.envValueChars);
  }
  const files: Record<string, string> = {};
  for (const [path, content] of mapping("files", given.files ?? {}, LIMITS.files)) {
    files[relativePath("files", path)] = base64(`files[${JSON.stringify(path)}]`, content, 32 * 1024 * 1024);
  }
  const clashing = clash(Object.keys(files));
  if (clashing !== null) throw invalid("files", `${clashing[0]} is both a file and a folder of ${clashing[1]}`);
  const stdin = given.stdin === undefined || given.stdin === null ? null : base64("stdin", given.stdin, LIMITS.stdinBytes);
  const workdir =
    given.workdir === undefined || given.workdir === null ? null : relativePath("workdir", given.workdir);
  if (workdir !== null) {
    const inside = Object.keys(files).find((path) => workdir === path || workdir.startsWith(`${path}/`));
    if (inside !== undefined) throw invalid("workdir", `is the file ${inside}, not a folder`);
  }
  return { argv, env, files, stdin, workdir, timeout_s: timeoutS };
}

export function parseJob(body: string): JobSpec {
  const given = objectOf(body);
  onlyFields(given, JOB_FIELDS, "a job");
  if (typeof given.id !== "string" || !JOB_ID.test(given.id) || RESERVED_IDS.has(given.id)) {
    throw invalid("id", `must match ${JOB_ID.source}`);
  }
  const timeoutS = timeout(given.timeout_s);
  let command: Command | null = null;
  if (given.argv !== undefined) {
    command = commandOf(given, timeoutS);
  } else {
    const orphan = COMMAND_FIELDS.find((field) => given[field] !== undefined);
    if (orphan !== undefined) {
      throw invalid(orphan, "goes with a command: give argv here, or all of it to POST /v1/jobs/{id}/run");
    }
  }
  const tags: Record<string, string> = {};
  for (const [key, value] of mapping("tags", given.tags ?? {}, LIMITS.tags)) {
    if (!TAG_KEY.test(key)) throw invalid("tags", `${JSON.stringify(key.slice(0, 64))} is not a tag name`);
    const tag = text(`tags.${key}`, value, LIMITS.tagValueChars);
    if (CONTROL.test(tag)) throw invalid(`tags.${key}`, "must not contain control characters");
    tags[key] = tag;
  }
  return {
    id: given.id,
    timeout_s: timeoutS,
    grace_s: given.grace_s === undefined ? DEFAULT_GRACE_S : number("grace_s", given.grace_s, 0, LIMITS.graceS),
    egress: strings("egress", given.egress ?? [], LIMITS.egressHosts, 253),
    size: size(given.size),
    tags,
    command,
  };
}

/** The body of `POST /v1/jobs/{id}/run`: a two-step job's command. */
export function parseRun(body: string): Command {
  const given = objectOf(body);
  onlyFields(given, RUN_FIELDS, "a run");
  return commandOf(given, timeout(given.timeout_s));
}
