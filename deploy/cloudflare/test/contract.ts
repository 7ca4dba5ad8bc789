/**
 * Every answer the tests get is checked against openapi.yaml, the contract the relay's fake
 * is checked against too: its status must be documented for that path and method, and its
 * body must match the documented schema (each line of an NDJSON stream, one Event).
 */

import { Validator } from "@cfworker/json-schema";
import { exports } from "cloudflare:workers";
import { expect } from "vitest";
import { parse } from "yaml";

import document from "../openapi.yaml?raw";

export const KEY = "k".repeat(40);

type Json = Record<string, any>;
const spec = parse(document) as Json;

function resolved(node: Json): Json {
  if (typeof node.$ref !== "string") return node;
  const path = node.$ref.replace(/^#\//, "").split("/");
  return path.reduce((at: Json, part: string) => at[part], spec);
}

function validatorFor(schema: Json): Validator {
  return new Validator({ ...schema, components: spec.components } as never, "2020-12", false);
}

/** The documented path a concrete path matches (`/v1/jobs/abc` is `/v1/jobs/{id}`). */
function templateOf(path: string): string {
  const template = Object.keys(spec.paths).find((candidate) =>
    new RegExp(`^${candidate.replace(/\{[^}]+\}/g, "[^/]+")}$`).test(path),
  );
  if (template === undefined) throw new Error(`${path} is not in openapi.yaml`);
  return template;
}

export function assertConforms(method: string, path: string, status: number, contentType: string, body: string): void {
  const operation = spec.paths[templateOf(path)][method.toLowerCase()];
  expect(operation, `${method} ${path} is not in openapi.yaml`).toBeDefined();
  const documented = operation.responses[String(status)];
  expect(documented, `${method} ${path} answered ${status}, which openapi.yaml does not list`).toBeDefined();
  const media = contentType.split(";")[0].trim();
  const content = resolved(documented).content?.[media];
  expect(content, `${method} ${path} ${status} answered ${media}, not documented`).toBeDefined();
  if (media === "application/octet-stream") return; // bytes: documented, no schema to check
  const validator = validatorFor(content.schema);
  const values = media === "application/x-ndjson"
    ? body.split("\n").filter((line) => line !== "").map((line) => JSON.parse(line) as unknown)
    : [JSON.parse(body) as unknown];
  for (const value of values) {
    const result = validator.validate(value);
    expect(result.errors, `${method} ${path} ${status}: ${JSON.stringify(value).slice(0, 300)}`).toEqual([]);
  }
}

/** Whether a body is one openapi.yaml's schema allows (its shape, not base64): a job's
 * (`JobRequest`) by default, a run's (`RunRequest`). */
export function requestValid(body: unknown, schema: "JobRequest" | "RunRequest" = "JobRequest"): boolean {
  return validatorFor({ $ref: `#/components/schemas/${schema}` }).validate(body).valid;
}

export interface Answer {
  status: number;
  headers: Headers;
  text: string;
  body: any;
}

/** A request to the Worker with the key (unless `key` says otherwise), checked against the contract. */
export async function call(
  method: string,
  path: string,
  options: { body?: unknown; raw?: string; key?: string | null; headers?: Record<string, string> } = {},
): Promise<Answer> {
  const headers: Record<string, string> = { ...options.headers };
  const key = options.key === undefined ? KEY : options.key;
  if (key !== null) headers.authorization = `Bearer ${key}`;
  let payload: string | undefined = options.raw;
  if (options.body !== undefined) {
    payload = JSON.stringify(options.body);
    headers["content-type"] = "application/json";
  }
  const response = await exports.default.fetch(`https://jobs.test${path}`, { method, headers, body: payload });
  const text = new TextDecoder().decode(await response.arrayBuffer());
  const contentType = response.headers.get("content-type") ?? "";
  assertConforms(method, new URL(`https://jobs.test${path}`).pathname, response.status, contentType, text);
  if (method === "POST" && response.ok) {
    const schema = path.endsWith("/run") ? "RunRequest" : "JobRequest";
    const sent = options.body ?? JSON.parse(options.raw ?? "null");
    expect(requestValid(sent, schema), "the Worker took a body openapi.yaml refuses").toBe(true);
  }
  const body = contentType.startsWith("application/json") ? JSON.parse(text) : text;
  return { status: response.status, headers: response.headers, text, body };
}

/** A job body with everything a test does not set left at its default. */
export function job(id: string, fields: Record<string, unknown> = {}): Record<string, unknown> {
  return { id, argv: ["echo", "hi"], timeout_s: 30, tags: { "relay-cluster": "test", "relay-run": id }, ...fields };
}

/** A two-step job's create body: no command. */
export function container(id: string, fields: Record<string, unknown> = {}): Record<string, unknown> {
  return { id, timeout_s: 30, tags: { "relay-cluster": "test", "relay-run": id }, ...fields };
}

/** Wait (briefly) until `check` holds: the job runs beside the request that started it. */
export async function eventually<T>(check: () => Promise<T | undefined | null | false>, ms = 5000): Promise<T> {
  const until = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > until) throw new Error("it never happened");
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
