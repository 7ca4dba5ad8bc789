import { abortAllDurableObjects, env, runDurableObjectAlarm, runInDurableObject } from "cloudflare:test";
import { afterEach, describe, expect, it } from "vitest";

import { call, eventually, job } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

const stubOf = (id: string) => env.JOBS.get(env.JOBS.idFromName(id));
const listed = async (id: string) =>
  (await call("GET", `/v1/jobs?tag=relay-run=${id}`)).body.jobs.map((entry: { id: string }) => entry.id);

describe("the deadline alarm", () => {
  it("destroys the container of a job still running, whatever the caller does", async () => {
    await call("POST", "/v1/jobs", { body: job("run_overdue", { argv: ["sleep"], timeout_s: 60 }) });
    await eventually(async () => standIn.started("run_overdue").length === 1);
    expect(await listed("run_overdue")).toEqual(["run_overdue"]);
    expect(await runDurableObjectAlarm(stubOf("run_overdue"))).toBe(true);
    const after = await call("GET", "/v1/jobs/run_overdue");
    expect(after.body).toMatchObject({ state: "timed_out", destroyed_by: "alarm", destroy_pending: false });
    expect(after.body.destroyed_at).not.toBeNull();
    expect(standIn.started("run_overdue")[0].destroyed).toBe(true);
    expect(await listed("run_overdue")).toEqual([]);
  });

  it("tries again until the destroy is confirmed", async () => {
    await call("POST", "/v1/jobs", { body: job("run_retry", { argv: ["sleep"] }) });
    await eventually(async () => standIn.started("run_retry").length === 1);
    standIn.destroyFailures = 2;
    await runDurableObjectAlarm(stubOf("run_retry"));
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
});
