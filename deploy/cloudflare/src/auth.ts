/**
 * The one key the relay presents, checked on every request: fails closed.
 *
 * No key configured (or one too short to be a secret) refuses every request with 403; the
 * key is read only from `Authorization: Bearer …` (never from a URL, where logs keep it),
 * and compared in constant time: both sides are hashed to 32 bytes first, so neither the
 * content nor the length of the key shows in how long a refusal takes.
 */

import type { Env } from "./env";
import { failure } from "./http";

export const MIN_KEY_LENGTH = 32;

export async function refusal(request: Request, env: Env): Promise<Response | null> {
  const key = env.JOB_WORKER_KEY ?? "";
  if (key.length < MIN_KEY_LENGTH) {
    return failure(
      403,
      "key_not_configured",
      `the Worker has no key of at least ${MIN_KEY_LENGTH} characters: set JOB_WORKER_KEY ` +
        "with `npx wrangler secret put JOB_WORKER_KEY`",
    );
  }
  const presented = /^Bearer ([!-~]+)$/.exec(request.headers.get("authorization") ?? "");
  if (presented === null || !(await sameKey(presented[1], key))) {
    const refused = failure(401, "unauthorized", "a valid Authorization: Bearer key is required");
    refused.headers.set("www-authenticate", "Bearer");
    return refused;
  }
  return null;
}

/** Whether two keys are equal, in time that depends on neither. */
export async function sameKey(presented: string, expected: string): Promise<boolean> {
  const [left, right] = await Promise.all([digest(presented), digest(expected)]);
  return crypto.subtle.timingSafeEqual(left, right);
}

async function digest(text: string): Promise<ArrayBuffer> {
  return crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
}
