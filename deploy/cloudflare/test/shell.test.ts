import { describe, expect, it } from "vitest";

import { commandLine, quote, workdirOf } from "../src/sandbox";

describe("the command line the SDK runs", () => {
  it("keeps each argument one word, whatever it holds", () => {
    expect(quote("it's")).toBe(`'it'"'"'s'`);
    expect(commandLine(["sh", "-c", "echo $HOME; rm -rf / `x` \"y\""], false)).toBe(
      `'sh' '-c' 'echo $HOME; rm -rf / \`x\` "y"' < /dev/null`,
    );
  });

  it("feeds stdin from the file the machine wrote, else from /dev/null", () => {
    expect(commandLine(["cat"], true)).toBe("'cat' < /tmp/.relay-stdin");
    expect(commandLine([""], false)).toBe("'' < /dev/null");
  });

  it("runs in /workspace or a folder under it", () => {
    expect(workdirOf(null)).toBe("/workspace");
    expect(workdirOf("a/b")).toBe("/workspace/a/b");
  });
});
