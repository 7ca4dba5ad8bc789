// The types of the test runtime: `env` is the Worker's Env, `exports` its test entry.
type WorkerEnv = import("../src/env").Env;

declare namespace Cloudflare {
  interface Env extends WorkerEnv {}
  interface GlobalProps {
    mainModule: typeof import("./worker");
  }
}

declare module "*?raw" {
  const text: string;
  export default text;
}
