/**
 * The machine of a job, made with the Sandbox SDK (`@cloudflare/sandbox` 0.12): the only
 * module that calls it.
 *
 * One sandbox per job, named by the job's id, of the class bound for its instance type.
 * The class denies the network (`enableInternet = false`); a job's allow-list becomes the
 * sandbox's `allowedHosts` (HTTPS intercepted, so the host name is checked), and `["*"]`
 * turns the internet on for that one sandbox, before its container starts; both are kept in
 * the sandbox's storage (`@cloudflare/containers` 0.3.7 persists its outbound configuration),
 * so a container the idle backstop stopped and the next call started again has them too.
 * Files and stdin are written with the command (a two-step job's come with its run); a kept
 * container's files are read back with `listFiles` and `readFileStream`. Commands run
 * sessionless, so the SDK's timeout kills the whole process group (SIGTERM, SIGKILL 5 s
 * later, exit 124); `keepAlive` stays off and `sleepAfter` is the idle backstop.
 */

import { getSandbox, Sandbox, streamFile } from "@cloudflare/sandbox";

import type { Env } from "./env";
import type { FileEntry, Launch, Machine, Stream } from "./machine";
import type { Command } from "./request";

export { ContainerProxy } from "@cloudflare/sandbox";

export const WORKSPACE = "/workspace";
const STDIN_PATH = "/tmp/.relay-stdin";
const INTERNET_KEY = "relay:internet";

export class JobSandbox extends Sandbox<Env> {
  override enableInternet = false;
  override interceptHttps = true;

  constructor(ctx: DurableObjectState<{}>, env: Env) {
    super(ctx, env);
    void ctx.blockConcurrencyWhile(async () => {
      if ((await ctx.storage.get<boolean>(INTERNET_KEY)) === true) this.enableInternet = true;
    });
  }

  /** The public internet for this sandbox (egress `["*"]`): call before its container starts. */
  async openInternet(): Promise<void> {
    await this.ctx.storage.put(INTERNET_KEY, true);
    this.enableInternet = true;
  }
}

// One class per instance type: an instance type is set per container application.
export class SandboxLite extends JobSandbox {}
export class SandboxBasic extends JobSandbox {}
export class SandboxStandard1 extends JobSandbox {}
export class SandboxStandard2 extends JobSandbox {}
export class SandboxStandard3 extends JobSandbox {}
export class SandboxStandard4 extends JobSandbox {}

/** One argument for a POSIX shell, quoted so it stays one word whatever it holds. */
export function quote(argument: string): string {
  return `'${argument.replaceAll("'", `'"'"'`)}'`;
}

/** The shell line the SDK runs: the argv, each quoted, with its stdin (or none). */
export function commandLine(argv: readonly string[], stdin: boolean): string {
  return `${argv.map(quote).join(" ")} < ${stdin ? STDIN_PATH : "/dev/null"}`;
}

export function workdirOf(workdir: string | null): string {
  return workdir === null ? WORKSPACE : `${WORKSPACE}/${workdir}`;
}

/** Whether an SDK error says the path is not there (or not of the kind asked for). */
function missing(error: unknown): boolean {
  const code = error instanceof Error ? (error as { code?: unknown }).code : undefined;
  return code === "FILE_NOT_FOUND" || code === "NOT_DIRECTORY" || code === "IS_DIRECTORY";
}

/** `readFileStream`'s events (text or base64) as the file's bytes, pulled as read. */
function bytesOf(stream: ReadableStream<Uint8Array>): ReadableStream<Uint8Array> {
  const chunks = streamFile(stream);
  const encoder = new TextEncoder();
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      const next = await chunks.next();
      if (next.done === true) controller.close();
      else controller.enqueue(typeof next.value === "string" ? encoder.encode(next.value) : next.value);
    },
    async cancel() {
      await stream.cancel();
    },
  });
}

function inWorkspace(path: string): string {
  return path === "" ? WORKSPACE : `${WORKSPACE}/${path}`;
}

export function sandboxMachine(env: Env, launch: Launch): Machine {
  const { spec, egress, instanceType } = launch;
  const namespace = env[instanceType.binding];
  if (namespace === undefined) throw new Error(`no ${instanceType.binding} binding`);
  const sandbox = getSandbox(namespace, spec.id, {
    keepAlive: false,
    sleepAfter: launch.sleepAfterS,
    enableDefaultSession: false,
  });
  return {
    async start(): Promise<void> {
      if (egress.kind === "open") await sandbox.openInternet();
      if (egress.kind === "hosts") await sandbox.setAllowedHosts(egress.hosts);
      // The first call that needs the container starts it.
      await sandbox.mkdir(WORKSPACE, { recursive: true });
    },
    async run(command: Command, output: (stream: Stream, text: string) => void): Promise<number> {
      const cwd = workdirOf(command.workdir);
      await sandbox.mkdir(cwd, { recursive: true });
      for (const [path, content] of Object.entries(command.files)) {
        const target = `${WORKSPACE}/${path}`;
        await sandbox.mkdir(target.slice(0, target.lastIndexOf("/")), { recursive: true });
        await sandbox.writeFile(target, content, { encoding: "base64" });
      }
      if (command.stdin !== null) await sandbox.writeFile(STDIN_PATH, command.stdin, { encoding: "base64" });
      const result = await sandbox.exec(commandLine(command.argv, command.stdin !== null), {
        timeout: Math.ceil(command.timeout_s * 1000),
        env: command.env,
        cwd,
        stream: true,
        onOutput: output,
      });
      return result.exitCode;
    },
    async list(path: string): Promise<FileEntry[] | null> {
      try {
        const listed = await sandbox.listFiles(inWorkspace(path), { includeHidden: true });
        return listed.files.map((file) => ({ name: file.name, type: file.type, size: file.size }));
      } catch (error) {
        if (missing(error)) return null;
        throw error;
      }
    },
    async read(path: string): Promise<ReadableStream<Uint8Array> | null> {
      try {
        return bytesOf(await sandbox.readFileStream(inWorkspace(path)));
      } catch (error) {
        if (missing(error)) return null;
        throw error;
      }
    },
    destroy: () => sandbox.destroy(),
  };
}
