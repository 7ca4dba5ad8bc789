"""Runs cut short at their very start, against a real relay (uvloop) with bubblewrap: a
caller's tiny ``timeout_s`` lands the run's deadline inside the command's spawn. The run
ends ``timed_out``, never as a provider fault of the relay's own making."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.relay_server import RelayProcess


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("attack-cut-short"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()


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
