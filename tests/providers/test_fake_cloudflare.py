"""The fake job Worker (testing/fakes/cloudflare) against the Worker's contract.

Every answer here is checked against ``deploy/cloudflare/openapi.yaml``, the document the
Worker's own tests (deploy/cloudflare/test) check the real Worker's answers against: its
status must be documented for the path and method, its body must match the schema (each
line of an NDJSON stream one ``Event``). The tests also pin down what the provider
(relay/providers/cloudflare.py) relies on: real processes, idempotent creates and runs, the
two-step form (a container kept after its command until a DELETE or the deadline), the
deadline alarm, confirmed deletes, the listing, and the fault switches the contract's fault
suite uses.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
from openapi_spec_validator import validate

from testing.fakes.cloudflare import BAD_KEY, BODY_MARKER, KEY, FakeCloudflare, running_fake
from testing.fakes.cloudflare.contract import DOCUMENT, document
from testing.fakes.vercel.jail import bwrap


@functools.cache
def _response_validator(schema_json: str) -> jsonschema_rs.Draft202012Validator:
    schema = {**json.loads(schema_json), "components": document()["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


def _resolved(node: dict[str, Any]) -> dict[str, Any]:
    reference = node.get("$ref")
    if reference is None:
        return node
    found: Any = document()
    for part in reference.removeprefix("#/").split("/"):
        found = found[part]
    return dict(found)


def assert_conforms(method: str, path: str, response: httpx.Response) -> None:
    """The answer is one openapi.yaml documents for this path and method, body included."""
    paths: dict[str, Any] = document()["paths"]
    template = next(
        (t for t in paths if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", t), path)), None
    )
    assert template is not None, f"{path} is not in openapi.yaml"
    operation = paths[template].get(method.lower())
    assert operation is not None, f"{method} {path} is not in openapi.yaml"
    documented = operation["responses"].get(str(response.status_code))
    assert documented is not None, f"{method} {path} answered {response.status_code}: undocumented"
    media = response.headers["content-type"].split(";")[0].strip()
    content = _resolved(documented).get("content", {}).get(media)
    assert content is not None, f"{method} {path} {response.status_code}: {media} undocumented"
    check = _response_validator(json.dumps(content["schema"], sort_keys=True))
    lines = response.text.splitlines() if media == "application/x-ndjson" else [response.text]
    for line in filter(None, lines):
        errors = [error.message for error in check.iter_errors(json.loads(line))]
        assert errors == [], f"{method} {path} {response.status_code}: {line[:300]}"


class Worker:
    """An HTTP client for the fake whose every answer is checked against the contract."""

    def __init__(self, fake: FakeCloudflare, key: str | None = KEY) -> None:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        self.client = httpx.Client(base_url=fake.url, headers=headers, timeout=10)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *_: object) -> None:
        self.client.close()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.client.request(method, path, **kwargs)
        raw_path = response.request.url.raw_path.decode("ascii").split("?")[0]
        assert_conforms(method, raw_path, response)
        return response

    def job(self, job_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.call("GET", f"/v1/jobs/{job_id}").json()
        return answer

    def finished(self, job_id: str, seconds: float = 10.0) -> dict[str, Any]:
        """The job once its container is destroyed."""
        done: dict[str, Any] = eventually(
            lambda: (job := self.job(job_id))["destroyed_at"] and job, seconds
        )
        return done

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        response = self.call("GET", f"/v1/jobs/{job_id}/events", params={"after": after})
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.text.splitlines() if line]


def eventually(check: Callable[[], Any], seconds: float = 10.0) -> Any:
    """Wait (briefly) until ``check()`` answers something true; that answer."""
    deadline = time.monotonic() + seconds
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError("not in time")
        time.sleep(0.02)
    return value


def job(job_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "argv": ["echo", "hi"],
        "timeout_s": 30,
        "tags": {"relay-cluster": "test", "relay-run": job_id},
        **fields,
    }


def container(job_id: str, **fields: Any) -> dict[str, Any]:
    """A two-step job's create body: no command."""
    return {
        "id": job_id,
        "timeout_s": 30,
        "tags": {"relay-cluster": "test", "relay-run": job_id},
        **fields,
    }


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def fake() -> Iterator[FakeCloudflare]:
    with running_fake() as fake:
        yield fake


@pytest.fixture
def worker(fake: FakeCloudflare) -> Iterator[Worker]:
    with Worker(fake) as client:
        yield client


def test_the_contract_is_a_valid_openapi_document() -> None:
    validate(document())
    assert DOCUMENT.name == "openapi.yaml" and document()["openapi"].startswith("3.1")


# --- jobs ------------------------------------------------------------------------------------


def test_a_job_runs_as_a_real_process_with_its_files_env_stdin_and_workdir(
    fake: FakeCloudflare, worker: Worker
) -> None:
    script = 'cat in.txt; echo; echo "$GREETING"; cat; echo; pwd'
    body = job(
        "run_real",
        argv=["sh", "-c", script],
        files={"data/in.txt": b64("hello")},
        workdir="data",
        stdin=b64("from stdin"),
        env={"GREETING": "hi there"},
    )
    created = worker.call("POST", "/v1/jobs", json=body)
    assert created.status_code == 201
    assert created.headers["location"] == "/v1/jobs/run_real"
    done = worker.finished("run_real")
    assert done["stdout"] == "hello\nhi there\nfrom stdin\n/workspace/data\n" or not bwrap()
    assert (done["state"], done["exit_code"], done["destroyed_by"]) == ("exited", 0, "exit")
    assert fake.ledger.alive() == set()
    assert fake.ledger.commands[0]["env_names"] == ["GREETING"]


def test_a_command_that_fails_or_is_missing_exits_with_its_code(worker: Worker) -> None:
    worker.call("POST", "/v1/jobs", json=job("run_fail", argv=["sh", "-c", "echo no >&2; exit 3"]))
    worker.call("POST", "/v1/jobs", json=job("run_missing", argv=["no-such-command-here"]))
    failed, missing = worker.finished("run_fail"), worker.finished("run_missing")
    assert (failed["state"], failed["exit_code"], failed["stderr"]) == ("exited", 3, "no\n")
    assert (missing["state"], missing["exit_code"]) == ("exited", 127)


def test_a_retry_is_the_same_job_and_another_body_is_a_conflict(
    fake: FakeCloudflare, worker: Worker
) -> None:
    body = job("run_twice", argv=["sleep", "30"])
    first = worker.call("POST", "/v1/jobs", json=body)
    again = worker.call("POST", "/v1/jobs", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["created_at"] == first.json()["created_at"]
    other = worker.call("POST", "/v1/jobs", json={**body, "argv": ["true"]})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "id_conflict")
    assert [entry["id"] for entry in fake.ledger.created] == ["run_twice"]


def test_the_command_is_killed_at_its_timeout(worker: Worker) -> None:
    worker.call("POST", "/v1/jobs", json=job("run_slow", argv=["sleep", "30"], timeout_s=0.3))
    done = worker.finished("run_slow")
    assert (done["state"], done["exit_code"]) == ("timed_out", 124)
    assert done["stderr"].endswith("Command timed out after 300 ms\n")


def test_the_alarm_destroys_the_container_at_the_deadline(
    fake: FakeCloudflare, worker: Worker
) -> None:
    fake.faults.timeout_ignored = True
    body = job("run_stubborn", argv=["sleep", "30"], timeout_s=0.2, grace_s=0.3)
    created = worker.call("POST", "/v1/jobs", json=body).json()
    assert fake.ledger.lifetime_of("run_stubborn") == pytest.approx(0.5)
    deadline = time.time() + 0.5
    done = worker.finished("run_stubborn", seconds=4)
    assert (done["state"], done["destroyed_by"], done["exit_code"]) == ("timed_out", "alarm", None)
    assert created["deadline"] == done["deadline"]
    assert fake.ledger.destroyed[0]["at"] == pytest.approx(deadline, abs=1.0)


def test_a_delete_answers_200_once_destroyed_and_202_while_the_destroy_fails(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=job("run_stuck", argv=["sleep", "30"]))
    eventually(lambda: worker.job("run_stuck")["state"] == "running")
    fake.faults.terminate_failures = 1
    pending = worker.call("DELETE", "/v1/jobs/run_stuck")
    assert pending.status_code == 202
    assert pending.json()["destroy_pending"] and pending.json()["destroyed_at"] is None
    assert fake.ledger.alive() == {"run_stuck"}
    listed = worker.call("GET", "/v1/jobs").json()["jobs"]
    assert [entry["id"] for entry in listed] == ["run_stuck"]
    fake.call("alarm", "run_stuck")  # the retry the fake has set, now
    done = worker.finished("run_stuck", seconds=3)
    assert (done["state"], done["destroyed_by"]) == ("canceled", "alarm")
    confirmed = worker.call("DELETE", "/v1/jobs/run_stuck")
    assert confirmed.status_code == 200 and confirmed.json()["destroy_pending"] is False


def test_a_failed_destroy_is_retried_until_it_is_done(fake: FakeCloudflare, worker: Worker) -> None:
    fake.world.destroy_retry_s = 0.1
    fake.faults.terminate_failures = 3
    worker.call("POST", "/v1/jobs", json=job("run_retried", argv=["true"]))
    done = worker.finished("run_retried", seconds=5)
    assert (done["state"], done["destroyed_by"]) == ("exited", "alarm")
    assert fake.faults.terminate_failures == 0 and fake.ledger.alive() == set()


def test_a_delete_ends_a_running_job_and_confirms_its_destroy(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=job("run_cancel", argv=["sleep", "30"]))
    eventually(lambda: worker.job("run_cancel")["state"] == "running")
    deleted = worker.call("DELETE", "/v1/jobs/run_cancel")
    assert deleted.status_code == 200
    assert (deleted.json()["state"], deleted.json()["destroyed_by"]) == ("canceled", "delete")
    assert fake.ledger.alive() == set() and fake.ledger.destroyed_by("run_cancel") == "delete"


def test_probing_an_unknown_job_answers_404_and_makes_nothing(
    fake: FakeCloudflare, worker: Worker
) -> None:
    for method, path in [
        ("GET", "/v1/jobs/run_ghost"),
        ("GET", "/v1/jobs/run_ghost/events"),
        ("DELETE", "/v1/jobs/run_ghost"),
    ]:
        answer = worker.call(method, path)
        assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not_found")
    assert fake.ledger.created == []


def test_live_jobs_are_listed_by_tag_and_paged(worker: Worker) -> None:
    for job_id, cluster in [("run_a", "blue"), ("run_b", "blue"), ("run_c", "green")]:
        tags = {"relay-cluster": cluster, "relay-run": job_id}
        worker.call("POST", "/v1/jobs", json=job(job_id, argv=["sleep", "30"], tags=tags))
    blue = worker.call("GET", "/v1/jobs", params={"tag": "relay-cluster=blue", "limit": 1})
    assert [entry["id"] for entry in blue.json()["jobs"]] == ["run_a"]
    rest = worker.call(
        "GET",
        "/v1/jobs",
        params={"tag": "relay-cluster=blue", "cursor": blue.json()["next_cursor"]},
    )
    assert rest.json() == {"jobs": [rest.json()["jobs"][0]], "next_cursor": None}
    assert rest.json()["jobs"][0]["id"] == "run_b"
    both = worker.call(
        "GET", "/v1/jobs", params=[("tag", "relay-cluster=green"), ("tag", "relay-run=run_c")]
    )
    assert [entry["id"] for entry in both.json()["jobs"]] == ["run_c"]
    worker.call("DELETE", "/v1/jobs/run_a")
    after = worker.call("GET", "/v1/jobs", params={"tag": "relay-cluster=blue"}).json()
    assert [entry["id"] for entry in after["jobs"]] == ["run_b"]


# --- two-step jobs --------------------------------------------------------------------------


def test_a_two_step_job_is_ready_then_runs_its_command_and_keeps_its_container(
    fake: FakeCloudflare, worker: Worker
) -> None:
    created = worker.call("POST", "/v1/jobs", json=container("run_two"))
    assert created.status_code == 201
    assert (created.json()["state"], created.json()["destroy_pending"]) == ("ready", False)
    assert fake.ledger.alive() == {"run_two"} and fake.ledger.commands == []
    command = {
        "argv": ["sh", "-c", 'cat in.txt; echo "$GREETING"; cat'],
        "files": {"data/in.txt": b64("hello\n")},
        "workdir": "data",
        "stdin": b64("from stdin\n"),
        "env": {"GREETING": "hi there"},
        "timeout_s": 10,
    }
    ran = worker.call("POST", "/v1/jobs/run_two/run", json=command)
    assert (ran.status_code, ran.json()["state"]) == (202, "running")
    lines = worker.events("run_two")
    assert lines[-1]["type"] == "end" and lines[-1]["destroyed_at"] is None
    done = worker.job("run_two")
    assert (done["state"], done["exit_code"], done["destroyed_at"]) == ("exited", 0, None)
    assert done["stdout"] == "hello\nhi there\nfrom stdin\n" or not bwrap()
    assert fake.ledger.alive() == {"run_two"}  # kept after its command
    listed = worker.call("GET", "/v1/jobs", params={"tag": "relay-run=run_two"}).json()
    assert [entry["id"] for entry in listed["jobs"]] == ["run_two"]
    deleted = worker.call("DELETE", "/v1/jobs/run_two")
    assert (deleted.status_code, deleted.json()["destroyed_by"]) == (200, "delete")
    assert fake.ledger.alive() == set()


def test_a_retried_run_is_the_same_run_and_another_command_is_refused(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=container("run_twice"))
    command = {"argv": ["sleep", "30"], "timeout_s": 30}
    assert worker.call("POST", "/v1/jobs/run_twice/run", json=command).status_code == 202
    assert worker.call("POST", "/v1/jobs/run_twice/run", json=command).status_code == 200
    other = worker.call("POST", "/v1/jobs/run_twice/run", json={**command, "argv": ["true"]})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "already_run")
    worker.call("POST", "/v1/jobs", json=job("run_oneshot", argv=["sleep", "30"]))
    refused = worker.call("POST", "/v1/jobs/run_oneshot/run", json=command)
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "already_run")
    assert [entry["id"] for entry in fake.ledger.commands] == ["run_twice", "run_oneshot"]


def test_a_run_for_a_job_that_ended_or_never_was_is_refused(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=container("run_ended"))
    worker.call("DELETE", "/v1/jobs/run_ended")
    command = {"argv": ["true"], "timeout_s": 5}
    late = worker.call("POST", "/v1/jobs/run_ended/run", json=command)
    assert (late.status_code, late.json()["error"]["code"]) == (409, "job_ended")
    ghost = worker.call("POST", "/v1/jobs/run_ghost/run", json=command)
    assert (ghost.status_code, ghost.json()["error"]["code"]) == (404, "not_found")
    assert fake.ledger.commands == []


def test_the_alarm_destroys_a_two_step_container_waiting_or_kept(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=container("run_idle", timeout_s=0.2, grace_s=0.1))
    worker.call("POST", "/v1/jobs", json=container("run_kept", timeout_s=0.3, grace_s=0.1))
    worker.call("POST", "/v1/jobs/run_kept/run", json={"argv": ["true"], "timeout_s": 5})
    idle, kept = worker.finished("run_idle", seconds=4), worker.finished("run_kept", seconds=4)
    assert (idle["state"], idle["destroyed_by"]) == ("timed_out", "alarm")
    assert (kept["state"], kept["exit_code"], kept["destroyed_by"]) == ("exited", 0, "alarm")
    assert fake.ledger.alive() == set()


def test_a_restart_while_a_job_waits_loses_nothing_and_one_under_its_command_loses_it(
    fake: FakeCloudflare, worker: Worker
) -> None:
    worker.call("POST", "/v1/jobs", json=container("run_waits"))
    fake.call("vanish", "run_waits")
    assert worker.job("run_waits")["state"] == "ready"
    worker.call("POST", "/v1/jobs/run_waits/run", json={"argv": ["sleep", "30"], "timeout_s": 30})
    fake.call("vanish", "run_waits")
    assert (worker.job("run_waits")["state"], fake.ledger.destroyed_by("run_waits")) == (
        "lost",
        "lost",
    )


def test_a_two_step_body_with_command_fields_or_a_hostile_run_is_refused(
    fake: FakeCloudflare, worker: Worker
) -> None:
    for fields in ({"env": {"A": "b"}}, {"files": {"a": "aGk="}}, {"workdir": "a"}):
        refused = worker.call("POST", "/v1/jobs", json=container("run_bad", **fields))
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request")
    assert fake.ledger.created == []
    worker.call("POST", "/v1/jobs", json=container("run_hostile"))
    for body in (
        {"timeout_s": 1},
        {"argv": ["true"]},
        {"argv": ["true"], "timeout_s": 1, "id": "run_x"},
        {"argv": ["true"], "timeout_s": 1, "files": {"../x": "aGk="}},
        {"argv": ["true"], "timeout_s": 1, "stdin": "not base64!"},
    ):
        refused = worker.call("POST", "/v1/jobs/run_hostile/run", json=body)
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request")
    assert fake.ledger.commands == []


# --- output ----------------------------------------------------------------------------------


def test_output_streams_as_ndjson_and_a_cut_stream_resumes(
    fake: FakeCloudflare, worker: Worker
) -> None:
    fake.faults.cut_stream = True
    argv = ["sh", "-c", "echo one; sleep 0.3; echo two >&2; exit 4"]
    worker.call("POST", "/v1/jobs", json=job("run_stream", argv=argv))
    cut = worker.events("run_stream")
    assert cut == [{"seq": 1, "type": "stdout", "data": "one\n"}]
    fake.faults.cut_stream = False
    rest = worker.events("run_stream", after=1)
    assert rest[0] == {"seq": 2, "type": "stderr", "data": "two\n"}
    assert rest[-1]["type"] == "end" and (rest[-1]["state"], rest[-1]["exit_code"]) == ("exited", 4)


def test_a_quiet_stream_sends_pings(fake: FakeCloudflare, worker: Worker) -> None:
    fake.world.heartbeat_s = 0.1
    worker.call("POST", "/v1/jobs", json=job("run_quiet", argv=["sleep", "1"]))
    lines = worker.events("run_quiet")
    assert {"type": "ping"} in lines and lines[-1]["type"] == "end"


def test_output_past_the_limit_is_dropped_and_flagged() -> None:
    with running_fake(output_limit_bytes=1024) as fake, Worker(fake) as worker:
        worker.call(
            "POST", "/v1/jobs", json=job("run_flood", argv=["head", "-c", "5000", "/dev/zero"])
        )
        done = worker.finished("run_flood")
        assert len(done["stdout"]) == 1024
        assert (done["stdout_truncated"], done["stderr_truncated"]) == (True, False)


# --- what a job may ask for -----------------------------------------------------------------


def test_a_size_gets_the_smallest_instance_type_that_holds_it(worker: Worker) -> None:
    sizes: list[tuple[dict[str, float] | None, str]] = [
        (None, "lite"),
        ({"cpu": 0.25, "memory_mb": 512, "disk_mb": 1024}, "basic"),
        ({"cpu": 1, "memory_mb": 1024, "disk_mb": 1024}, "standard-2"),
        ({"cpu": 2, "memory_mb": 4096, "disk_mb": 4096}, "standard-3"),
        ({"cpu": 4, "memory_mb": 8192, "disk_mb": 8192}, "standard-4"),
    ]
    for number, (size, instance_type) in enumerate(sizes):
        created = worker.call("POST", "/v1/jobs", json=job(f"run_size_{number}", size=size))
        assert created.json()["instance_type"] == instance_type, size


def test_a_size_no_deployed_instance_type_holds_is_refused() -> None:
    with running_fake(deployed=("lite", "basic")) as fake, Worker(fake) as worker:
        for size in [
            {"cpu": 1, "memory_mb": 1024, "disk_mb": 1024},
            {"cpu": 8, "memory_mb": 1, "disk_mb": 1},
        ]:
            refused = worker.call("POST", "/v1/jobs", json=job("run_big", size=size))
            assert (refused.status_code, refused.json()["error"]["code"]) == (
                422,
                "size_unsupported",
            )
        assert fake.ledger.created == []


def test_egress_is_off_by_default_and_what_cannot_be_enforced_is_refused(
    fake: FakeCloudflare, worker: Worker
) -> None:
    count_interfaces = ["sh", "-c", "tail -n +3 /proc/net/dev | wc -l"]
    worker.call("POST", "/v1/jobs", json=job("run_offline", argv=count_interfaces))
    if bwrap() is not None:  # a private network namespace: the loopback only
        assert worker.finished("run_offline")["stdout"].strip() == "1"
    hosts = ["api.example.com", "*.example.org", "93.184.216.34"]
    worker.call("POST", "/v1/jobs", json=job("run_hosts", egress=hosts))
    assert fake.ledger.create_of("run_hosts")["egress"] == hosts  # type: ignore[index]
    for host in ["10.0.0.0/8", "[2001:db8::1]", "example.com:8443"]:
        refused = worker.call("POST", "/v1/jobs", json=job("run_cidr", egress=[host]))
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "egress_unsupported")
    assert fake.ledger.create_of("run_cidr") is None


# --- auth and hostile input -----------------------------------------------------------------


def test_a_worker_that_skips_its_key_answers_anyone() -> None:
    """The mode the relay must refuse (relay/providers/cloudflare.py): Cloudflare's Sandbox
    Bridge with its key unset answers every request, with or without a key."""
    with running_fake(key=None, open_auth=True) as open_worker:
        for key in (None, BAD_KEY):
            with Worker(open_worker, key) as worker:
                assert worker.call("GET", "/v1/jobs").status_code == 200


def test_auth_fails_closed() -> None:
    with running_fake(key=None) as unset:
        for key in (None, KEY, BAD_KEY):
            with Worker(unset, key) as worker:
                refused = worker.call("POST", "/v1/jobs", json=job("run_a"))
            assert refused.status_code == 403
            assert refused.json()["error"]["code"] == "key_not_configured"
        assert unset.ledger.created == []
    with running_fake() as fake:
        for key in (None, BAD_KEY, KEY[:-1]):
            with Worker(fake, key) as worker:
                assert worker.call("GET", "/v1/jobs").status_code == 401
        with Worker(fake, None) as worker:
            assert worker.call("GET", "/v1/jobs", params={"key": KEY}).status_code == 401
        with Worker(fake) as worker:
            assert worker.call("GET", "/v1/jobs").status_code == 200


HOSTILE: list[tuple[bytes, str]] = [
    (b"{id: run", "invalid_body"),
    (b"[1, 2]", "invalid_body"),
    (b"\xff\xfe", "invalid_body"),
    (json.dumps(job("run_x", image="ubuntu")).encode(), "invalid_request"),
    (json.dumps(job("run_x", argv="echo hi")).encode(), "invalid_request"),
    (json.dumps(job("RUN_UPPER")).encode(), "invalid_request"),
    (json.dumps(job("admin")).encode(), "invalid_request"),
    (json.dumps(job("run_x", timeout_s=0)).encode(), "invalid_request"),
    (json.dumps(job("run_x", files={"../escape": "aGk="})).encode(), "invalid_request"),
    (json.dumps(job("run_x", files={"/etc/passwd": "aGk="})).encode(), "invalid_request"),
    (json.dumps(job("run_x", workdir="a/../../b")).encode(), "invalid_request"),
    (json.dumps(job("run_x", argv=["a\x00b"])).encode(), "invalid_request"),
    (json.dumps(job("run_x", stdin="not base64!")).encode(), "invalid_request"),
    (json.dumps(job("run_x", files={"a": "aGk=", "a/b": "aGk="})).encode(), "invalid_request"),
]


def test_a_hostile_body_is_refused(fake: FakeCloudflare, worker: Worker) -> None:
    for content, code in HOSTILE:
        answer = worker.call("POST", "/v1/jobs", content=content)
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, code), content
        assert BODY_MARKER in answer.json()["error"]["message"]
    assert fake.ledger.created == []


def test_a_huge_body_and_bad_ids_or_queries_are_refused(
    fake: FakeCloudflare, worker: Worker
) -> None:
    huge = worker.call("POST", "/v1/jobs", content=b"x" * (16 * 1024 * 1024 + 1))
    assert (huge.status_code, huge.json()["error"]["code"]) == (413, "body_too_large")
    for path in ["/v1/jobs/RUN_UPPER", "/v1/jobs/..%2F..%2Fx", "/v1/jobs/a%00b/events"]:
        answer = worker.call("GET", path)
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_id"), path
    for query in ["limit=0", "limit=1001", "tag=novalue", "cursor=UP"]:
        assert worker.call("GET", f"/v1/jobs?{query}").status_code == 400, query
    assert fake.ledger.created == []


# --- fault switches --------------------------------------------------------------------------


def test_create_status_answers_it_and_records_nothing(fake: FakeCloudflare, worker: Worker) -> None:
    for status in (500, 503, 429, 401):
        fake.faults.create_status = status
        answer = worker.client.post("/v1/jobs", json=job("run_fault"))
        assert answer.status_code == status
        assert (answer.headers.get("retry-after") == "7") is (status == 429)
        assert BODY_MARKER in answer.json()["error"]["message"]
    assert fake.ledger.created == []


def test_a_create_that_allocates_then_fails_leaves_the_job_running(
    fake: FakeCloudflare, worker: Worker
) -> None:
    fake.faults.create_allocates_then_fails = True
    answer = worker.call("POST", "/v1/jobs", json=job("run_half", argv=["sleep", "30"]))
    assert answer.status_code == 500
    assert fake.ledger.alive() == {"run_half"}
    fake.reset()
    assert (
        worker.call("POST", "/v1/jobs", json=job("run_half", argv=["sleep", "30"])).status_code
        == 200
    )


def test_a_hanging_create_records_the_job_and_answers_once_released(
    fake: FakeCloudflare, worker: Worker
) -> None:
    fake.faults.create_hang = True
    with pytest.raises(httpx.ReadTimeout):
        worker.client.post("/v1/jobs", json=job("run_hang", argv=["sleep", "30"]), timeout=0.5)
    assert fake.ledger.alive() == {"run_hang"}
    fake.reset()
    assert worker.call("DELETE", "/v1/jobs/run_hang").status_code == 200
    assert fake.ledger.alive() == set()


def test_a_job_lost_under_its_command_is_reported_and_destroyed(
    fake: FakeCloudflare, worker: Worker
) -> None:
    fake.faults.vanish_after_s = 0.2
    worker.call("POST", "/v1/jobs", json=job("run_vanish", argv=["sleep", "30"]))
    done = worker.finished("run_vanish", seconds=3)
    assert (done["state"], done["destroyed_by"], done["error"]["code"]) == ("lost", "lost", "lost")
    worker.call("POST", "/v1/jobs", json=job("run_gone", argv=["sleep", "30"]))
    fake.call("vanish", "run_gone")
    assert worker.job("run_gone")["state"] == "lost" and fake.ledger.alive() == set()


def test_list_status_answers_it(fake: FakeCloudflare, worker: Worker) -> None:
    fake.faults.list_status = 503
    assert worker.client.get("/v1/jobs").status_code == 503
