"""The pipes of a local sandbox's command, against uvloop (what ``relay serve`` runs on):
a run cut short inside the spawn (a caller's tiny ``timeout_s``) ends ``timed_out``, and
every pipe is closed once, never a second time (when that number may be another file's)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.providers.local.spawn import PIDFDS
from testing.relay_server import REPO, RelayProcess


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("attack-spawn-fds"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize("timeout_s", [1e-300, 1e-6, 0.001])
def test_a_deadline_inside_the_spawn_is_a_timeout_not_a_provider_error(
    relay: RelayProcess, timeout_s: float
) -> None:
    """It was ``502 provider_error`` "could not start the command: Bad file descriptor":
    uvloop closes the fd of a pipe connect it abandons, and the pipe was closed again."""
    answer = relay.post(relay.tokens["ops"], {"command": ["true"], "timeout_s": timeout_s})
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "timed_out", answer.text
    assert "Bad file descriptor" not in relay.log()


SPAWNS = """
import asyncio, uvloop
from relay.providers.local.spawn import close, spawn

async def main():
    for _ in range(3):
        child = await spawn(["cat"], stdin=True, env={}, cwd=None, preexec_fn=None)
        child.stdin.write(b"x")
        child.stdin.close()
        while await child.stdout.read(100):
            pass
        await child.wait()
        close(child)
    await asyncio.sleep(0.05)

uvloop.run(main())
"""


@pytest.mark.skipif(shutil.which("strace") is None or not PIDFDS, reason="needs strace, pidfds")
def test_uvloop_closes_each_pipe_once(tmp_path: Path) -> None:
    """Handed the pipes' file objects, uvloop closed each pipe twice: libuv closed the fd,
    then uvloop closed the file object (EBADF, or a file another thread opened meanwhile)."""
    script = tmp_path / "spawns.py"
    script.write_text(textwrap.dedent(SPAWNS))
    trace = tmp_path / "trace"
    command = ["strace", "-f", "-qq", "-e", "trace=close", "-o", str(trace)]
    done = subprocess.run(
        [*command, sys.executable, str(script)], cwd=REPO, capture_output=True, timeout=30
    )
    traced = trace.read_text() if trace.exists() else ""
    if done.returncode != 0 and "close(" not in traced:
        pytest.skip(f"strace cannot trace here: {done.stderr.decode()[-200:]}")
    assert done.returncode == 0, done.stderr.decode()
    twice = [line for line in traced.splitlines() if "EBADF" in line]
    assert not twice, twice
