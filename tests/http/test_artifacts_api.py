"""A run's artifacts through a real relay process (local provider, bubblewrap, SQLite): the
run's JSON lists them with a relative url built from the run alone, whatever Host the
request names, a second read of the run lists the same, and each url downloads the bytes
(streamed, an attachment, never cached) to the run's own token only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("artifacts"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.add_token("other", command=True)
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


def test_each_artifact_downloads_from_its_url_to_its_runs_token_only(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    script = (
        "mkdir -p out && head -c 1000000 /dev/urandom > 'out/big data.bin' && "
        "printf '<script>alert(1)</script>' > out/page.html && printf 'é' > out/été.txt"
    )
    run = relay.post(
        token, {"command": ["sh", "-c", script], "artifacts": ["out/*", "gone"]}
    ).json()
    listed = {entry["name"]: entry for entry in run["artifacts"]}
    big = listed["out/big data.bin"]
    assert big["url"].endswith("/artifacts/out/big%20data.bin")
    got = httpx.get(relay.url + big["url"], headers=relay.headers(token), timeout=30)
    assert got.status_code == 200
    assert (
        hashlib.sha256(got.content).hexdigest() == big["sha256"] and len(got.content) == 1_000_000
    )
    assert got.headers["content-length"] == "1000000"
    assert got.headers["cache-control"] == "no-store"
    assert got.headers["content-disposition"] == (
        "attachment; filename=\"big data.bin\"; filename*=UTF-8''big%20data.bin"
    )
    assert got.headers["etag"] == f'"{big["sha256"]}"'
    # A job's HTML is never a page of the relay's: an attachment, sandboxed, not sniffed.
    page = httpx.get(relay.url + listed["out/page.html"]["url"], headers=relay.headers(token))
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-disposition"].startswith("attachment;")
    assert page.headers["content-security-policy"] == "sandbox"
    assert page.headers["x-content-type-options"] == "nosniff"
    accented = httpx.get(relay.url + listed["out/été.txt"]["url"], headers=relay.headers(token))
    assert accented.content == "é".encode()
    assert "filename*=UTF-8''%C3%A9t%C3%A9.txt" in accented.headers["content-disposition"]
    for asked, as_token in (
        (big["url"], relay.tokens["other"]),  # another token's run is absent
        (big["url"] + "x", token),  # no such name
        (f"/v1/runs/{run['id']}/artifacts/gone", token),  # skipped: nothing kept
        (f"/v1/runs/{run['id']}/artifacts/../../runs", token),
    ):
        refused = httpx.get(relay.url + asked, headers=relay.headers(as_token))
        assert refused.status_code == 404, asked
        assert refused.json()["error"]["code"] == "not_found"
    assert httpx.get(relay.url + big["url"]).status_code == 401


def test_relay_run_and_relay_runs_artifacts_download_them(
    relay: RelayProcess, tmp_path: Path
) -> None:
    env = {"PATH": os.environ["PATH"], "RELAY_URL": relay.url, "RELAY_TOKEN": relay.tokens["ops"]}

    def relay_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relay", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    script = "mkdir -p out/deep && printf one > out/a.txt && printf two > out/deep/b.txt"
    ran = relay_cli(
        "exec", "--artifact", "out/*.txt", "--artifact", "out/deep/*", "--artifacts", "got",
        "--json", "--", "sh", "-c", script,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "got/out/a.txt").read_text() == "one"
    assert "saved got/out/a.txt" in ran.stderr
    run_id = json.loads(ran.stdout)["id"]
    again = relay_cli("runs", "artifacts", run_id, "-o", "again")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again/out/deep/b.txt").read_text() == "two"
    missing = relay_cli("runs", "artifacts", "run_nope", "-o", "x")
    assert missing.returncode == 4 and "no such run" in missing.stderr
