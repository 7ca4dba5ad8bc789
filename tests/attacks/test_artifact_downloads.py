"""A tenant reaching for another tenant's artifacts through a real relay (local provider,
bubblewrap, SQLite): a download asks the run's own auth first, then the run's stored names
exactly, so no spelling of a path (encoded ``..``, ``%2F``, another run's id inside the
name) reaches another run's file, and every miss reads as absent (404), never 500."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest

from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("downloads"), local_isolation="bwrap")
    server.add_token("victim", command=True)
    server.add_token("tenant", command=True)
    server.start()
    yield server
    server.stop()


def _raw_get(relay: RelayProcess, token: str, path: str) -> int:
    """The status of a GET of ``path`` sent as written (httpx would normalise it)."""
    host, port = relay.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers=relay.headers(token))
        return connection.getresponse().status
    finally:
        connection.close()


def test_no_spelling_of_a_path_reads_another_tenants_artifact(relay: RelayProcess) -> None:
    script = "mkdir -p out && printf secret > out/secret.txt"
    victim = relay.post(
        relay.tokens["victim"], {"command": ["sh", "-c", script], "artifacts": ["out/*"]}
    ).json()
    mine = relay.post(
        relay.tokens["tenant"], {"command": ["sh", "-c", script], "artifacts": ["out/*"]}
    ).json()
    assert victim["artifacts"][0]["sha256"] and mine["artifacts"][0]["sha256"]
    theirs, own, token = victim["id"], mine["id"], relay.tokens["tenant"]
    assert _raw_get(relay, token, f"/v1/runs/{own}/artifacts/out/secret.txt") == 200
    for path in (
        f"/v1/runs/{theirs}/artifacts/out/secret.txt",
        f"/v1/runs/{theirs}/artifacts/out%2Fsecret.txt",
        f"/v1/runs/{own}/artifacts/..%2F..%2F{theirs}%2Fartifacts%2Fout%2Fsecret.txt",
        f"/v1/runs/{own}/artifacts/%2e%2e/%2e%2e/{theirs}/artifacts/out/secret.txt",
        f"/v1/runs/{own}/artifacts/../../{theirs}/artifacts/out/secret.txt",
        f"/v1/runs/{own}%2F..%2F{theirs}/artifacts/out/secret.txt",
        f"/v1/runs/{theirs}/artifacts/out/./secret.txt",
        f"/v1/runs/{own}/artifacts/{theirs}/out/secret.txt",
        f"/v1/runs/{own}/artifacts/out/secret.txt%00",
        f"/v1/runs/{own}/artifacts/" + "a" * 5000,
    ):
        status = _raw_get(relay, token, path)
        assert status in (400, 404), (path, status)
