"""A run's artifacts through a real relay process (local provider, bubblewrap, SQLite): the
run's JSON lists them with a relative url built from the run alone, whatever Host the
request names, and a second read of the run lists the same."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from testing.relay_server import RelayProcess


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("artifacts"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()


def test_the_runs_json_lists_its_artifacts_with_a_relative_url(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    body = {
        "command": ["sh", "-c", "mkdir -p out && printf 'a,b\\n' > out/table.csv"],
        "artifacts": ["out/*.csv", "out/none.txt"],
    }
    answer = relay.post(token, body, Host="evil.example")
    assert answer.status_code == 200, answer.text
    run = answer.json()
    kept, missing = run["artifacts"]
    assert kept == {
        "name": "out/table.csv",
        "size": 4,
        "sha256": hashlib.sha256(b"a,b\n").hexdigest(),
        "content_type": "text/csv",
        "truncated": False,
        "truncated_by": None,
        "skipped": None,
        "url": f"/v1/runs/{run['id']}/artifacts/out/table.csv",
    }
    assert missing["skipped"] == "not found" and missing["url"] is None
    assert run["request"]["artifacts"] == ["out/*.csv", "out/none.txt"]
    again = relay.get(token, f"/v1/runs/{run['id']}").json()
    assert again["artifacts"] == run["artifacts"]
    listed = relay.get(token, "/v1/runs", limit=5).json()["runs"]
    assert "artifacts" not in listed[0]  # a listing stays small: the run alone shows them
