import { env } from "cloudflare:test";
import { afterEach, describe, expect, it } from "vitest";

import worker from "../src/index";
import { call, job, KEY, requestValid } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

async function refused(body: unknown, status = 400): Promise<string> {
  const answer = await call("POST", "/v1/jobs", { body });
  expect(answer.status, JSON.stringify(body).slice(0, 200)).toBe(status);
  expect(standIn.made.size).toBe(0);
  return answer.body.error.code as string;
}

describe("a hostile body", () => {
  it("is refused when over the size limit, by its length or while read", async () => {
    const huge = JSON.stringify(job("run_huge", { env: { BIG: "x".repeat(16 * 1024 * 1024) } }));
    const declared = await call("POST", "/v1/jobs", { raw: huge });
    expect(declared.status).toBe(413);
    let sent = 0;
    const chunk = new TextEncoder().encode("x".repeat(1024 * 1024));
    const endless = new ReadableStream<Uint8Array>({
      pull(controller) {
        sent += chunk.byteLength;
        if (sent > 64 * 1024 * 1024) controller.close();
        else controller.enqueue(chunk);
      },
    });
    const streamed = await worker.fetch(
      new Request("https://jobs.test/v1/jobs", { method: "POST", headers: { authorization: `Bearer ${KEY}` }, body: endless }),
      env,
    );
    expect(streamed.status).toBe(413);
    expect(sent).toBeLessThan(20 * 1024 * 1024);
    expect(standIn.made.size).toBe(0);
  });

  it.each([
    ["not JSON", "{id: run"],
    ["a JSON array", "[1, 2]"],
    ["JSON null", "null"],
    ["not UTF-8", "\udcff"],
  ])("is refused when it is %s", async (_, raw) => {
    const answer = await call("POST", "/v1/jobs", { raw });
    expect(answer.status).toBe(400);
    expect(answer.body.error.code).toBe("invalid_body");
  });

  it.each([
    ["an unknown field", { image: "ubuntu" }],
    ["argv as a string", { argv: "echo hi" }],
    ["an empty argv", { argv: [] }],
    ["a number in argv", { argv: ["echo", 1] }],
    ["a NUL in argv", { argv: ["echo", "a\u0000b"] }],
    ["an env value that is no string", { env: { A: 1 } }],
    ["an env name that is no name", { env: { "A=B": "x" } }],
    ["a timeout of 0", { timeout_s: 0 }],
    ["a negative timeout", { timeout_s: -1 }],
    ["a timeout over a day", { timeout_s: 86_401 }],
    ["a timeout as a string", { timeout_s: "30" }],
    ["stdin that is not base64", { stdin: "not base64!" }],
    ["file content that is not base64", { files: { "a.txt": "%%%" } }],
    ["tags that are not strings", { tags: { a: 1 } }],
    ["a size with an extra field", { size: { cpu: 1, memory_mb: 1, disk_mb: 1, gpu: 1 } }],
    ["a size in the wrong type", { size: { cpu: "1", memory_mb: 1, disk_mb: 1 } }],
    ["egress that is not a list", { egress: "*" }],
  ])("is refused when it has %s", async (name, fields) => {
    const body = job("run_bad", fields);
    expect(await refused(body)).toBe("invalid_request");
    // What the contract's schema can say, it says too (base64 it leaves to the Worker).
    if (!name.includes("base64")) expect(requestValid(body)).toBe(false);
  });

  it.each(["RUN_UPPER", "../etc", "a/b", "-x", "x-", "admin", "x".repeat(64), "", 7])(
    "is refused with the id %j",
    async (id) => {
      expect(await refused(job("run_x", { id }))).toBe("invalid_request");
      expect(requestValid(job("run_x", { id }))).toBe(false);
    },
  );

  it.each(["../escape", "/etc/passwd", "a/../../b", "a//b", "./a", "a/.", "a/", "a\u0000b"])(
    "is refused with a file or workdir at %j",
    async (path) => {
      for (const body of [job("run_path", { files: { [path]: "aGk=" } }), job("run_path", { workdir: path })]) {
        expect(await refused(body)).toBe("invalid_request");
        expect(requestValid(body)).toBe(false);
      }
    },
  );

  it("is refused when the workdir is one of its files", async () => {
    expect(await refused(job("run_path", { files: { "a/b": "aGk=" }, workdir: "a/b/c" }))).toBe("invalid_request");
    expect(await refused(job("run_path", { files: { a: "aGk=", "a/b": "aGk=" } }))).toBe("invalid_request");
  });

  it("is refused in a path or query too", async () => {
    for (const path of ["/v1/jobs/RUN_UPPER", "/v1/jobs/..%2F..%2Fx", "/v1/jobs/a%00b/events"]) {
      const answer = await call("GET", path);
      expect(answer.status, path).toBe(400);
      expect(answer.body.error.code).toBe("invalid_id");
    }
    for (const query of ["?limit=0", "?limit=1001", "?limit=x", "?tag=novalue", "?cursor=UP", "?tag==x"]) {
      expect((await call("GET", `/v1/jobs${query}`)).status, query).toBe(400);
    }
    expect((await call("GET", "/v1/jobs/run_a/events?after=-1")).status).toBe(400);
  });
});

describe("a size", () => {
  const sizes: [string, Record<string, number> | null, string][] = [
    ["no size", null, "lite"],
    ["a quarter vCPU", { cpu: 0.25, memory_mb: 512, disk_mb: 1024 }, "basic"],
    ["the relay's small", { cpu: 1, memory_mb: 1024, disk_mb: 1024 }, "standard-2"],
    ["the relay's medium", { cpu: 2, memory_mb: 4096, disk_mb: 4096 }, "standard-3"],
    ["the relay's large", { cpu: 4, memory_mb: 8192, disk_mb: 8192 }, "standard-4"],
  ];

  it.each(sizes)("gets the smallest instance type that holds it: %s", async (_, size, type) => {
    const id = `run_size_${type.replace("-", "")}`;
    const created = await call("POST", "/v1/jobs", { body: job(id, { size }) });
    expect(created.status).toBe(201);
    expect(created.body.instance_type).toBe(type);
    expect(standIn.made.get(id)?.[0].launch.instanceType.name).toBe(type);
  });

  it.each([
    { cpu: 8, memory_mb: 1024, disk_mb: 1024 },
    { cpu: 4, memory_mb: 16_384, disk_mb: 1024 },
    { cpu: 1, memory_mb: 1024, disk_mb: 30_000 },
  ])("is refused when no instance type holds it: %j", async (size) => {
    expect(await refused(job("run_big", { size }), 422)).toBe("size_unsupported");
  });

  it("is refused when only an instance type this Worker does not deploy holds it", async () => {
    const { SandboxStandard4: _, ...without } = env;
    const body = JSON.stringify(job("run_large", { size: { cpu: 4, memory_mb: 8192, disk_mb: 8192 } }));
    const answer = await worker.fetch(
      new Request("https://jobs.test/v1/jobs", { method: "POST", headers: { authorization: `Bearer ${KEY}` }, body }),
      without,
    );
    expect(answer.status).toBe(422);
    expect(await answer.json()).toMatchObject({ error: { code: "size_unsupported" } });
  });
});

describe("egress", () => {
  it("is off unless asked for", async () => {
    await call("POST", "/v1/jobs", { body: job("run_offline") });
    expect(standIn.made.get("run_offline")?.[0].launch.egress).toEqual({ kind: "none" });
  });

  it("is the public internet for ['*']", async () => {
    await call("POST", "/v1/jobs", { body: job("run_open", { egress: ["*"] }) });
    expect(standIn.made.get("run_open")?.[0].launch.egress).toEqual({ kind: "open" });
  });

  it("is an allow-list of host names and IPv4 addresses", async () => {
    await call("POST", "/v1/jobs", { body: job("run_hosts", { egress: ["api.example.com", "*.Example.org", "93.184.216.34"] }) });
    expect(standIn.made.get("run_hosts")?.[0].launch.egress).toEqual({
      kind: "hosts",
      hosts: ["api.example.com", "*.example.org", "93.184.216.34"],
    });
  });

  it.each([["10.0.0.0/8"], ["[2001:db8::1]"], ["example.com:8443"], ["exa mple.com"], ["*example.com"]])(
    "is refused, never widened, when Cloudflare cannot enforce %s",
    async (host) => {
      expect(await refused(job("run_cidr", { egress: ["example.com", host] }), 422)).toBe("egress_unsupported");
    },
  );
});
