/**
 * The Worker as the tests run it: everything of src/index.ts, but the job's class makes
 * its machine with the stand-in (the one change; wrangler.jsonc binds JOBS to `Job`).
 */

import { Job as SandboxJob } from "../src/job";
import type { Launch, Machine } from "../src/machine";
import { standIn } from "./stand-in";

export * from "../src/index";
export { default } from "../src/index";

export class Job extends SandboxJob {
  protected override machine(launch: Launch): Machine {
    return standIn.machine(launch);
  }
}
