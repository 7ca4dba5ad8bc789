"""GET /v1/runs/{id}/events: a running job's output arrives as it is printed, in order,
from the start for a caller that connects late, and the stream closes with the final run."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.http import run_stream
from relay.http.run_stream import LiveRuns, follow_run
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.relay_server import RelayProcess
from testing.rows import run_row
from tests.conftest import REPO, make_settings

SLOW = [
    "sh",
    "-c",
    "echo one; sleep 2; echo two $(date +%s.%N) >&2; sleep 0.5; seq 1 300; echo three",
]
"""Its stderr line says when the job printed it, by the host's clock (a sandbox has no
clock of its own): output that arrived before that arrived while the job ran."""
EXPECTED_STDOUT = "one\n" + "".join(f"{i}\n" for i in range(1, 301)) + "three\n"


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("events"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.add_token("other", command=True)
    server.start()
    yield server
    server.stop()


def start(relay: RelayProcess, command: list[str]) -> str:
    answer = relay.post(relay.tokens["ops"], {"command": command, "wait": False})
    assert answer.status_code == 202, answer.text
    run_id: str = answer.json()["id"]
    return run_id


class Follower:
    """Reads the events of one run in a thread, stamping each line as it arrives (Unix
    seconds, to compare with what a job prints of the time)."""

    def __init__(self, relay: RelayProcess, run_id: str, who: str = "ops") -> None:
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.status: int | None = None
        self.content_type = ""
        self.closed = threading.Event()
        self.got_line = threading.Condition()
        url = f"{relay.url}/v1/runs/{run_id}/events"
        headers = relay.headers(relay.tokens[who])
        self._thread = threading.Thread(target=self._read, args=(url, headers), daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with httpx.stream("GET", url, headers=headers, timeout=30) as answer:
                self.status = answer.status_code
                self.content_type = answer.headers.get("content-type", "")
                for raw in answer.iter_lines():
                    with self.got_line:
                        self.lines.append((time.time(), json.loads(raw)))
                        self.got_line.notify_all()
        finally:
            self.closed.set()
            with self.got_line:
                self.got_line.notify_all()

    def wait_for_text(self, text: str, timeout_s: float = 20) -> float:
        """When the output ``text`` arrived."""
        deadline = time.monotonic() + timeout_s
        with self.got_line:
            while True:
                for at, line in self.lines:
                    if line["event"] == "output" and text in line["text"]:
                        return at
                if self.closed.is_set() or time.monotonic() > deadline:
                    raise AssertionError(f"{text!r} never arrived: {self.lines}")
                self.got_line.wait(0.1)

    def finish(self, timeout_s: float = 30) -> list[dict[str, Any]]:
        assert self.closed.wait(timeout_s), "the stream did not close"
        return [line for _, line in self.lines]


def output(lines: list[dict[str, Any]], stream: str) -> str:
    return "".join(
        line["text"] for line in lines if line["event"] == "output" and line["stream"] == stream
    )


@pytest.mark.slow  # needs a relay process: seconds
def test_output_arrives_while_the_job_runs_and_the_stream_ends_with_the_run(
    relay: RelayProcess,
) -> None:
    run_id = start(relay, SLOW)
    follower = Follower(relay, run_id)
    first = follower.wait_for_text("one")
    during = relay.get(relay.tokens["ops"], f"/v1/runs/{run_id}").json()
    assert during["state"] == "running"  # the job had not ended when "one" arrived
    late = Follower(relay, run_id)  # connects after output began: still gets it all
    lines = follower.finish()
    assert follower.status == 200 and follower.content_type.startswith("application/x-ndjson")
    assert output(lines, "stdout") == EXPECTED_STDOUT
    printed = re.fullmatch(r"two (\d+\.\d+)\n", output(lines, "stderr"))
    assert printed is not None, output(lines, "stderr")
    # Against the job's own clock, not a margin between two deliveries (either may come
    # late on a loaded host): "one" arrived before the job printed its next line.
    assert first < float(printed[1]), "output must arrive as printed, not at the end"
    kinds = [line["event"] for line in lines]
    assert kinds[-1] == "run" and kinds.count("run") == 1
    assert "state" in kinds and kinds.index("state") < kinds.index("output")
    final = lines[-1]["run"]
    assert final["id"] == run_id and final["state"] == "succeeded" and final["exit_code"] == 0
    assert final["stdout"] == EXPECTED_STDOUT
    order = [line["text"] for line in lines if line["event"] == "output"]
    assert order.index(next(t for t in order if "two" in t)) < order.index(
        next(t for t in order if "three" in t)
    )
    late_lines = late.finish()
    assert output(late_lines, "stdout") == EXPECTED_STDOUT
    assert late_lines[-1]["run"] == final


@pytest.mark.slow  # needs a relay process: seconds
def test_a_caller_arriving_after_the_end_gets_the_output_and_the_run(
    relay: RelayProcess,
) -> None:
    run = relay.post(relay.tokens["ops"], {"command": ["sh", "-c", "echo out; echo err >&2"]})
    lines = Follower(relay, run.json()["id"]).finish()
    assert output(lines, "stdout") == "out\n" and output(lines, "stderr") == "err\n"
    assert lines[-1]["event"] == "run" and lines[-1]["run"]["state"] == "succeeded"


@pytest.mark.slow  # needs a relay process: seconds
def test_a_canceled_run_ends_its_stream_canceled(relay: RelayProcess) -> None:
    run_id = start(relay, ["sh", "-c", "echo started; sleep 30"])
    follower = Follower(relay, run_id)
    follower.wait_for_text("started")
    assert relay.delete(relay.tokens["ops"], f"/v1/runs/{run_id}").status_code == 200
    lines = follower.finish(timeout_s=15)
    assert lines[-1]["run"]["state"] == "canceled"


@pytest.mark.slow  # needs a relay process: seconds
def test_another_tokens_run_is_not_found(relay: RelayProcess) -> None:
    run_id = start(relay, ["true"])
    follower = Follower(relay, run_id, who="other")
    follower.finish()
    assert follower.status == 404
    unknown = relay.get(relay.tokens["ops"], "/v1/runs/run_nope/events")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def following(
    live: LiveRuns, service: RunService, run: RunRecord
) -> tuple[asyncio.Task[None], list[dict[str, Any]]]:
    """A task reading the run's event stream, and the lines it has read so far."""
    lines: list[dict[str, Any]] = []

    async def read() -> None:
        async for chunk in follow_run(live, service, run):
            lines.append(json.loads(chunk))

    return asyncio.create_task(read()), lines


async def test_on_another_replica_the_stream_polls_the_store(tmp_path: Path) -> None:
    """No task here and no buffer: state from the store, output when the run ends."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        service = RunService(make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {})
        row = run_row("run_elsewhere", job=None)
        await store.admit_run(row)
        live = LiveRuns(EventBus())
        reader, lines = following(live, service, row)
        await asyncio.sleep(0.2)
        assert lines == [{"event": "state", "state": "running"}]
        await store.update_run("run_elsewhere", state="failed", exit_code=3, stdout="x\n")
        await asyncio.wait_for(reader, 5)
        assert lines[1] == {"event": "output", "stream": "stdout", "text": "x\n"}
        assert lines[2]["run"]["state"] == "failed" and len(lines) == 3
    finally:
        await store.close()


async def test_a_followed_run_the_reaper_marks_lost_ends_its_stream(tmp_path: Path) -> None:
    """A stream reading this replica's buffer of a run (its start went through this
    replica's event bus) that no task here holds any more: the reaper's ``lost`` ends it."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        events = EventBus()
        service = RunService(
            make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {}, events=events
        )
        reaper = Reaper(
            store,
            {},
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=events,
            grace_s=30,
            single_replica=True,
        )
        live = LiveRuns(events)
        row = run_row("run_reaped", job=None, owner="a-relay-that-died")
        await store.admit_run(row)
        events.publish(RunEvent("run_reaped", "state", state="running"))
        reader, lines = following(live, service, row)
        await asyncio.sleep(0.2)
        assert lines == [{"event": "state", "state": "running"}]
        assert (await reaper.sweep()).lost_runs == ["run_reaped"]
        await asyncio.wait_for(reader, 5)  # well before the first ping (15 s)
        assert lines[-1]["event"] == "run" and lines[-1]["run"]["state"] == "lost"
        assert lines[-1]["run"]["error"]["code"] == "sandbox_lost" and len(lines) == 2
        live.close()
    finally:
        await store.close()


async def test_a_stream_whose_end_never_reaches_its_buffer_closes_after_a_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer made for a run this replica holds, just as it ended (its ``finished``
    event already passed): the stream ends once the stored run is long over."""
    monkeypatch.setattr(run_stream, "CHECK_S", 0.2)
    monkeypatch.setattr(run_stream, "END_GRACE_S", 0.5)
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        service = RunService(make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {})
        row = run_row("run_missed", job=None)
        await store.admit_run(row)
        await store.update_run("run_missed", state="succeeded", ended_at=time.time())
        service.runner.hold("run_missed")  # held here
        events = EventBus()
        live_runs = LiveRuns(events)
        reader, lines = following(live_runs, service, row)
        await asyncio.wait_for(reader, 3)
        assert [line["event"] for line in lines] == ["run"]
        assert lines[0]["run"]["state"] == "succeeded"
        live_runs.close()
    finally:
        service.runner.release("run_missed")
        await store.close()


async def test_a_held_runs_stream_outlasts_a_store_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is away while a run this replica holds streams (PostgreSQL stopped): the
    stream keeps following (pings, then the end) instead of breaking off mid-body."""
    monkeypatch.setattr(run_stream, "CHECK_S", 0.2)
    monkeypatch.setattr(run_stream, "END_GRACE_S", 0.5)
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    away = True
    get_run = store.get_run

    async def refusing(run_id: str) -> RunRecord | None:
        if away:
            raise ConnectionRefusedError(111, "Connection refused")
        return await get_run(run_id)

    try:
        service = RunService(make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {})
        row = run_row("run_outage", job=None)
        await store.admit_run(row)
        service.runner.hold("run_outage")  # running here
        live_runs = LiveRuns(EventBus())
        monkeypatch.setattr(store, "get_run", refusing)
        reader, lines = following(live_runs, service, row)
        await asyncio.sleep(0.7)  # several checks, each refused
        assert not reader.done()
        # The run ended meanwhile; the store is back.
        await store.update_run("run_outage", state="succeeded", ended_at=time.time() - 1)
        away = False
        await asyncio.wait_for(reader, 3)
        assert lines[-1]["event"] == "run" and lines[-1]["run"]["state"] == "succeeded"
        live_runs.close()
    finally:
        service.runner.release("run_outage")
        await store.close()


@pytest.mark.slow  # needs a relay process: seconds
def test_a_token_holds_at_most_its_streams(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path, max_streams_per_token=2, local_isolation="none")
    relay.add_token("ops", command=True)
    relay.add_token("other", command=True)
    relay.start()
    try:
        run_id = start(relay, ["sleep", "30"])
        followers = [Follower(relay, run_id) for _ in range(2)]
        deadline = time.monotonic() + 10
        while not all(f.status == 200 for f in followers) and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = relay.get(relay.tokens["ops"], f"/v1/runs/{run_id}/events")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_streams"
        assert "retry-after" in refused.headers
        other = start_as(relay, "other", ["sleep", "30"])
        with httpx.stream(
            "GET", f"{relay.url}/v1/runs/{other}/events",
            headers=relay.headers(relay.tokens["other"]), timeout=10,
        ) as answer:  # fmt: skip
            assert answer.status_code == 200  # the cap is per token
        relay.delete(relay.tokens["other"], f"/v1/runs/{other}")
        relay.delete(relay.tokens["ops"], f"/v1/runs/{run_id}")
        for follower in followers:
            assert follower.closed.wait(10)
        again = Follower(relay, run_id)  # the slots were given back
        assert again.closed.wait(10) and again.status == 200
    finally:
        relay.stop()


def start_as(relay: RelayProcess, who: str, command: list[str]) -> str:
    answer = relay.post(relay.tokens[who], {"command": command, "wait": False})
    assert answer.status_code == 202, answer.text
    run_id: str = answer.json()["id"]
    return run_id
