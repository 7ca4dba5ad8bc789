import { abortAllDurableObjects, env, runInDurableObject } from "cloudflare:test";
import { afterEach, describe, expect, it } from "vitest";

import { call, container, eventually, job, requestValid } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

const stubOf = (id: string) => env.JOBS.get(env.JOBS.idFromName(id));
const alarmOf = (id: string) => runInDurableObject(stubOf(id), (_, state) => state.storage.getAlarm());
const listed = async (id: string) =>
  (await call("GET", `/v1/jobs?tag=relay-run=${id}`)).body.jobs.map((entry: { id: string }) => entry.id);
const ended = (id: string) =>
  eventually(async () => {
    const answer = await call("GET", `/v1/jobs/${id}`);
    return ["exited", "timed_out", "error", "lost"].includes(answer.body.state) ? answer.body : null;
  });
const destroyed = (id: string) =>
  eventually(async () => {
    const answer = await call("GET", `/v1/jobs/${id}`);
    return answer.body.destroyed_at !== null ? answer.body : null;
  });
const command = (argv: string[], fields: Record<string, unknown> = {}) => ({ argv, timeout_s: 10, ...fields });

describe("a job created without its command", () => {
  it("is answered once its container is up, and waits for its command until the deadline", async () => {
    const created = await call("POST", "/v1/jobs", { body: container("two_ready", { timeout_s: 20, grace_s: 10 }) });
    expect(created.status).toBe(201);
    expect(created.body).toMatchObject({ state: "ready", destroyed_at: null, destroy_pending: false });
    expect(standIn.started("two_ready")).toHaveLength(1);
    expect(standIn.commands("two_ready")).toEqual([]);
    expect(await alarmOf("two_ready")).toBe(Date.parse(created.body.deadline));
    expect(Date.parse(created.body.deadline)).toBe(Date.parse(created.body.created_at) + 30_000);
    expect(await listed("two_ready")).toEqual(["two_ready"]);
    await call("DELETE", "/v1/jobs/two_ready");
  });

  it("runs the command it is given, once, and keeps the container until the DELETE", async () => {
    await call("POST", "/v1/jobs", { body: container("two_run") });
    const files = { "data/in.txt": "aGk=" };
    const ran = await call("POST", "/v1/jobs/two_run/run", {
      body: command(["echo", "hello"], { env: { A: "b" }, files, stdin: "aGk=", workdir: "data" }),
    });
    expect(ran.status).toBe(202);
    expect(ran.body.state).toBe("running");
    const done = await ended("two_run");
    expect(done).toMatchObject({ state: "exited", exit_code: 0, stdout: "hello\n", destroyed_at: null, destroy_pending: false });
    expect(standIn.commands("two_run")).toEqual([
      { argv: ["echo", "hello"], env: { A: "b" }, files, stdin: "aGk=", workdir: "data", timeout_s: 10 },
    ]);
    expect(standIn.started("two_run")[0].destroyCalls).toBe(0);
    expect(await alarmOf("two_run")).toBe(Date.parse(done.deadline));
    expect(await listed("two_run")).toEqual(["two_run"]);
    // Its output stream ends with the command, the container still there.
    const lines = (await call("GET", "/v1/jobs/two_run/events")).text.trim().split("\n").map((line) => JSON.parse(line));
    expect(lines.at(-1)).toMatchObject({ type: "end", state: "exited", exit_code: 0, destroyed_at: null });
    const deleted = await call("DELETE", "/v1/jobs/two_run");
    expect(deleted.status).toBe(200);
    expect(deleted.body).toMatchObject({ state: "exited", destroyed_by: "delete" });
    expect(standIn.started("two_run")[0].destroyed).toBe(true);
    expect(await listed("two_run")).toEqual([]);
  });

  it("answers a retried run with the same job, and refuses another command", async () => {
    await call("POST", "/v1/jobs", { body: container("two_twice") });
    const body = command(["sleep"]);
    expect((await call("POST", "/v1/jobs/two_twice/run", { body })).status).toBe(202);
    const again = await call("POST", "/v1/jobs/two_twice/run", { body });
    expect(again.status).toBe(200);
    const other = await call("POST", "/v1/jobs/two_twice/run", { body: command(["echo", "other"]) });
    expect([other.status, other.body.error.code]).toEqual([409, "already_run"]);
    expect(standIn.commands("two_twice")).toHaveLength(1);
    await call("DELETE", "/v1/jobs/two_twice");
    // A one-shot job has its command already.
    await call("POST", "/v1/jobs", { body: job("one_shot", { argv: ["sleep"] }) });
    const refused = await call("POST", "/v1/jobs/one_shot/run", { body: command(["echo", "x"]) });
    expect([refused.status, refused.body.error.code]).toEqual([409, "already_run"]);
    expect(standIn.commands("one_shot")).toHaveLength(1);
    await call("DELETE", "/v1/jobs/one_shot");
  });

  it("refuses a run once it has ended before its command", async () => {
    await call("POST", "/v1/jobs", { body: container("two_deleted") });
    expect((await call("DELETE", "/v1/jobs/two_deleted")).status).toBe(200);
    const late = await call("POST", "/v1/jobs/two_deleted/run", { body: command(["echo", "x"]) });
    expect([late.status, late.body.error.code]).toEqual([409, "job_ended"]);

    standIn.startFails = true;
    const failed = await call("POST", "/v1/jobs", { body: container("two_nostart") });
    expect(failed.status).toBe(201);
    expect(failed.body).toMatchObject({ state: "error", error: { code: "start_failed" }, destroyed_by: "exit" });
    expect(await listed("two_nostart")).toEqual([]);
    const refused = await call("POST", "/v1/jobs/two_nostart/run", { body: command(["echo", "x"]) });
    expect([refused.status, refused.body.error.code]).toEqual([409, "job_ended"]);
    expect(standIn.commands("two_deleted").concat(standIn.commands("two_nostart"))).toEqual([]);
    expect((await call("POST", "/v1/jobs/two_ghost/run", { body: command(["echo", "x"]) })).status).toBe(404);
  });

  it("waits for a container still starting before it runs the command", async () => {
    standIn.startDelayMs = 200;
    const creating = call("POST", "/v1/jobs", { body: container("two_slow") });
    await eventually(async () => standIn.made.has("two_slow"));
    const ran = await call("POST", "/v1/jobs/two_slow/run", { body: command(["echo", "late"]) });
    expect(ran.status).toBe(202);
    expect(standIn.started("two_slow")).toHaveLength(1);
    expect((await creating).status).toBe(201);
    expect((await ended("two_slow")).stdout).toBe("late\n");
    await call("DELETE", "/v1/jobs/two_slow");
  });

  it("loses nothing to a restart while it waits, and runs its command on a fresh machine", async () => {
    await call("POST", "/v1/jobs", { body: container("two_restart") });
    await abortAllDurableObjects();
    expect((await call("GET", "/v1/jobs/two_restart")).body).toMatchObject({ state: "ready", destroyed_at: null });
    expect((await call("POST", "/v1/jobs/two_restart/run", { body: command(["echo", "again"]) })).status).toBe(202);
    expect((await ended("two_restart")).stdout).toBe("again\n");
    expect(standIn.commands("two_restart")).toHaveLength(1);
    expect((await call("DELETE", "/v1/jobs/two_restart")).status).toBe(200);
  });

  it("is lost, and destroyed, when a restart comes under its command", async () => {
    await call("POST", "/v1/jobs", { body: container("two_lost") });
    await call("POST", "/v1/jobs/two_lost/run", { body: command(["sleep"]) });
    await abortAllDurableObjects();
    expect((await call("GET", "/v1/jobs/two_lost")).body.state).toBe("lost");
    expect(await destroyed("two_lost")).toMatchObject({ destroyed_by: "lost", error: { code: "lost" } });
  });

  it("keeps its container after the command's own timeout, for the DELETE", async () => {
    await call("POST", "/v1/jobs", { body: container("two_expire") });
    await call("POST", "/v1/jobs/two_expire/run", { body: command(["expire"], { timeout_s: 0.05 }) });
    expect(await ended("two_expire")).toMatchObject({ state: "timed_out", exit_code: 124, destroyed_at: null });
    expect((await call("DELETE", "/v1/jobs/two_expire")).status).toBe(200);
  });
});

describe("the deadline of a job created without its command", () => {
  it("destroys a container still waiting for its command", async () => {
    await call("POST", "/v1/jobs", { body: container("two_idle", { timeout_s: 0.05, grace_s: 0.05 }) });
    expect(await destroyed("two_idle")).toMatchObject({ state: "timed_out", destroyed_by: "alarm", exit_code: null });
    expect(standIn.started("two_idle")[0].destroyed).toBe(true);
    const late = await call("POST", "/v1/jobs/two_idle/run", { body: command(["echo", "x"]) });
    expect([late.status, late.body.error.code]).toEqual([409, "job_ended"]);
  });

  it("destroys a container kept after its command, and one whose command outlives it", async () => {
    await call("POST", "/v1/jobs", { body: container("two_kept", { timeout_s: 0.2, grace_s: 0.1 }) });
    await call("POST", "/v1/jobs/two_kept/run", { body: command(["echo", "done"]) });
    expect(await destroyed("two_kept")).toMatchObject({ state: "exited", exit_code: 0, destroyed_by: "alarm" });

    await call("POST", "/v1/jobs", { body: container("two_stuck", { timeout_s: 0.2, grace_s: 0.1 }) });
    await call("POST", "/v1/jobs/two_stuck/run", { body: command(["sleep"], { timeout_s: 600 }) });
    expect(await destroyed("two_stuck")).toMatchObject({ state: "timed_out", exit_code: null, destroyed_by: "alarm" });
    expect(await listed("two_stuck")).toEqual([]);
  });
});

describe("a hostile two-step body", () => {
  it.each([
    ["env without a command", container("two_bad", { env: { A: "b" } })],
    ["files without a command", container("two_bad", { files: { a: "aGk=" } })],
    ["stdin without a command", container("two_bad", { stdin: "aGk=" })],
    ["a workdir without a command", container("two_bad", { workdir: "a" })],
  ])("is refused at create: %s", async (_, body) => {
    const answer = await call("POST", "/v1/jobs", { body });
    expect([answer.status, answer.body.error.code]).toEqual([400, "invalid_request"]);
    expect(requestValid(body)).toBe(false);
    expect(standIn.made.size).toBe(0);
  });

  it.each([
    ["an id", { id: "two_x", argv: ["true"], timeout_s: 1 }],
    ["no argv", { timeout_s: 1 }],
    ["no timeout", { argv: ["true"] }],
    ["argv as a string", { argv: "true", timeout_s: 1 }],
    ["a path that leaves /workspace", { argv: ["true"], timeout_s: 1, files: { "../x": "aGk=" } }],
    ["egress", { argv: ["true"], timeout_s: 1, egress: ["*"] }],
  ])("is refused at run: %s", async (_, body) => {
    await call("POST", "/v1/jobs", { body: container("two_hostile") });
    const answer = await call("POST", "/v1/jobs/two_hostile/run", { body });
    expect([answer.status, answer.body.error.code]).toEqual([400, "invalid_request"]);
    expect(requestValid(body, "RunRequest")).toBe(false);
    expect(standIn.commands("two_hostile")).toEqual([]);
    await call("DELETE", "/v1/jobs/two_hostile");
  });

  it("is refused with a bad id in the path", async () => {
    const answer = await call("POST", "/v1/jobs/TWO_UPPER/run", { body: command(["true"]) });
    expect([answer.status, answer.body.error.code]).toEqual([400, "invalid_id"]);
  });
});
