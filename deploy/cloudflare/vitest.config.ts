// The Worker's tests run in workerd (from the npm registry) with the Durable Objects of
// wrangler.jsonc, the job's class swapped for one whose machine is the stand-in
// (test/worker.ts): no Cloudflare account, no Docker.
import { cloudflareTest } from "@cloudflare/vitest-pool-workers";
import { defineConfig } from "vitest/config";

export default defineConfig({
  plugins: [
    cloudflareTest({
      main: "./test/worker.ts",
      wrangler: { configPath: "./wrangler.jsonc" },
      miniflare: {
        bindings: { JOB_WORKER_KEY: "k".repeat(40), DESTROY_TIMEOUT_S: "1", OUTPUT_LIMIT_BYTES: "2048" },
      },
    }),
  ],
  // One runtime for every file, one file at a time: starting workerd is most of the wall
  // time, and the tests use distinct job ids so they share its storage safely.
  test: { include: ["test/**/*.test.ts"], isolate: false, maxWorkers: 1 },
});
