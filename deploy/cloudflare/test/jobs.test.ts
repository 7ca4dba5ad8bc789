import { env, runDurableObjectAlarm, runInDurableObject } from "cloudflare:test";
import { afterEach, describe, expect, it } from "vitest";

import { call, eventually, job } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

const stubOf = (id: string) => env.JOBS.get(env.JOBS.idFromName(id));
const finished = (id: string) =>
  eventually(async () => {
    const answer = await call("GET", `/v1/jobs/${id}`);
    return answer.body.destroyed_at !== null ? answer.body : null;
  });

describe("creating a job", () => {
  it("runs the command, keeps its output and destroys the container when it ends", async () => {
    const created = await call("POST", "/v1/jobs", { body: job("run_echo", { argv: ["echo", "hello", "world"] }) });
    expect(created.status).toBe(201);
    expect(created.headers.get("location")).toBe("/v1/jobs/run_echo");
    const done = await finished("run_echo");
    expect(done).toMatchObject({ state: "exited", exit_code: 0, stdout: "hello world\n", destroyed_by: "exit" });
    expect(standIn.started("run_echo")[0].destroyed).toBe(true);
  });

  it("answers a retry with the same job and never starts a second container", async () => {
    const body = job("run_twice", { argv: ["sleep"] });
    const [first, second] = await Promise.all([
      call("POST", "/v1/jobs", { body }),
      call("POST", "/v1/jobs", { body }),
    ]);
    expect([first.status, second.status].sort()).toEqual([200, 201]);
    const third = await call("POST", "/v1/jobs", { body });
    expect(third.status).toBe(200);
    expect(third.body.created_at).toBe(first.body.created_at);
    await eventually(async () => standIn.started("run_twice").length === 1);
    expect(standIn.made.get("run_twice")).toHaveLength(1);
    await call("DELETE", "/v1/jobs/run_twice");
  });

  it("refuses the same id with another body (409) and leaves the first job alone", async () => {
    await call("POST", "/v1/jobs", { body: job("run_reused", { argv: ["sleep"] }) });
    const reused = await call("POST", "/v1/jobs", { body: job("run_reused", { argv: ["echo", "other"] }) });
    expect(reused.status).toBe(409);
    expect(reused.body.error.code).toBe("id_conflict");
    expect(standIn.made.get("run_reused")).toHaveLength(1);
    await call("DELETE", "/v1/jobs/run_reused");
  });

  it("sets the alarm at created + timeout + grace", async () => {
    const created = await call("POST", "/v1/jobs", { body: job("run_deadline", { argv: ["sleep"], timeout_s: 10, grace_s: 5 }) });
    const alarm = await runInDurableObject(stubOf("run_deadline"), (_, state) => state.storage.getAlarm());
    const createdAt = Date.parse(created.body.created_at);
    expect(alarm).toBe(createdAt + 15_000);
    expect(Date.parse(created.body.deadline)).toBe(createdAt + 15_000);
    await call("DELETE", "/v1/jobs/run_deadline");
  });

  it("beats every 30 s before a later deadline, and the beat leaves a healthy run alone", async () => {
    const created = await call("POST", "/v1/jobs", { body: job("run_beat", { argv: ["sleep"], timeout_s: 60, grace_s: 15 }) });
    const alarmOf = () => runInDurableObject(stubOf("run_beat"), (_, state) => state.storage.getAlarm());
    expect(await alarmOf()).toBe(Date.parse(created.body.created_at) + 30_000);
    await eventually(async () => standIn.started("run_beat").length === 1);
    expect(await runDurableObjectAlarm(stubOf("run_beat"))).toBe(true);
    const after = await call("GET", "/v1/jobs/run_beat");
    expect(after.body).toMatchObject({ state: "running", destroyed_at: null });
    expect(await alarmOf()).toBeLessThanOrEqual(Math.min(Date.now() + 30_000, Date.parse(created.body.deadline)));
    expect(standIn.started("run_beat")[0].destroyCalls).toBe(0);
    await call("DELETE", "/v1/jobs/run_beat");
  });

  it("reports a command's own failure as exited with its code", async () => {
    await call("POST", "/v1/jobs", { body: job("run_fail", { argv: ["fail", "3"] }) });
    expect(await finished("run_fail")).toMatchObject({ state: "exited", exit_code: 3, stderr: "failing\n" });
  });

  it("reports a command the SDK killed at its timeout as timed_out", async () => {
    await call("POST", "/v1/jobs", { body: job("run_expire", { argv: ["expire"], timeout_s: 0.05 }) });
    expect(await finished("run_expire")).toMatchObject({ state: "timed_out", exit_code: 124 });
  });

  it("reports a container that did not start as an error, and still destroys it", async () => {
    standIn.startFails = true;
    await call("POST", "/v1/jobs", { body: job("run_nostart") });
    const done = await finished("run_nostart");
    expect(done).toMatchObject({ state: "error", error: { code: "start_failed" }, destroyed_by: "exit" });
  });

  it("keeps at most the output limit per stream and flags the rest", async () => {
    await call("POST", "/v1/jobs", { body: job("run_flood", { argv: ["print", "5000"] }) });
    const done = await finished("run_flood");
    expect(done.stdout).toHaveLength(2048);
    expect(done).toMatchObject({ stdout_truncated: true, stderr_truncated: false });
  });
});

describe("following a job's output", () => {
  it("streams output events, then an end line, as NDJSON", async () => {
    await call("POST", "/v1/jobs", { body: job("run_follow", { argv: ["echo", "streamed"] }) });
    const stream = await call("GET", "/v1/jobs/run_follow/events");
    expect(stream.headers.get("content-type")).toBe("application/x-ndjson");
    const lines = stream.text.trim().split("\n").map((line) => JSON.parse(line));
    expect(lines[0]).toEqual({ seq: 1, type: "stdout", data: "streamed\n" });
    expect(lines.at(-1)).toMatchObject({ type: "end", state: "exited", exit_code: 0 });
  });

  it("resumes after the last event a cut stream saw", async () => {
    await call("POST", "/v1/jobs", { body: job("run_resume", { argv: ["echo", "once"] }) });
    await finished("run_resume");
    const resumed = await call("GET", "/v1/jobs/run_resume/events?after=1");
    const lines = resumed.text.trim().split("\n").map((line) => JSON.parse(line));
    expect(lines).toEqual([expect.objectContaining({ type: "end", state: "exited" })]);
  });
});

describe("deleting a job", () => {
  it("answers 200 only once the destroy is confirmed", async () => {
    await call("POST", "/v1/jobs", { body: job("run_delete", { argv: ["sleep"] }) });
    await eventually(async () => standIn.started("run_delete").length === 1);
    const deleted = await call("DELETE", "/v1/jobs/run_delete");
    expect(deleted.status).toBe(200);
    expect(deleted.body).toMatchObject({ state: "canceled", destroyed_by: "delete", destroy_pending: false });
    expect(deleted.body.destroyed_at).not.toBeNull();
    expect(standIn.started("run_delete")[0].destroyed).toBe(true);
    expect((await call("DELETE", "/v1/jobs/run_delete")).status).toBe(200);
  });

  it("says the destroy is pending (202) when it fails, and the alarm finishes it", async () => {
    await call("POST", "/v1/jobs", { body: job("run_stuck", { argv: ["sleep"] }) });
    await eventually(async () => standIn.started("run_stuck").length === 1);
    standIn.destroyFailures = 1;
    const deleted = await call("DELETE", "/v1/jobs/run_stuck");
    expect(deleted.status).toBe(202);
    expect(deleted.body).toMatchObject({ state: "canceled", destroyed_at: null, destroy_pending: true });
    const alarm = await runInDurableObject(stubOf("run_stuck"), (_, state) => state.storage.getAlarm());
    expect(alarm).not.toBeNull();
    expect(await runDurableObjectAlarm(stubOf("run_stuck"))).toBe(true);
    const after = await call("GET", "/v1/jobs/run_stuck");
    expect(after.body).toMatchObject({ destroyed_by: "alarm", destroy_pending: false });
  });

  it("answers a destroy that hangs with 202 within the destroy timeout", async () => {
    await call("POST", "/v1/jobs", { body: job("run_hang", { argv: ["sleep"] }) });
    await eventually(async () => standIn.started("run_hang").length === 1);
    standIn.destroyHangs = true;
    const started = Date.now();
    const deleted = await call("DELETE", "/v1/jobs/run_hang");
    expect(deleted.status).toBe(202);
    expect(Date.now() - started).toBeLessThan(3000);
    standIn.destroyHangs = false;
    await runDurableObjectAlarm(stubOf("run_hang"));
    expect((await call("GET", "/v1/jobs/run_hang")).body.destroyed_at).not.toBeNull();
  });
});

describe("probing a job that does not exist", () => {
  it("answers 404 and never makes a container", async () => {
    expect((await call("GET", "/v1/jobs/run_ghost")).status).toBe(404);
    expect((await call("GET", "/v1/jobs/run_ghost/events")).status).toBe(404);
    expect((await call("DELETE", "/v1/jobs/run_ghost")).status).toBe(404);
    expect(standIn.made.has("run_ghost")).toBe(false);
  });

  it("never touches the container of a job already destroyed", async () => {
    await call("POST", "/v1/jobs", { body: job("run_gone") });
    await finished("run_gone");
    const before = standIn.made.get("run_gone")?.length;
    await call("GET", "/v1/jobs/run_gone");
    await call("GET", "/v1/jobs/run_gone/events");
    await call("DELETE", "/v1/jobs/run_gone");
    expect(standIn.made.get("run_gone")?.length).toBe(before);
    expect(standIn.made.get("run_gone")?.[0].destroyCalls).toBe(1);
  });
});

describe("listing live jobs", () => {
  it("lists jobs by tag until their container is destroyed", async () => {
    await call("POST", "/v1/jobs", { body: job("run_list_a", { argv: ["sleep"], tags: { "relay-cluster": "blue", "relay-run": "a" } }) });
    await call("POST", "/v1/jobs", { body: job("run_list_b", { argv: ["sleep"], tags: { "relay-cluster": "green", "relay-run": "b" } }) });
    const blue = await call("GET", "/v1/jobs?tag=relay-cluster=blue");
    expect(blue.body.jobs.map((listed: { id: string }) => listed.id)).toEqual(["run_list_a"]);
    expect(blue.body.jobs[0].tags).toEqual({ "relay-cluster": "blue", "relay-run": "a" });
    const both = await call("GET", "/v1/jobs?tag=relay-run=b&tag=relay-cluster=green");
    expect(both.body.jobs.map((listed: { id: string }) => listed.id)).toEqual(["run_list_b"]);
    await call("DELETE", "/v1/jobs/run_list_a");
    expect((await call("GET", "/v1/jobs?tag=relay-cluster=blue")).body.jobs).toEqual([]);
    await call("DELETE", "/v1/jobs/run_list_b");
  });

  it("pages through the list with a cursor", async () => {
    for (const id of ["run_page_1", "run_page_2", "run_page_3"]) {
      await call("POST", "/v1/jobs", { body: job(id, { argv: ["sleep"], tags: { pager: "yes" } }) });
    }
    const first = await call("GET", "/v1/jobs?tag=pager=yes&limit=2");
    expect(first.body.jobs).toHaveLength(2);
    const second = await call("GET", `/v1/jobs?tag=pager=yes&limit=2&cursor=${first.body.next_cursor}`);
    expect(second.body).toMatchObject({ jobs: [{ id: "run_page_3" }], next_cursor: null });
    for (const id of ["run_page_1", "run_page_2", "run_page_3"]) await call("DELETE", `/v1/jobs/${id}`);
  });
});
