/**
 * One Durable Object per job, named by the relay's run id: it records the job, runs it
 * once, keeps its output, and makes sure its container ends.
 *
 * - Create is idempotent: the record is written once (inside `blockConcurrencyWhile`, so
 *   two racing creates cannot both start one); a retry with the same body gets the same
 *   job, with another body a conflict.
 * - The alarm is set at `created + timeout_s + grace_s` when the job is recorded, and
 *   destroys the container then whatever the caller does. A destroy that fails or hangs
 *   (bounded by DESTROY_TIMEOUT_S) sets the alarm again, 30 s on, until it is confirmed.
 * - While the command runs, the alarm also beats every 30 s before the deadline: an object
 *   with no client connected may be evicted (before compatibility date 2026-10-01 a
 *   pending call to the sandbox does not keep it), and the beat keeps it, and notices
 *   within 30 s a run that a restart lost.
 * - The container is destroyed as soon as the command ends; `destroyed_at` is written only
 *   once the destroy is confirmed. Once destroyed, nothing here touches the container
 *   again, so probing a finished job never starts one.
 * - The run lives in this object's memory: a record that says running with no run here
 *   means the object was restarted under it, and the job is `lost` (and destroyed).
 * - A destroyed job's record is deleted RETENTION_S later (by the same alarm).
 */

import { DurableObject } from "cloudflare:workers";

import type { Egress } from "./egress";
import { type Env, type Settings, settingsOf } from "./env";
import { outputStream } from "./events";
import type { Launch, Machine, Stream } from "./machine";
import { registryOf } from "./registry";
import {
  byteLength,
  type DestroyedBy,
  isFinal,
  type JobRecord,
  type JobState,
  type JobView,
  type OutputEvent,
  takeBytes,
  viewOf,
} from "./record";
import type { JobSpec } from "./request";
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
  private running: Promise<void> | null = null;
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
      this.running = this.execute(record, egress);
    });
    if (outcome === "created") return { outcome, job: this.view() };
    this.noticeLost();
    return { outcome, job: this.view() };
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
    const now = Date.now();
    if (!isFinal(record.state) && this.running !== null && now < record.deadline) {
      // The run goes on here: beat again, so the object is not evicted under it.
      return this.ctx.storage.setAlarm(Math.min(record.deadline, now + HEARTBEAT_MS));
    }
    // A run still going at the deadline has outlived its timeout; with no run here, a
    // restart lost it.
    const lost = !isFinal(record.state) && this.running === null;
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

  private launchOf(record: JobRecord, egress: Egress = { kind: "none" }): Launch {
    const instanceType = instanceTypeNamed(record.instance_type);
    if (instanceType === undefined) throw new Error(`unknown instance type ${record.instance_type}`);
    return { spec: record.spec, instanceType, egress, sleepAfterS: this.settings.sleepAfterS };
  }

  private async execute(record: JobRecord, egress: Egress): Promise<void> {
    let started = false;
    try {
      const machine = this.machine(this.launchOf(record, egress));
      this.machineInUse = machine;
      await machine.prepare();
      if (isFinal(record.state)) return;
      record.state = "running";
      record.started_at = Date.now();
      started = true;
      await this.save();
      this.changes.fire();
      const limit = Math.ceil(record.spec.timeout_s * 1000) + RUN_SLACK_MS;
      const code = await withTimeout(machine.run(this.output), limit, "the command");
      const timedOut = code === 124 && Date.now() - record.started_at >= record.spec.timeout_s * 1000;
      await this.end(timedOut ? "timed_out" : "exited", code);
    } catch (error) {
      const hung = error instanceof Error && error.message.startsWith("the command took over");
      if (hung) await this.end("timed_out", null);
      else await this.end("error", null, { code: started ? "run_failed" : "start_failed", message: summary(error) });
    } finally {
      this.running = null;
      await this.destroy("exit");
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

  /** A record that says it runs, in an object that runs nothing: a restart lost the run. */
  private noticeLost(): void {
    const record = this.record;
    if (record === null || isFinal(record.state) || this.running !== null) return;
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
    try {
      const machine = this.machineInUse ?? this.machine(this.launchOf(record));
      await withTimeout(machine.destroy(), this.settings.destroyTimeoutS * 1000, "the destroy");
    } catch (error) {
      record.destroy_failures += 1;
      console.warn(`job ${record.spec.id}: destroy failed (${summary(error)}); retrying by alarm`);
      await this.save();
      await this.ctx.storage.setAlarm(Date.now() + RETRY_MS);
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
