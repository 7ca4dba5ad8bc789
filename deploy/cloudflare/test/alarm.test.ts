import { abortAllDurableObjects, env, runDurableObjectAlarm, runInDurableObject } from "cloudflare:test";
import { afterEach, describe, expect, it } from "vitest";

import { call, eventually, job } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

const stubOf = (id: string) => env.JOBS.get(env.JOBS.idFromName(id));
const listed = async (id: string) =>
  (await call("GET", `/v1/jobs?tag=relay-run=${id}`)).body.jobs.map((entry: { id: string }) => entry.id);

describe("the deadline alarm", () => {
  it("destroys the container of a job still running at the deadline, whatever the caller does", async () => {
    // A command that outlives its timeout (an exec that hangs): only the alarm ends it.
    const created = await call("POST", "/v1/jobs", { body: job("run_overdue", { argv: ["sleep"], timeout_s: 0.1, grace_s: 0.2 }) });
    expect(await listed("run_overdue")).toEqual(["run_overdue"]);
    const after = await eventually(async () => {
      const answer = await call("GET", "/v1/jobs/run_overdue");
      return answer.body.destroyed_at !== null ? answer.body : null;
    });
    expect(after).toMatchObject({ state: "timed_out", exit_code: null, destroyed_by: "alarm", destroy_pending: false });
    expect(Date.parse(after.destroyed_at)).toBeGreaterThanOrEqual(Date.parse(created.body.deadline));
    expect(standIn.started("run_overdue")[0].destroyed).toBe(true);
    expect(await listed("run_overdue")).toEqual([]);
  });

  it("tries again until the destroy is confirmed", async () => {
    standIn.destroyFailures = 2;
    await call("POST", "/v1/jobs", { body: job("run_retry", { argv: ["sleep"], timeout_s: 0.05, grace_s: 0.05 }) });
    await eventually(async () => standIn.started("run_retry")[0]?.destroyCalls === 1);
    expect((await call("GET", "/v1/jobs/run_retry")).body).toMatchObject({ destroyed_at: null, destroy_pending: true });
    expect(await listed("run_retry")).toEqual(["run_retry"]);
    const retry = await runInDurableObject(stubOf("run_retry"), (_, state) => state.storage.getAlarm());
    expect(retry).toBeGreaterThan(Date.now());
    await runDurableObjectAlarm(stubOf("run_retry"));
    await runDurableObjectAlarm(stubOf("run_retry"));
    expect((await call("GET", "/v1/jobs/run_retry")).body.destroyed_by).toBe("alarm");
    expect(standIn.started("run_retry")[0].destroyCalls).toBe(3);
    expect(await listed("run_retry")).toEqual([]);
  });

  it("deletes a destroyed job's record once its retention is over", async () => {
    await call("POST", "/v1/jobs", { body: job("run_old") });
    await eventually(async () => (await call("GET", "/v1/jobs/run_old")).body.destroyed_at !== null);
    const alarm = await runInDurableObject(stubOf("run_old"), (_, state) => state.storage.getAlarm());
    expect(alarm).toBeGreaterThan(Date.now() + 80_000_000);
    await runDurableObjectAlarm(stubOf("run_old"));
    expect((await call("GET", "/v1/jobs/run_old")).status).toBe(200);
    await runInDurableObject(stubOf("run_old"), async (_, state) => {
      const record = (await state.storage.get<{ destroyed_at: number }>("job"))!;
      await state.storage.put("job", { ...record, destroyed_at: 0 });
    });
    await abortAllDurableObjects();
    await runDurableObjectAlarm(stubOf("run_old"));
    expect((await call("GET", "/v1/jobs/run_old")).status).toBe(404);
  });
});

describe("a Worker restarted under a command", () => {
  it("reports the job lost and destroys its container", async () => {
    await call("POST", "/v1/jobs", { body: job("run_restart", { argv: ["sleep"] }) });
    await eventually(async () => standIn.started("run_restart").length === 1);
    await abortAllDurableObjects();
    const seen = await call("GET", "/v1/jobs/run_restart");
    expect(seen.body.state).toBe("lost");
    const after = await eventually(async () => {
      const answer = await call("GET", "/v1/jobs/run_restart");
      return answer.body.destroyed_at !== null ? answer.body : null;
    });
    expect(after).toMatchObject({ state: "lost", destroyed_by: "lost", error: { code: "lost" } });
    expect(await listed("run_restart")).toEqual([]);
  });

  it("is noticed by the next beat of the alarm, with no request", async () => {
    await call("POST", "/v1/jobs", { body: job("run_unwatched", { argv: ["sleep"], timeout_s: 600 }) });
    await eventually(async () => standIn.started("run_unwatched").length === 1);
    await abortAllDurableObjects();
    expect(await runDurableObjectAlarm(stubOf("run_unwatched"))).toBe(true);
    const record = await runInDurableObject(stubOf("run_unwatched"), (_, state) => state.storage.get<Record<string, unknown>>("job"));
    expect(record).toMatchObject({ state: "lost", destroyed_by: "lost" });
    expect(await listed("run_unwatched")).toEqual([]);
  });
});
