/**
 * The relay's job Worker: its HTTP contract is openapi.yaml beside this folder.
 *
 *   POST   /v1/jobs               create (idempotent on id) and start a job, with its
 *                                 command (one-shot) or without (two-step: it comes by run)
 *   POST   /v1/jobs/{id}/run      a two-step job's command, once (a retry is the same run)
 *   GET    /v1/jobs?tag=k=v       live jobs, for the relay's reaper
 *   GET    /v1/jobs/{id}          the job: state, exit code, output, destroyed_at
 *   GET    /v1/jobs/{id}/events   its output as NDJSON, live
 *   DELETE /v1/jobs/{id}          end it; 200 once the container is destroyed, else 202
 *   GET    /v1/jobs/{id}/files    a folder's entries in a kept container (?path=, under /workspace)
 *   GET    /v1/jobs/{id}/file     a file's bytes from it (?path=, ?limit=), streamed
 *
 * Every request is authorized first (auth.ts: fails closed); a job's routes go to its own
 * Durable Object (job.ts), which alone touches its container.
 */

import { refusal } from "./auth";
import { egressOf } from "./egress";
import { type Env, MAX_BODY_BYTES } from "./env";
import { answer, failure, HttpError, json, readBody } from "./http";
import type { Job } from "./job";
import { registryOf } from "./registry";
import { JOB_ID, parseJob, parseRun, relativePath, TAG_KEY } from "./request";
import { instanceTypeFor } from "./sizes";

export { Job } from "./job";
export { Registry } from "./registry";
export {
  ContainerProxy,
  SandboxBasic,
  SandboxLite,
  SandboxStandard1,
  SandboxStandard2,
  SandboxStandard3,
  SandboxStandard4,
} from "./sandbox";

const JOB_PATH = /^\/v1\/jobs\/([^/]+)$/;
const EVENTS_PATH = /^\/v1\/jobs\/([^/]+)\/events$/;
const RUN_PATH = /^\/v1\/jobs\/([^/]+)\/run$/;
const FILES_PATH = /^\/v1\/jobs\/([^/]+)\/files$/;
const FILE_PATH = /^\/v1\/jobs\/([^/]+)\/file$/;
const MAX_READ_LIMIT = 2 ** 31;
const MAX_LIST = 1000;

function jobOf(env: Env, id: string): DurableObjectStub<Job> {
  return env.JOBS.get(env.JOBS.idFromName(id));
}

function idOf(segment: string): string {
  if (!JOB_ID.test(segment)) throw new HttpError(400, "invalid_id", `a job id matches ${JOB_ID.source}`);
  return segment;
}

function notAllowed(allowed: string): Response {
  const refused = failure(405, "method_not_allowed", `this path takes ${allowed}`);
  refused.headers.set("allow", allowed);
  return refused;
}

/** A request, canonical (keys sorted): equal digests mean the same thing asked again. */
async function digestOf(spec: unknown): Promise<string> {
  const canonical = JSON.stringify(spec, (_key, value: unknown) =>
    typeof value === "object" && value !== null && !Array.isArray(value)
      ? Object.fromEntries(Object.entries(value).sort(([left], [right]) => (left < right ? -1 : 1)))
      : value,
  );
  const hash = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(canonical));
  return [...new Uint8Array(hash)].map((byte) => byte.toString(16).padStart(2, "0")).join("");
}

async function create(request: Request, env: Env): Promise<Response> {
  const spec = parseJob(await readBody(request, MAX_BODY_BYTES));
  const instanceType = instanceTypeFor(spec.size, env);
  const egress = egressOf(spec.egress);
  const created = await jobOf(env, spec.id).create(spec, await digestOf(spec), instanceType.name, egress);
  if (created.outcome === "conflict") {
    return failure(409, "id_conflict", `job ${spec.id} exists with another body`);
  }
  return json(created.job, created.outcome === "created" ? 201 : 200, { location: `/v1/jobs/${spec.id}` });
}

async function run(id: string, request: Request, env: Env): Promise<Response> {
  const command = parseRun(await readBody(request, MAX_BODY_BYTES));
  const ran = await jobOf(env, id).run(command, await digestOf(command));
  if (ran === null) return failure(404, "not_found", `no job ${id}`);
  switch (ran.outcome) {
    case "started":
      return json(ran.job, 202);
    case "existing":
      return json(ran.job, 200);
    case "already_run":
      return failure(409, "already_run", `job ${id} has its command already`);
    case "ended":
      return failure(409, "job_ended", `job ${id} ended (${ran.job.state}) before a command`);
  }
}

async function list(url: URL, env: Env): Promise<Response> {
  const tags = url.searchParams.getAll("tag").map((tag): [string, string] => {
    const split = tag.indexOf("=");
    const name = tag.slice(0, split);
    if (split < 0 || !TAG_KEY.test(name) || tag.length - split - 1 > 256) {
      throw new HttpError(400, "invalid_query", "tag takes name=value");
    }
    return [name, tag.slice(split + 1)];
  });
  const limitText = url.searchParams.get("limit") ?? "100";
  const limit = Number(limitText);
  if (!/^\d{1,4}$/.test(limitText) || limit < 1 || limit > MAX_LIST) {
    throw new HttpError(400, "invalid_query", `limit takes 1 to ${MAX_LIST}`);
  }
  const cursor = url.searchParams.get("cursor");
  if (cursor !== null) idOf(cursor);
  return json(await registryOf(env).list(tags, limit, cursor));
}

async function show(id: string, env: Env): Promise<Response> {
  const job = await jobOf(env, id).get();
  return job === null ? failure(404, "not_found", `no job ${id}`) : json(job);
}

async function follow(id: string, url: URL, env: Env): Promise<Response> {
  const afterText = url.searchParams.get("after") ?? "0";
  if (!/^\d{1,9}$/.test(afterText)) throw new HttpError(400, "invalid_query", "after takes a whole number");
  const stream = await jobOf(env, id).follow(Number(afterText));
  if (stream === null) return failure(404, "not_found", `no job ${id}`);
  return new Response(stream, {
    headers: { "content-type": "application/x-ndjson", "cache-control": "no-store" },
  });
}

const UNAVAILABLE = "the job's container is not kept now: a one-shot job, no command yet, or a destroy asked";

function pathQuery(url: URL, folder: boolean): string {
  const path = url.searchParams.get("path") ?? "";
  if (folder && path === "") return "";
  return relativePath("path", path);
}

async function listFiles(id: string, url: URL, env: Env): Promise<Response> {
  const listed = await jobOf(env, id).files(pathQuery(url, true));
  if (listed === "no_job") return failure(404, "not_found", `no job ${id}`);
  if (listed === "unavailable") return failure(409, "files_unavailable", UNAVAILABLE);
  if (listed === null) return failure(404, "no_such_path", "no such folder");
  return json({ files: listed });
}

async function readFile(id: string, url: URL, env: Env): Promise<Response> {
  const path = pathQuery(url, false);
  const limitText = url.searchParams.get("limit");
  const limit = limitText === null ? MAX_READ_LIMIT : Number(limitText);
  if (limitText !== null && (!/^\d{1,10}$/.test(limitText) || limit < 1 || limit > MAX_READ_LIMIT)) {
    throw new HttpError(400, "invalid_query", `limit takes 1 to ${MAX_READ_LIMIT}`);
  }
  const read = await jobOf(env, id).file(path, limit);
  if (read === "no_job") return failure(404, "not_found", `no job ${id}`);
  if (read === "unavailable") return failure(409, "files_unavailable", UNAVAILABLE);
  if (read === null) return failure(404, "no_such_path", "no such file");
  return new Response(read, {
    headers: { "content-type": "application/octet-stream", "cache-control": "no-store" },
  });
}

async function cancel(id: string, env: Env): Promise<Response> {
  const ended = await jobOf(env, id).cancel();
  if (ended === null) {
    // No job: a create that died before recording it may still be listed; unlist it.
    await registryOf(env).remove(id);
    return failure(404, "not_found", `no job ${id}`);
  }
  return json(ended.job, ended.confirmed ? 200 : 202);
}

async function route(request: Request, env: Env): Promise<Response> {
  const refused = await refusal(request, env);
  if (refused !== null) return refused;
  const url = new URL(request.url);
  const { method } = request;
  if (url.pathname === "/v1/jobs") {
    if (method === "POST") return create(request, env);
    if (method === "GET") return list(url, env);
    return notAllowed("GET, POST");
  }
  const ran = RUN_PATH.exec(url.pathname);
  if (ran !== null) {
    if (method === "POST") return run(idOf(ran[1]), request, env);
    return notAllowed("POST");
  }
  const folder = FILES_PATH.exec(url.pathname);
  if (folder !== null) {
    if (method === "GET") return listFiles(idOf(folder[1]), url, env);
    return notAllowed("GET");
  }
  const file = FILE_PATH.exec(url.pathname);
  if (file !== null) {
    if (method === "GET") return readFile(idOf(file[1]), url, env);
    return notAllowed("GET");
  }
  const events = EVENTS_PATH.exec(url.pathname);
  if (events !== null) {
    if (method === "GET") return follow(idOf(events[1]), url, env);
    return notAllowed("GET");
  }
  const job = JOB_PATH.exec(url.pathname);
  if (job !== null) {
    if (method === "GET") return show(idOf(job[1]), env);
    if (method === "DELETE") return cancel(idOf(job[1]), env);
    return notAllowed("GET, DELETE");
  }
  return failure(404, "not_found", "no such route");
}

export default {
  async fetch(request: Request, env: Env): Promise<Response> {
    try {
      return await route(request, env);
    } catch (error) {
      if (error instanceof HttpError) return answer(error);
      console.error("request failed:", error instanceof Error ? `${error.name}: ${error.message}` : error);
      return failure(500, "internal", "the Worker failed; its logs say why");
    }
  },
} satisfies ExportedHandler<Env>;
