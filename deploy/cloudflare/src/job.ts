/**
 * One Durable Object per job, named by the relay's run id: it records the job, runs its
 * command once, keeps its output, and makes sure its container ends.
 *
 * - Create is idempotent: the record is written once (inside `blockConcurrencyWhile`, so
 *   two racing creates cannot both start one); a retry with the same body gets the same
 *   job, with another body a conflict.
 * - Two forms. One-shot: the command comes with the create, runs at once, and the
 *   container is destroyed as soon as it ends. Two-step: the create starts the container
 *   and answers once it is up (`ready`); the command comes once, later, by `run` (a retry
 *   of the same run is the same run, another is refused), and the container outlives it
 *   until a DELETE or the deadline, so its caller decides when it ends (and a warm pool can
 *   start one before its command exists).
 * - The alarm is set at `created + timeout_s + grace_s` when the job is recorded; the
 *   deadline never moves, and at it the container is destroyed whatever the caller does,
 *   in either form, whatever the state. A destroy that fails or hangs (bounded by
 *   DESTROY_TIMEOUT_S) sets the alarm again, 30 s on, until it is confirmed.
 * - While the container starts or the command runs, the alarm also beats every 30 s before
 *   the deadline: an object with no client connected may be evicted (before compatibility
 *   date 2026-10-01 a pending call to the sandbox does not keep it), and the beat keeps it,
 *   and notices within 30 s a start or run that a restart lost. A job waiting for its
 *   command (`ready`) or whose command has ended holds nothing in memory: a restart loses
 *   nothing, and the alarm waits for the deadline.
 * - `destroyed_at` is written only once the destroy is confirmed. Once destroyed, nothing
 *   here touches the container again, so probing a finished job never starts one.
 * - A record that says starting or running with no work here means the object was
 *   restarted under it, and the job is `lost` (and destroyed).
 * - A destroyed job's record is deleted RETENTION_S later (by the same alarm).
 * - A two-step job's container, kept after its command ended, answers for its files
 *   (`files`, `file`) until it is destroyed: how the relay collects a run's artifacts.
 */

import { DurableObject } from "cloudflare:workers";

import { type Egress, egressOf } from "./egress";
import { type Env, type Settings, settingsOf } from "./env";
import { outputStream } from "./events";
import { capped } from "./http";
import type { FileEntry, Launch, Machine, Stream } from "./machine";
import { registryOf } from "./registry";
import {
  byteLength,
  type DestroyedBy,
  isBusy,
  isFinal,
  type JobRecord,
  type JobState,
  type JobView,
  type OutputEvent,
  takeBytes,
  viewOf,
} from "./record";
import type { Command, JobSpec } from "./request";
import { sandboxMachine } from "./sandbox";
import { instanceTypeNamed } from "./sizes";

/** How long past `timeout_s` a run may go before it counts as hung (the SDK kills at +5 s). */
const RUN_SLACK_MS = 15_000;
const RETRY_MS = 30_000;
const HEARTBEAT_MS = 30_000;
const RECORD = "job";
const EVENT = "event:";

const LOST = { code: "lost", message: "the Worker restarted under the command" };

export type Created = { outcome: "created" | "existing" | "conflict"; job: JobView };
/** `started`: the command runs now; `existing`: this run was asked already (a retry);
 * `already_run`: the job has another command; `ended`: it ended before any command. */
export type Ran = { outcome: "started" | "existing" | "already_run" | "ended"; job: JobView };

/** A wake-up for whoever waits on new output or a new state. */
class Changes {
  private wake: () => void = () => {};
  private next = new Promise<void>((resolve) => (this.wake = resolve));

  wait(): Promise<void> {
    return this.next;
  }

  fire(): void {
    const wake = this.wake;
    this.next = new Promise<void>((resolve) => (this.wake = resolve));
    wake();
  }
}

function withTimeout<T>(work: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const expiry = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} took over ${ms} ms`)), ms);
  });
  return Promise.race([work, expiry]).finally(() => {
    if (timer !== undefined) clearTimeout(timer);
  });
}

function summary(error: unknown): string {
  const text = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
  return text.slice(0, 500);
}

export class Job extends DurableObject<Env> {
  private record: JobRecord | null = null;
  private events: OutputEvent[] = [];
  private kept: Record<Stream, number> = { stdout: 0, stderr: 0 };
  /** The start or the command going on in this object's memory (null: none). */
  private running: Promise<void> | null = null;
  /** The container's start, while it goes on (a two-step create and a run wait for it). */
  private starting: Promise<boolean> | null = null;
  private machineInUse: Machine | null = null;
  private destroying: Promise<boolean> | null = null;
  private readonly settings: Settings;
  readonly changes = new Changes();

  constructor(ctx: DurableObjectState, env: Env) {
    super(ctx, env);
    this.settings = settingsOf(env);
    void ctx.blockConcurrencyWhile(async () => {
      this.record = (await ctx.storage.get<JobRecord>(RECORD)) ?? null;
      const stored = await ctx.storage.list<OutputEvent>({ prefix: EVENT });
      this.events = [...stored.values()].sort((left, right) => left.seq - right.seq);
      for (const event of this.events) this.kept[event.type] += byteLength(event.data);
    });
  }

  /** The machine for a launch; the Worker's tests put their stand-in here. */
  protected machine(launch: Launch): Machine {
    return sandboxMachine(this.env, launch);
  }

  async create(spec: JobSpec, digest: string, instanceType: string, egress: Egress): Promise<Created> {
    let outcome: Created["outcome"] = "created";
    await this.ctx.blockConcurrencyWhile(async () => {
      if (this.record !== null) {
        outcome = this.record.digest === digest ? "existing" : "conflict";
        return;
      }
      const now = Date.now();
      const record: JobRecord = {
        spec,
        digest,
        command: spec.command,
        run_digest: null,
        keep: spec.command === null,
        instance_type: instanceType,
        state: "starting",
        exit_code: null,
        error: null,
        created_at: now,
        deadline: now + Math.ceil((spec.timeout_s + spec.grace_s) * 1000),
        started_at: null,
        ended_at: null,
        destroyed_at: null,
        destroyed_by: null,
        destroy_wanted: null,
        destroy_failures: 0,
        stdout_truncated: false,
        stderr_truncated: false,
      };
      // Listed first: whatever happens next, the reaper can find the job.
      await registryOf(this.env).add({
        id: spec.id,
        tags: spec.tags,
        instance_type: instanceType,
        created_at: record.created_at,
        deadline: record.deadline,
      });
      await this.ctx.storage.put(RECORD, record);
      await this.ctx.storage.setAlarm(Math.min(record.deadline, now + HEARTBEAT_MS));
      this.record = record;
      this.begin(record, egress);
    });
    // Set inside the callback above, which the compiler cannot see.
    const settled = outcome as Created["outcome"];
    if (settled === "conflict") return { outcome: settled, job: this.view() };
    this.noticeLost();
    // A two-step job is answered once its container is up (or failed to start).
    if (this.record?.keep === true && this.starting !== null) await this.starting;
    return { outcome: settled, job: this.view() };
  }

  /** A two-step job's command, once: it runs now, in the container the create started. */
  async run(command: Command, digest: string): Promise<Ran | null> {
    if (this.record === null) return null;
    this.noticeLost();
    if (this.starting !== null) await this.starting;
    let outcome: Ran["outcome"] = "started";
    let accepted: JobView | null = null;
    await this.ctx.blockConcurrencyWhile(async () => {
      const record = this.record;
      if (record === null) throw new Error("no job");
      if (record.command !== null) {
        outcome = record.run_digest === digest ? "existing" : "already_run";
        return;
      }
      if (record.state !== "ready") {
        outcome = "ended";
        return;
      }
      const now = Date.now();
      record.command = command;
      record.run_digest = digest;
      record.state = "running";
      record.started_at = now;
      await this.save();
      await this.ctx.storage.setAlarm(Math.min(record.deadline, now + HEARTBEAT_MS));
      accepted = this.view(); // as accepted: a quick command may have ended by the answer
      this.track(this.runCommand(record));
      this.changes.fire();
    });
    return { outcome, job: accepted ?? this.view() };
  }

  async get(): Promise<JobView | null> {
    if (this.record === null) return null;
    this.noticeLost();
    return this.view();
  }

  async follow(after: number): Promise<ReadableStream<Uint8Array> | null> {
    if (this.record === null) return null;
    this.noticeLost();
    return outputStream(this, after);
  }

  /**
   * A folder's entries, or a file's bytes, in the container of a two-step job that has its
   * command (running, or ended as `exited` or `timed_out`) and is not destroyed (nor being
   * destroyed): the files it made, for the relay to collect before its DELETE (also after
   * the relay's own deadline, the command still running). `no_job`: no such job;
   * `unavailable`: no container kept there now (a one-shot job, no command yet, another end,
   * a destroy asked or done); null: no such path.
   */
  async files(path: string): Promise<FileEntry[] | null | "no_job" | "unavailable"> {
    const machine = this.keptMachine();
    return typeof machine === "string" ? machine : machine.list(path);
  }

  async file(path: string, limit: number): Promise<ReadableStream<Uint8Array> | null | "no_job" | "unavailable"> {
    const machine = this.keptMachine();
    if (typeof machine === "string") return machine;
    // Capped here, beside the container: the stream to the Worker ends at the cap.
    const read = await machine.read(path);
    return read === null ? null : capped(read, limit);
  }

  private keptMachine(): Machine | "no_job" | "unavailable" {
    const record = this.record;
    if (record === null) return "no_job";
    const up = record.state === "running" || record.state === "exited" || record.state === "timed_out";
    if (!record.keep || !up || record.destroyed_at !== null || record.destroy_wanted !== null) {
      return "unavailable";
    }
    this.machineInUse ??= this.machine(this.launchOf(record));
    return this.machineInUse;
  }

  /** Ends the job now; `confirmed` once the container is gone (else the alarm finishes it). */
  async cancel(): Promise<{ confirmed: boolean; job: JobView } | null> {
    if (this.record === null) return null;
    this.noticeLost();
    await this.end("canceled", null);
    const confirmed = await this.destroy("delete");
    return { confirmed, job: this.view() };
  }

  override async alarm(): Promise<void> {
    const record = this.record;
    if (record === null) return;
    if (record.destroyed_at !== null) {
      const expiry = record.destroyed_at + this.settings.retentionS * 1000;
      if (Date.now() < expiry) return this.ctx.storage.setAlarm(expiry);
      await this.ctx.storage.deleteAll();
      this.record = null;
      this.events = [];
      return;
    }
    if (record.destroy_wanted !== null) {
      // A destroy asked for earlier (the command's end, a DELETE, the alarm) failed: again.
      await this.destroy("alarm");
      return;
    }
    const now = Date.now();
    // Busy with no work here: a restart lost the start or the command.
    const lost = isBusy(record.state) && this.running === null;
    if (now < record.deadline && !lost) {
      // A start or a command goes on here: beat again, so the object is not evicted under
      // it. Else the job waits (for its command, or for its caller's DELETE): the deadline.
      const next = isBusy(record.state) ? Math.min(record.deadline, now + HEARTBEAT_MS) : record.deadline;
      return this.ctx.storage.setAlarm(next);
    }
    // At the deadline, a job not ended has outlived its timeout (or never got its command).
    if (lost) await this.end("lost", null, LOST);
    else await this.end("timed_out", null);
    await this.destroy(lost ? "lost" : "alarm");
  }

  // --- what the event stream reads ----------------------------------------------------------

  snapshot(): { events: readonly OutputEvent[]; final: boolean; view: JobView | null } {
    const record = this.record;
    return {
      events: this.events,
      final: record === null || isFinal(record.state),
      view: record === null ? null : this.view(),
    };
  }

  // --- the run ------------------------------------------------------------------------------

  private launchOf(record: JobRecord): Launch {
    const instanceType = instanceTypeNamed(record.instance_type);
    if (instanceType === undefined) throw new Error(`unknown instance type ${record.instance_type}`);
    // The egress was checked at create; the same entries give the same policy.
    const egress = egressOf(record.spec.egress);
    return { spec: record.spec, instanceType, egress, sleepAfterS: this.settings.sleepAfterS };
  }

  /** Keeps `work` as what goes on in memory, until it settles. */
  private track(work: Promise<void>): void {
    this.running = work;
    void work.finally(() => {
      if (this.running === work) this.running = null;
    });
  }

  /** Starts the container; then the one-shot form's command. */
  private begin(record: JobRecord, egress: Egress): void {
    const starting = this.start(record, egress);
    this.starting = starting;
    void starting.finally(() => {
      if (this.starting === starting) this.starting = null;
    });
    this.track(
      starting.then(async (started) => {
        if (started && !record.keep) await this.runCommand(record);
      }),
    );
  }

  /** Whether the container is up: a two-step job is then `ready` for its command. A start
   * that failed is an error, and its container is destroyed at once (nothing will run). */
  private async start(record: JobRecord, egress: Egress): Promise<boolean> {
    try {
      const machine = this.machine({ ...this.launchOf(record), egress });
      this.machineInUse = machine;
      await machine.start();
    } catch (error) {
      await this.end("error", null, { code: "start_failed", message: summary(error) });
      await this.destroy("exit");
      return false;
    }
    if (isFinal(record.state)) {
      // Ended while it started (a DELETE, a lost object): destroyed by that, or now.
      await this.destroy("exit");
      return false;
    }
    if (record.keep) {
      record.state = "ready";
      await this.save();
      await this.ctx.storage.setAlarm(record.deadline);
      this.changes.fire();
    }
    return true;
  }

  /** Runs the job's command to its end. A one-shot job's container is destroyed then; a
   * two-step job's waits for its DELETE or the deadline. */
  private async runCommand(record: JobRecord): Promise<void> {
    const command = record.command;
    if (command === null) throw new Error("no command");
    try {
      // A two-step job's object may have been restarted since its start: a machine again.
      const machine = this.machineInUse ?? this.machine(this.launchOf(record));
      this.machineInUse = machine;
      if (record.state !== "running") {
        record.state = "running";
        record.started_at = Date.now();
        await this.save();
        this.changes.fire();
      }
      const startedAt = record.started_at ?? Date.now();
      const limit = Math.ceil(command.timeout_s * 1000) + RUN_SLACK_MS;
      const code = await withTimeout(machine.run(command, this.output), limit, "the command");
      const timedOut = code === 124 && Date.now() - startedAt >= command.timeout_s * 1000;
      await this.end(timedOut ? "timed_out" : "exited", code);
    } catch (error) {
      const hung = error instanceof Error && error.message.startsWith("the command took over");
      if (hung) await this.end("timed_out", null);
      else await this.end("error", null, { code: "run_failed", message: summary(error) });
    } finally {
      if (!record.keep) {
        await this.destroy("exit");
      } else if (record.destroyed_at === null && record.destroy_wanted === null) {
        await this.ctx.storage.setAlarm(record.deadline);
      }
    }
  }

  private readonly output = (stream: Stream, text: string): void => {
    const record = this.record;
    if (record === null || isFinal(record.state)) return;
    const room = this.settings.outputLimitBytes - this.kept[stream];
    const kept = room > 0 ? takeBytes(text, room) : "";
    if (kept.length < text.length && !record[`${stream}_truncated`]) {
      record[`${stream}_truncated`] = true;
      void this.save();
    }
    if (kept.length === 0) return;
    this.kept[stream] += byteLength(kept);
    const event: OutputEvent = { seq: this.events.length + 1, type: stream, data: kept };
    this.events.push(event);
    void this.ctx.storage.put(`${EVENT}${String(event.seq).padStart(10, "0")}`, event);
    this.changes.fire();
  };

  /** Moves a job that has not ended to `state` (a final one stays as it is). */
  private async end(
    state: JobState,
    exitCode: number | null,
    error: JobRecord["error"] = null,
  ): Promise<void> {
    const record = this.record;
    if (record === null || isFinal(record.state)) return;
    record.state = state;
    record.exit_code = exitCode;
    record.error = error;
    record.ended_at = Date.now();
    await this.save();
    this.changes.fire();
  }

  /** A record that says it starts or runs, in an object doing neither: a restart lost it. */
  private noticeLost(): void {
    const record = this.record;
    if (record === null || !isBusy(record.state) || this.running !== null) return;
    this.ctx.waitUntil(this.end("lost", null, LOST).then(() => this.destroy("lost")));
  }

  // --- the container's end ------------------------------------------------------------------

  private destroy(by: DestroyedBy): Promise<boolean> {
    this.destroying ??= this.destroyOnce(by).finally(() => {
      this.destroying = null;
    });
    return this.destroying;
  }

  private async destroyOnce(by: DestroyedBy): Promise<boolean> {
    const record = this.record;
    if (record === null) return false;
    if (record.destroyed_at !== null) return true;
    record.destroy_wanted ??= by;
    try {
      const machine = this.machineInUse ?? this.machine(this.launchOf(record));
      await withTimeout(machine.destroy(), this.settings.destroyTimeoutS * 1000, "the destroy");
    } catch (error) {
      record.destroy_failures += 1;
      console.warn(`job ${record.spec.id}: destroy failed (${summary(error)}); retrying by alarm`);
      await this.save();
      await this.ctx.storage.setAlarm(Date.now() + RETRY_MS);
      this.changes.fire();
      return false;
    }
    record.destroyed_at = Date.now();
    record.destroyed_by = by;
    this.machineInUse = null;
    await this.save();
    await this.ctx.storage.setAlarm(record.destroyed_at + this.settings.retentionS * 1000);
    this.changes.fire();
    try {
      await registryOf(this.env).remove(record.spec.id);
    } catch (error) {
      // Still listed: the reaper's DELETE confirms the destroy and removes it again.
      console.warn(`job ${record.spec.id}: unlisting failed (${summary(error)})`);
    }
    return true;
  }

  private async save(): Promise<void> {
    if (this.record !== null) await this.ctx.storage.put(RECORD, this.record);
  }

  private view(): JobView {
    if (this.record === null) throw new Error("no job");
    return viewOf(this.record, this.events);
  }
}
