/**
 * The list of live jobs (created, container not yet confirmed destroyed), in one Durable
 * Object with SQLite, so the relay's reaper can find what a crash left: `GET /v1/jobs?tag=…`.
 * A job is listed before its container can start and unlisted once its destroy is
 * confirmed; an entry whose job is gone (a create that died half-way) is unlisted by the
 * DELETE the reaper sends it.
 */

import { DurableObject } from "cloudflare:workers";

import type { Env } from "./env";

export interface Listed {
  id: string;
  tags: Record<string, string>;
  instance_type: string;
  created_at: number;
  deadline: number;
}

export interface ListedView {
  id: string;
  tags: Record<string, string>;
  instance_type: string;
  created_at: string;
  deadline: string;
}

export interface Listing {
  jobs: ListedView[];
  next_cursor: string | null;
}

export function registryOf(env: Env): DurableObjectStub<Registry> {
  return env.REGISTRY.get(env.REGISTRY.idFromName("registry"));
}

export class Registry extends DurableObject<Env> {
  constructor(ctx: DurableObjectState, env: Env) {
    super(ctx, env);
    ctx.storage.sql.exec(
      `CREATE TABLE IF NOT EXISTS live (
         id TEXT PRIMARY KEY, tags TEXT NOT NULL, instance_type TEXT NOT NULL,
         created_at INTEGER NOT NULL, deadline INTEGER NOT NULL)`,
    );
  }

  add(job: Listed): void {
    this.ctx.storage.sql.exec(
      "INSERT OR REPLACE INTO live (id, tags, instance_type, created_at, deadline) VALUES (?, ?, ?, ?, ?)",
      job.id,
      JSON.stringify(job.tags),
      job.instance_type,
      job.created_at,
      job.deadline,
    );
  }

  remove(id: string): void {
    this.ctx.storage.sql.exec("DELETE FROM live WHERE id = ?", id);
  }

  /** Live jobs carrying every `[name, value]` tag, by id, `limit` at a time after `cursor`. */
  list(tags: [string, string][], limit: number, cursor: string | null): Listing {
    const where = ["id > ?"];
    const values: string[] = [cursor ?? ""];
    for (const [name, value] of tags) {
      where.push("json_extract(tags, ?) = ?");
      values.push(`$."${name}"`, value);
    }
    const rows = this.ctx.storage.sql
      .exec<{ id: string; tags: string; instance_type: string; created_at: number; deadline: number }>(
        `SELECT id, tags, instance_type, created_at, deadline FROM live WHERE ${where.join(" AND ")}
         ORDER BY id LIMIT ?`,
        ...values,
        limit + 1,
      )
      .toArray();
    const page = rows.slice(0, limit);
    return {
      jobs: page.map((row) => ({
        id: row.id,
        tags: JSON.parse(row.tags) as Record<string, string>,
        instance_type: row.instance_type,
        created_at: new Date(row.created_at).toISOString(),
        deadline: new Date(row.deadline).toISOString(),
      })),
      next_cursor: rows.length > limit ? (page.at(-1)?.id ?? null) : null,
    };
  }
}
