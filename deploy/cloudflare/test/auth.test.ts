import { env } from "cloudflare:test";
import { afterEach, describe, expect, it, vi } from "vitest";

import worker from "../src/index";
import { call, job, KEY } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => {
  standIn.reset();
  vi.restoreAllMocks();
});

const ROUTES: [string, string][] = [
  ["POST", "/v1/jobs"],
  ["GET", "/v1/jobs"],
  ["GET", "/v1/jobs/run_a"],
  ["GET", "/v1/jobs/run_a/events"],
  ["DELETE", "/v1/jobs/run_a"],
  ["GET", "/nothing/here"],
];

async function fetchWith(key: string | undefined, method: string, path: string, authorization?: string) {
  const headers: Record<string, string> = authorization === undefined ? {} : { authorization };
  const body = method === "POST" ? JSON.stringify(job("run_a")) : undefined;
  return worker.fetch(new Request(`https://jobs.test${path}`, { method, headers, body }), { ...env, JOB_WORKER_KEY: key });
}

describe("a Worker with no key configured", () => {
  it.each([undefined, "", "short-key-is-not-a-secret"])("refuses every request (key %j)", async (key) => {
    for (const [method, path] of ROUTES) {
      const answer = await fetchWith(key, method, path, `Bearer ${key ?? "anything"}`);
      expect(answer.status, `${method} ${path}`).toBe(403);
      expect(await answer.json()).toMatchObject({ error: { code: "key_not_configured" } });
    }
    expect(standIn.made.size).toBe(0);
  });
});

describe("a Worker with its key", () => {
  it("refuses a request without the key, or with another", async () => {
    for (const authorization of [undefined, "", "Bearer", `Basic ${KEY}`, `Bearer ${KEY}x`, `Bearer ${"k".repeat(39)}`, `bearer  ${KEY}`]) {
      const answer = await call("POST", "/v1/jobs", { body: job("run_refused"), key: null, headers: authorization === undefined ? {} : { authorization } });
      expect(answer.status, String(authorization)).toBe(401);
      expect(answer.headers.get("www-authenticate")).toBe("Bearer");
    }
    expect(standIn.made.size).toBe(0);
  });

  it("never takes the key from the URL", async () => {
    for (const query of [`?key=${KEY}`, `?token=${KEY}`, `?authorization=Bearer%20${KEY}`]) {
      expect((await call("GET", `/v1/jobs${query}`, { key: null })).status).toBe(401);
    }
  });

  it("compares the key in constant time, hashed to one length", async () => {
    const compare = vi.spyOn(crypto.subtle, "timingSafeEqual");
    expect((await call("GET", "/v1/jobs", { key: "x" })).status).toBe(401);
    expect((await call("GET", "/v1/jobs")).status).toBe(200);
    expect(compare).toHaveBeenCalledTimes(2);
    for (const [left, right] of compare.mock.calls) {
      expect([(left as ArrayBuffer).byteLength, (right as ArrayBuffer).byteLength]).toEqual([32, 32]);
    }
  });

  it("answers an unknown route with 404 and a wrong method with 405, as JSON", async () => {
    const headers = { authorization: `Bearer ${KEY}` };
    const unknown = await worker.fetch(new Request("https://jobs.test/v2/things", { headers }), env);
    expect(unknown.status).toBe(404);
    expect(await unknown.json()).toMatchObject({ error: { code: "not_found" } });
    const wrong = await worker.fetch(new Request("https://jobs.test/v1/jobs/run_a", { method: "PUT", headers }), env);
    expect(wrong.status).toBe(405);
    expect(wrong.headers.get("allow")).toBe("GET, DELETE");
  });
});
