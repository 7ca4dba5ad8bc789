// The relay's /mcp as a host built on the official MCP TypeScript SDK sees it: connect, list
// the tools (which also makes the client check every later result against the tool's
// outputSchema), call them, follow progress, cancel, and be refused in every way the relay
// refuses. Each call's outcome, or what the client threw, goes into one JSON report on stdout;
// tests/http/test_mcp_clients.py judges it. Nothing here knows the relay's answers.
//
// Environment: RELAY_MCP_URL (the /mcp URL), RELAY_TOKENS (JSON: token name -> value, for the
// names used below), RELAY_CANCELED_SLEEP (the seconds the canceled run sleeps: the test finds
// its process by them, so no other run on the host sleeps them). One line in between: {"waiting": "shrink"} on stdout, after which the
// test takes the job "sleep" from the token "shrinking" and answers with a line on stdin.

import { createInterface } from "node:readline";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const url = new URL(process.env.RELAY_MCP_URL);
const tokens = JSON.parse(process.env.RELAY_TOKENS);
const canceledSleep = process.env.RELAY_CANCELED_SLEEP;
const report = { protocolVersion: null, tools: {}, calls: {} };
const stdin = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

async function connect(name) {
  const transport = new StreamableHTTPClientTransport(url, {
    requestInit: { headers: { Authorization: `Bearer ${tokens[name]}` } },
  });
  const client = new Client({ name: "relay-check", version: "1.0.0" });
  await client.connect(transport);
  report.protocolVersion = transport.protocolVersion ?? null;
  const { tools } = await client.listTools();
  report.tools[name] = tools.map((tool) => tool.name);
  return {
    client,
    async close() {
      await transport.terminateSession();
      await client.close();
    },
  };
}

function described(error) {
  if (error instanceof Error) {
    return { thrown: `${error.name}: ${error.message}`, code: error.code ?? null };
  }
  return { thrown: String(error), code: null };
}

async function call(label, client, name, args, options = {}) {
  const outcome = {};
  report.calls[label] = outcome;
  try {
    const result = await client.callTool({ name, arguments: args }, undefined, options);
    outcome.isError = result.isError ?? false;
    outcome.text = result.content.filter((item) => item.type === "text").map((item) => item.text);
    outcome.structured = result.structuredContent ?? null;
  } catch (error) {
    Object.assign(outcome, described(error));
  }
  return outcome;
}

const ops = await connect("ops");

const progress = [];
const script = "for i in 1 2 3; do echo line$i; sleep 0.2; done";
(await call("progress", ops.client, "run_command", { command: ["sh", "-c", script] }, {
  onprogress: (update) => progress.push(update),
})).progress = progress;

// Canceled at its first output, as a user stopping the host would; the test then finds the
// run canceled and its sandbox gone.
const controller = new AbortController();
await call("canceled", ops.client, "run_command", { command: ["sh", "-c", `echo up; sleep ${canceledSleep}`] }, {
  signal: controller.signal,
  onprogress: () => controller.abort("the user stopped it"),
});
await call("after_cancel", ops.client, "echo", { message: "still here" });

await call("failed", ops.client, "run_command", { command: ["sh", "-c", "echo out; exit 7"] });
await call("timed_out", ops.client, "run_command", {
  command: ["sh", "-c", "echo started; sleep 365"],
  timeout_s: 1,
});
const running = await call("still_running", ops.client, "sleep", { seconds: 3 });
await call("get_run", ops.client, "get_run", { run_id: running.structured?.id ?? "none" });

// Every way the relay refuses: each must reach the model as text.
await call("invalid_type", ops.client, "echo", { message: 12345 });
await call("param_as_option", ops.client, "echo", { message: "--version" });
await call("unknown_argument", ops.client, "echo", { message: "x", stdin: "no" });
await call("validation", ops.client, "run_command", { command: [] });
await call("unknown_run", ops.client, "get_run", { run_id: "run_nope" });
await call("unknown_tool", ops.client, "no-such-tool", {});
await ops.close();

const once = await connect("once");
await call("first", once.client, "echo", { message: "one" });
await call("limit", once.client, "echo", { message: "two" });
await once.close();

const broke = await connect("broke");
await call("budget", broke.client, "echo", { message: "costly" });
await broke.close();

const echoOnly = await connect("echo-only");
await call("no_command_scope", echoOnly.client, "run_command", { command: ["id"] });
await echoOnly.close();

// A host lists the tools once; the token loses a job meanwhile; the host calls it.
const shrinking = await connect("shrinking");
process.stdout.write(`${JSON.stringify({ waiting: "shrink" })}\n`);
await stdin.next();
await call("forbidden_job", shrinking.client, "sleep", { seconds: 0 });
await shrinking.close();

process.stdout.write(`${JSON.stringify({ report })}\n`);
process.exit(0);
