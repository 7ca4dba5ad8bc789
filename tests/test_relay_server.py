"""The test rig itself: a restarted relay does not depend on getting its old port back, and a
relay outlives no test process."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from testing.relay_server import REPO, RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds


def test_a_restart_does_not_need_the_port_it_had(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "r")
    token = server.add_token("t", command=True)
    server.start()
    old = server.port
    assert server.stop() == 0
    # On a busy machine any process may take the port at once (here: a listener).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", old))
        taken.listen()
        server.start()
        try:
            assert server.port != old
            assert server.post(token, {"command": ["echo", "back"]}).json()["stdout"] == "back\n"
        finally:
            assert server.stop() == 0


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
from testing.relay_server import RelayProcess
server = RelayProcess(Path(sys.argv[1]))
server.add_token("t", command=True)
server.start()
print(server.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_relay_of_a_killed_test_process_does_not_live_on(tmp_path: Path) -> None:
    """A run killed outright (CI's timeout, SIGKILL) left its relays serving, with their
    runs and sandboxes, for good: the next run on the machine met them."""
    done = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path / "r")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    relay = psutil.Process(int(done.stdout))
    try:
        relay.wait(30)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            relay.kill()
    # SIGTERM: it shut down as it does when stopped (its runs canceled, sandboxes gone).
    assert "Application shutdown complete." in (tmp_path / "r" / "relay.log").read_text()
