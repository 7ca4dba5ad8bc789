"""No secret in any answer, log line or metric.

A real relay runs with known values for every kind of secret: provider keys (E2B, Modal,
Vercel), caller tokens, the metrics token, and env / stdin / file values sent to jobs. It
runs jobs that succeed, fail, time out and are refused, and Vercel, E2B and Modal
providers whose API (a loopback server) refuses every call, at several statuses, while
quoting the key it was sent. Then every answer (status line, headers, body), every log line and the metrics
text are searched for each value.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from testing.relay_server import RelayProcess

# Runs that succeed, fail, time out and are refused on every provider.
pytestmark = pytest.mark.slow

SECRETS = {
    "e2b key": "e2b_canary_61f0a7",
    "vercel token": "vercel_canary_2b9e41",
    "modal token id": "ak-canary-93c1",
    "modal token secret": "as-canary-7d2e58",
    "metrics token": "metrics_canary_40aa",
    "env value": "env-canary-0c7f13",
    "stdin value": "stdin-canary-55b0e2",
    "file value": "file-canary-a91d3c",
    "wrong token": "rly_wrong-canary-118e",
}
PROVIDER_STATUSES = (401, 403, 404, 409, 429, 500, 503)


class HostileProviderApi:
    """Answers every call with ``status`` and a body quoting the caller's key."""

    def __init__(self) -> None:
        self.status = 401
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                quoted = f"key {self.headers.get('Authorization')} is bad; {SECRETS['e2b key']}"
                body = json.dumps({"error": {"code": "bad", "message": quoted}}).encode()
                self.send_response(api.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Echo-Key", str(self.headers.get("Authorization")))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_any

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def api() -> Iterator[HostileProviderApi]:
    server = HostileProviderApi()
    yield server
    server.close()


@pytest.fixture(scope="module")
def relay(
    tmp_path_factory: pytest.TempPathFactory, api: HostileProviderApi
) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("secrets"),
        local_isolation="bwrap",
        providers="local,vercel,e2b,modal",
        e2b_api_key=SECRETS["e2b key"],
        e2b_api_url=api.url,
        e2b_sandbox_url=api.url,
        vercel_token=SECRETS["vercel token"],
        vercel_team_id="team_scan",
        vercel_project_id="prj_scan",
        vercel_base_url=api.url,
        modal_token_id=SECRETS["modal token id"],
        modal_token_secret=SECRETS["modal token secret"],
        modal_server_url=api.url,
        metrics_token=SECRETS["metrics token"],
        create_timeout_s=5,
        max_wait_s=5,
        drain_s=1,
        log_level="debug",
    )
    SECRETS["ops token"] = server.add_token("ops", command=True)
    SECRETS["job token"] = server.add_token("jobs-only", jobs=["echo"])
    server.start()
    yield server
    server.stop()


def text_of(answer: httpx.Response) -> str:
    headers = "\n".join(f"{name}: {value}" for name, value in answer.headers.items())
    return f"{answer.status_code} {answer.reason_phrase}\n{headers}\n{answer.text}"


def test_no_secret_anywhere(relay: RelayProcess, api: HostileProviderApi) -> None:
    ops, jobs_only = SECRETS["ops token"], SECRETS["job token"]
    answers: list[httpx.Response] = []

    def post(token: str, body: dict[str, Any], **headers: str) -> None:
        answers.append(relay.post(token, body, **headers))

    post(jobs_only, {"job": "echo", "params": {"message": "hello"}})
    post(
        ops,
        {
            "command": ["sh", "-c", 'test -n "$API_KEY" && wc -c < secret.txt && wc -c'],
            "env": {"API_KEY": SECRETS["env value"]},
            "stdin": SECRETS["stdin value"],
            "files": {"secret.txt": SECRETS["file value"]},
        },
    )
    post(ops, {"command": ["sh", "-c", "exit 3"], "env": {"API_KEY": SECRETS["env value"]}})
    post(ops, {"command": ["no-such-binary"], "env": {"API_KEY": SECRETS["env value"]}})
    post(ops, {"command": ["sleep", "5"], "timeout_s": 0.3, "env": {"K": SECRETS["env value"]}})
    post(ops, {"command": ["true"], "env": {"K": SECRETS["env value"]}, "egress": ["example.com"]})
    post(jobs_only, {"command": ["true"], "env": {"K": SECRETS["env value"]}})
    post(ops, {"job": "echo", "params": {"message": 5}, "env": {"K": SECRETS["env value"]}})
    post(SECRETS["wrong token"], {"job": "echo", "params": {"message": "x"}})
    answers.append(
        httpx.get(
            relay.url + "/v1/jobs", headers={"Authorization": SECRETS["wrong token"]}, timeout=5
        )
    )
    post(ops, {"job": "echo", "params": {"message": "a"}}, **{"Idempotency-Key": "k1"})
    post(ops, {"job": "echo", "params": {"message": "b"}}, **{"Idempotency-Key": "k1"})
    for provider in ("vercel", "e2b", "modal"):
        for status in PROVIDER_STATUSES if provider != "modal" else (401,):
            api.status = status
            body = {"command": ["echo", "hi"], "provider": provider, "env": {"K": "v"}}
            body["env"] = {"K": SECRETS["env value"]}
            answer = relay.post(ops, body)
            assert answer.status_code >= 500, (provider, status, answer.text)
            answers.append(answer)
    run_ids = [a.json()["id"] for a in answers if a.status_code in (200, 202)]
    assert len(run_ids) >= 5
    for run_id in run_ids:
        answers.append(relay.get(ops, f"/v1/runs/{run_id}"))
    answers.append(relay.get(ops, "/v1/runs", limit=200))
    answers.append(relay.get(ops, "/v1/providers"))
    answers.append(relay.get(None, "/readyz"))
    answers.append(httpx.get(relay.url + "/metrics", timeout=5))  # refused: no token
    metrics = httpx.get(
        relay.url + "/metrics",
        headers={"Authorization": f"Bearer {SECRETS['metrics token']}"},
        timeout=5,
    )
    assert metrics.status_code == 200 and "relay_runs_total" in metrics.text
    states = {a.json()["state"] for a in answers[:8] if a.status_code == 200}
    assert {"succeeded", "failed", "timed_out"} <= states, states

    relay.stop()  # flush every log line, shutdown included
    log = relay.log()
    assert len(log.splitlines()) > 20
    places = {"answers": "\n".join(map(text_of, answers)), "log": log, "metrics": metrics.text}
    leaks = [
        f"{kind} in {place}"
        for kind, value in SECRETS.items()
        for place, text in places.items()
        if value in text
    ]
    assert not leaks, leaks
    # The log's last line of defence (known secret values are blanked) had nothing to do:
    assert "[redacted]" not in log
