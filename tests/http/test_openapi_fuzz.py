"""The OpenAPI document is valid, and a live relay keeps every promise it makes.

Schemathesis reads ``/openapi.json`` from a real relay (local provider, bubblewrap) and
sends a few hundred generated requests — valid and invalid bodies, headers, query
strings, undeclared methods, missing auth, and chains that follow the document's links
(submit → get → cancel). Every answer must be a documented status with a body that
matches its schema, and none may be a 5xx.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate

from relay.http.openapi import document
from tests.relay_server import RelayProcess

# Semantics the schema cannot carry: a schema-valid body can name a job that does not
# exist (422), and a well-formed cursor can be one this relay never gave out (400).
# DELETE cancels a run and the run stays readable, so "deleted resource still
# available" does not apply.
CONFIG = """
[[operations]]
include-operation-id = "createRun"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

[[operations]]
include-operation-id = "listRuns"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404"]
"""


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("fuzz"), local_isolation="bwrap", max_wait_s=2, drain_s=1
    )
    server.add_token("fuzz", command=True)
    server.start()
    yield server
    server.stop()


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    validate(doc)
    assert doc["openapi"] == "3.1.0"
    json.dumps(doc)  # plain JSON, as served


def test_the_served_document_is_the_generated_one(relay: RelayProcess) -> None:
    served = httpx.get(relay.url + "/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.json() == json.loads(json.dumps(document()))


def test_schemathesis_finds_no_5xx_and_no_schema_violation(
    relay: RelayProcess, tmp_path: Path
) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    token = relay.tokens["fuzz"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "--no-color",
            "run",
            relay.url + "/openapi.json",
            "--header",
            f"Authorization: Bearer {token}",
            "--checks",
            "all",
            "--exclude-checks",
            "use_after_free",
            "--max-examples",
            "25",
            "--seed",
            "20261129",
            "--workers",
            "1",
            "--request-timeout",
            "20",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 200, report[-2000:]
    statuses = [
        json.loads(line).get("status")
        for line in relay.log().splitlines()
        if line.startswith("{") and '"event": "request"' in line
    ]
    assert len(statuses) >= 200
    assert not [status for status in statuses if status >= 500]
    assert httpx.get(relay.url + "/readyz", timeout=5).status_code == 200
