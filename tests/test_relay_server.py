"""The test rig itself: a restarted relay does not depend on getting its old port back."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from testing.relay_server import RelayProcess

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
