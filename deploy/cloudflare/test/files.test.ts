import { afterEach, describe, expect, it } from "vitest";

import { call, container, eventually, job } from "./contract";
import { standIn } from "./stand-in";

afterEach(() => standIn.reset());

const command = (argv: string[]) => ({ argv, timeout_s: 10 });
const ended = (id: string) =>
  eventually(async () => {
    const answer = await call("GET", `/v1/jobs/${id}`);
    return ["exited", "timed_out", "error", "lost"].includes(answer.body.state) ? answer.body : null;
  });

describe("a kept container's files", () => {
  it("are listed and read back after the command ended, until the DELETE", async () => {
    await call("POST", "/v1/jobs", { body: container("files_kept") });
    await call("POST", "/v1/jobs/files_kept/run", { body: command(["write", "out/report.txt", "hello world"]) });
    await ended("files_kept");
    const top = await call("GET", "/v1/jobs/files_kept/files");
    expect([top.status, top.body]).toEqual([200, { files: [{ name: "out", type: "directory", size: 0 }] }]);
    const out = await call("GET", "/v1/jobs/files_kept/files?path=out");
    expect(out.body).toEqual({ files: [{ name: "report.txt", type: "file", size: 11 }] });
    const whole = await call("GET", "/v1/jobs/files_kept/file?path=out/report.txt");
    expect([whole.status, whole.text, whole.headers.get("content-type")]).toEqual([
      200,
      "hello world",
      "application/octet-stream",
    ]);
    // The cap falls inside the first chunk: nothing past it is sent.
    const cut = await call("GET", "/v1/jobs/files_kept/file?path=out/report.txt&limit=2");
    expect(cut.text).toBe("he");
    const missing = await call("GET", "/v1/jobs/files_kept/file?path=out/none.txt");
    expect([missing.status, missing.body.error.code]).toEqual([404, "no_such_path"]);
    const noFolder = await call("GET", "/v1/jobs/files_kept/files?path=nowhere");
    expect([noFolder.status, noFolder.body.error.code]).toEqual([404, "no_such_path"]);
    await call("DELETE", "/v1/jobs/files_kept");
    const gone = await call("GET", "/v1/jobs/files_kept/files");
    expect([gone.status, gone.body.error.code]).toEqual([409, "files_unavailable"]);
  });

  it("are refused with a clear 400 for a path out of /workspace or a bad limit", async () => {
    await call("POST", "/v1/jobs", { body: container("files_bad") });
    await call("POST", "/v1/jobs/files_bad/run", { body: command(["write", "a.txt", "x"]) });
    await ended("files_bad");
    for (const query of ["path=../etc/passwd", "path=/etc/passwd", "path=a/./b", "path=a.txt&limit=0", "path=a.txt&limit=x"]) {
      const refused = await call("GET", `/v1/jobs/files_bad/file?${query}`);
      expect([query, refused.status]).toEqual([query, 400]);
    }
    expect((await call("GET", "/v1/jobs/files_bad/file")).status).toBe(400);
    await call("DELETE", "/v1/jobs/files_bad");
  });

  it("are read while the command still runs, and not there for a one-shot or unknown job", async () => {
    await call("POST", "/v1/jobs", { body: job("files_once", { argv: ["write", "a.txt", "x"] }) });
    await ended("files_once");
    const once = await call("GET", "/v1/jobs/files_once/files");
    expect([once.status, once.body.error.code]).toEqual([409, "files_unavailable"]);
    await call("POST", "/v1/jobs", { body: container("files_running") });
    const waiting = await call("GET", "/v1/jobs/files_running/files");
    expect([waiting.status, waiting.body.error.code]).toEqual([409, "files_unavailable"]);
    await call("POST", "/v1/jobs/files_running/run", { body: command(["sleep"]) });
    const running = await call("GET", "/v1/jobs/files_running/files");
    expect([running.status, running.body]).toEqual([200, { files: [] }]);
    await call("DELETE", "/v1/jobs/files_running");
    const unknown = await call("GET", "/v1/jobs/files_none/files");
    expect([unknown.status, unknown.body.error.code]).toEqual([404, "not_found"]);
  });

  it("list a link as a link, and never read it", async () => {
    await call("POST", "/v1/jobs", { body: container("files_link") });
    await call("POST", "/v1/jobs/files_link/run", { body: command(["link", "secret"]) });
    await ended("files_link");
    const top = await call("GET", "/v1/jobs/files_link/files");
    expect(top.body.files).toEqual([{ name: "secret", type: "symlink", size: 4 }]);
    expect((await call("GET", "/v1/jobs/files_link/file?path=secret")).status).toBe(404);
    await call("DELETE", "/v1/jobs/files_link");
  });
});
