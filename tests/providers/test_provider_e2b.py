"""E2B provider through the real SDK against the fake: mapping, faults, ledger truth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers import e2b as e2b_module
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    OutputSink,
    Resources,
    SandboxSpec,
)
from relay.providers.e2b import E2BProvider
from testing.fakes.e2b import FakeE2B, running_fake
from testing.fakes.e2b.isolation import bwrap_works
from testing.relay_server import SECRET_CANARY, RelayProcess
from testing.rigs.e2b import settings_for

KEY = "test-key"
LIVE_KEY = os.environ.get("E2B_API_KEY")  # read at import: an autouse fixture clears E2B_*


@pytest.fixture
def fake() -> Iterator[FakeE2B]:
    with running_fake() as fake:
        yield fake


@pytest.fixture(autouse=True)
def no_sandbox_left(fake: FakeE2B) -> Iterator[None]:
    yield
    assert fake.ledger.alive() == set(), "a sandbox was left alive"


@pytest.fixture
def provider(fake: FakeE2B) -> E2BProvider:
    return E2BProvider(settings_for(fake))


def spec(run_id: str = "run_1", **kwargs: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "relay", "timeout_s": 10.0}
    values.update(kwargs)
    return SandboxSpec(**values)  # type: ignore[arg-type]


async def run(
    provider: E2BProvider, argv: list[str], *, stdin: bytes | None = None, **kwargs: object
) -> tuple[int | None, str, str]:
    output = OutputSink(1 << 16)
    async with provider.sandbox(spec(**kwargs)) as box:
        result = await box.exec(
            argv, stdin=stdin, env={"GREETING": "hi"}, workdir=None, timeout_s=10, output=output
        )
    return result.exit_code, output.text("stdout"), output.text("stderr")


# --- mapping ------------------------------------------------------------------------


async def test_create_carries_lifetime_tags_and_template_and_no_env(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    the_spec = spec(timeout_s=12.5, grace_s=30)
    async with provider.sandbox(the_spec) as box:
        created = fake.ledger.create_of(box.id)
    assert created is not None
    assert created["timeout"] == 43 == the_spec.lifetime_s
    assert created["metadata"] == {TAG_CLUSTER: "relay", TAG_RUN: "run_1"}
    assert created["template"] == "base"
    assert created["env_names"] == []  # a job's env goes with its command, never at create
    assert created["auto_pause"] is False  # killed at the hard deadline, never paused
    assert [sandbox_id for sandbox_id, _ in fake.ledger.terminated] == [box.id]


async def test_image_is_the_template(provider: E2BProvider, fake: FakeE2B) -> None:
    async with provider.sandbox(spec(image="my-python")) as box:
        assert fake.ledger.create_of(box.id)["template"] == "my-python"  # type: ignore[index]


@pytest.mark.parametrize(
    ("hosts", "internet", "network"),
    [
        ((), False, None),
        (("*",), True, None),
        (
            ("pypi.org", "*.github.com", "10.1.0.0/16"),
            None,
            {"allowOut": ["pypi.org", "*.github.com", "10.1.0.0/16"], "denyOut": ["0.0.0.0/0"]},
        ),
    ],
)
async def test_egress_mapping(
    provider: E2BProvider,
    fake: FakeE2B,
    hosts: tuple[str, ...],
    internet: bool | None,
    network: dict[str, list[str]] | None,
) -> None:
    async with provider.sandbox(spec(egress=Egress(hosts))) as box:
        created = fake.ledger.create_of(box.id)
    assert created is not None
    assert created["allow_internet_access"] == internet
    assert created["network"] == network


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"egress": Egress(("*", "pypi.org"))}, EgressUnsupported),
        ({"egress": Egress(("pypi.org:443",))}, EgressUnsupported),
        ({"egress": Egress(("https://pypi.org",))}, EgressUnsupported),
        ({"resources": Resources(cpu=4, memory_mb=8192)}, SizeUnsupported),
        ({"timeout_s": 90_000.0}, ValidationFailed),
        ({"pip": ("requests",)}, ValidationFailed),
    ],
)
async def test_refuses_what_it_cannot_enforce_before_creating(
    provider: E2BProvider, fake: FakeE2B, kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        provider.check(spec(**kwargs))  # the planner's call, once, before any sandbox
    assert fake.ledger.create_attempts == 0


def test_needs_an_api_key(fake: FakeE2B) -> None:
    with pytest.raises(ConfigError):
        E2BProvider(settings_for(fake, e2b_api_key=None))


# --- exec ----------------------------------------------------------------------------


async def test_exec_argv_stdin_env_workdir_and_exit_code(provider: E2BProvider) -> None:
    script = 'printf "%s|" "$1"; cat; pwd; echo "$GREETING"; echo oops >&2; exit 3'
    code, stdout, stderr = await run(
        provider, ["sh", "-c", script, "sh", "$(echo no); rm -rf /"], stdin=b"in\n"
    )
    assert code == 3
    lines = stdout.splitlines()
    assert lines[0] == "$(echo no); rm -rf /|in"
    assert lines[1] == "/workspace" if bwrap_works() else lines[1].endswith("/workspace")
    assert lines[2] == "hi"
    assert stderr == "oops\n"


async def test_upload_relative_and_absolute_paths(provider: E2BProvider) -> None:
    output = OutputSink(1024)
    async with provider.sandbox(spec()) as box:
        await box.upload({"in/data.txt": b"relative\n", "/tmp/abs.txt": b"absolute\n"})
        result = await box.exec(
            ["sh", "-c", "cat in/data.txt /tmp/abs.txt"],
            stdin=None,
            env={},
            workdir=None,
            timeout_s=10,
            output=output,
        )
    assert result.exit_code == 0
    assert output.text("stdout") == "relative\nabsolute\n"


async def test_only_the_given_env_reaches_the_job(
    provider: E2BProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_KEY", "leaked-env-key")
    monkeypatch.setenv("RELAY_SECRET_THING", "leaked")
    _code, stdout, _ = await run(provider, ["env"])
    assert "GREETING=hi" in stdout
    assert "leaked" not in stdout
    assert KEY not in stdout


async def test_credentials_and_urls_never_come_from_the_environment(
    fake: FakeE2B, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_KEY", "bad-key")
    monkeypatch.setenv("E2B_DEBUG", "true")  # would skip the control plane entirely
    monkeypatch.setenv("E2B_HTTP_VERSION", "0.9")  # the SDK would refuse every call
    provider = E2BProvider(settings_for(fake))
    code, _, _ = await run(provider, ["true"])
    assert code == 0
    assert len(fake.ledger.created) == 1


async def test_output_streams_before_the_command_ends(provider: E2BProvider) -> None:
    seen = anyio.Event()
    output = OutputSink(1024, listener=lambda stream, data: seen.set())
    async with provider.sandbox(spec()) as box:
        with anyio.move_on_after(8) as scope:
            async with anyio.create_task_group() as group:

                async def stop_on_first_output() -> None:
                    await seen.wait()
                    group.cancel_scope.cancel()

                group.start_soon(stop_on_first_output)
                await box.exec(
                    ["sh", "-c", "echo first; sleep 30"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=30,
                    output=output,
                )
    assert not scope.cancelled_caught
    assert output.text("stdout") == "first\n"


async def test_cancel_kills_the_command_and_the_sandbox_promptly(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    started = time.monotonic()
    async with provider.sandbox(spec()) as box:
        with anyio.move_on_after(0.5):
            await box.exec(
                ["sleep", "30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=30,
                output=OutputSink(9),
            )
    assert time.monotonic() - started < 4
    assert [(sid, sig) for sid, _pid, sig in fake.ledger.signals] == [(box.id, "SIGNAL_SIGKILL")]
    assert box.id in {sid for sid, _ in fake.ledger.terminated}


async def test_command_timeout_is_passed_on_and_enforced_by_envd(
    provider: E2BProvider, fake: FakeE2B, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Second line of defence only: with no slack the SDK/envd deadline fires first.
    monkeypatch.setattr(e2b_module, "TIMEOUT_MARGIN_S", 0.0)
    async with provider.sandbox(spec()) as box:
        with pytest.raises(ProviderTimeout):
            await box.exec(
                ["sleep", "30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=0.5,
                output=OutputSink(9),
            )
    assert fake.ledger.commands[-1]["timeout_ms"] == "500"


async def test_the_sandbox_dies_at_its_lifetime_without_the_relay(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    async with provider.sandbox(spec(timeout_s=0.2, grace_s=0.5)) as box:
        assert fake.ledger.create_of(box.id)["timeout"] == 1  # type: ignore[index]
        await anyio.sleep(1.5)
        assert box.id not in fake.ledger.alive()
        with pytest.raises(SandboxLost):
            await box.exec(
                ["true"], stdin=None, env={}, workdir=None, timeout_s=5, output=OutputSink(9)
            )
    assert [sid for sid, _ in fake.ledger.expired] == [box.id]


# --- listing and terminate -----------------------------------------------------------


async def test_list_owned_sees_only_this_cluster(provider: E2BProvider, fake: FakeE2B) -> None:
    other = E2BProvider(settings_for(fake, cluster="other"))
    async with (
        provider.sandbox(spec("run_a")) as mine,
        other.sandbox(SandboxSpec(run_id="run_b", cluster="other", timeout_s=5)),
    ):
        refs = await provider.list_owned()
    assert [(ref.sandbox_id, ref.run_id) for ref in refs] == [(mine.id, "run_a")]
    assert refs[0].created_at is not None


async def test_list_owned_reads_every_page(provider: E2BProvider, fake: FakeE2B) -> None:
    fake.world.page_size = 1
    async with (
        provider.sandbox(spec("run_a")) as a,
        provider.sandbox(spec("run_b")) as b,
        provider.sandbox(spec("run_c")) as c,
    ):
        refs = await provider.list_owned()
    assert sorted(ref.sandbox_id for ref in refs) == sorted([a.id, b.id, c.id])


async def test_a_create_whose_answer_was_lost_makes_one_sandbox(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    """The SDK retries a create that answered 502; without an idempotency key the retry
    makes a second sandbox, and the first runs on unseen until the reaper finds it."""
    fake.faults.create_answers_lost = 1
    async with provider.sandbox(spec("run_retried")) as box:
        assert fake.ledger.alive() == {box.id}
    assert [entry["sandbox_id"] for entry in fake.ledger.created] == [box.id]


async def test_terminate_is_idempotent(provider: E2BProvider) -> None:
    await provider.terminate("no-such-sandbox")
    async with provider.sandbox(spec()) as box:
        await provider.terminate(box.id)
    await provider.terminate(box.id)


# --- faults ------------------------------------------------------------------------


# The faults every provider shares (create errors, hangs, half-allocated creates, cut
# streams, vanished sandboxes, failed terminates) are in tests/contract/fault_suite.py.


async def test_rate_limited_create_is_retried_by_the_sdk_first(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    fake.faults.create_status = 429
    with pytest.raises(ProviderRateLimited) as caught:
        async with provider.sandbox(spec()):
            pass
    assert caught.value.retry_after == E2BProvider.retry_after_s  # the SDK hides it
    assert fake.ledger.create_attempts == 4  # the SDK retried, honouring Retry-After


async def test_unknown_template_is_named_in_the_error(provider: E2BProvider, fake: FakeE2B) -> None:
    with pytest.raises(ProviderError) as caught:
        async with provider.sandbox(spec(image="missing-template")):
            pass
    assert caught.value.code == "provider_error"
    assert "missing-template" in caught.value.message
    assert "not found" not in caught.value.message  # E2B's words stay out


async def test_dropped_connection_is_followed_again_to_the_end(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    fake.faults.drop_connection = True  # the server aborts the command stream mid-body
    output = OutputSink(1024)
    async with provider.sandbox(spec()) as box:
        result = await box.exec(
            ["sh", "-c", "echo part; sleep 0.5; echo rest; exit 5"],
            stdin=None,
            env={},
            workdir=None,
            timeout_s=30,
            output=output,
        )
    assert (result.exit_code, output.text("stdout")) == (5, "part\nrest\n")
    assert [sid for sid, _pid in fake.ledger.reconnects] == [box.id]


async def test_cut_stream_after_the_command_ended_is_unavailable(
    provider: E2BProvider, fake: FakeE2B
) -> None:
    # The stream broke at the very end: the process is gone, its exit status with it.
    fake.faults.cut_stream = True
    async with provider.sandbox(spec()) as box:
        with pytest.raises(ProviderUnavailable):
            await box.exec(
                ["true"], stdin=None, env={}, workdir=None, timeout_s=30, output=OutputSink(9)
            )
    assert box.id in {sid for sid, _ in fake.ledger.terminated}


# --- live ----------------------------------------------------------------------------


@pytest.mark.live
async def test_live_e2b() -> None:
    key = LIVE_KEY
    if not key:
        pytest.skip("E2B_API_KEY is not set; the live E2B test needs a real key")
    from relay.settings import Settings

    provider = E2BProvider(
        Settings(_env_file=None, providers=["e2b"], e2b_api_key=key, cluster="relay-live-test")
    )
    live_spec = SandboxSpec(run_id="run_live", cluster="relay-live-test", timeout_s=60)
    output = OutputSink(4096)
    async with provider.sandbox(live_spec) as box:
        await box.upload({"hello.txt": b"hello from relay\n"})
        result = await box.exec(
            ["cat", "hello.txt"], stdin=None, env={}, workdir=None, timeout_s=30, output=output
        )
        assert box.id in {ref.sandbox_id for ref in await provider.list_owned()}
    assert result.exit_code == 0
    assert output.text("stdout") == "hello from relay\n"
    assert box.id not in {ref.sandbox_id for ref in await provider.list_owned()}


async def test_fake_without_bubblewrap_still_maps_sandbox_paths(
    provider: E2BProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from testing.fakes.e2b import isolation

    monkeypatch.setattr(isolation, "bwrap_works", lambda: False)
    output = OutputSink(1024)
    async with provider.sandbox(spec()) as box:
        await box.upload({"/workspace/a.txt": b"mapped\n"})
        result = await box.exec(
            ["cat", "/workspace/a.txt"],
            stdin=None,
            env={},
            workdir=None,
            timeout_s=10,
            output=output,
        )
    assert (result.exit_code, output.text("stdout")) == (0, "mapped\n")


# --- end to end: a real relay process on E2B (the fake) ------------------------------


def _relay_on(fake: FakeE2B, root: Path) -> RelayProcess:
    return RelayProcess(
        root, providers="e2b", e2b_api_url=fake.url, e2b_sandbox_url=fake.url, reap_interval_s=1
    )


def _relay_run(relay: RelayProcess, token: str, job: str, *params: str) -> dict[str, Any]:
    env = {"PATH": os.environ["PATH"], "RELAY_URL": relay.url, "RELAY_TOKEN": token}
    done = subprocess.run(
        [sys.executable, "-m", "relay", "run", job, *params, "--json"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_relay_runs_every_example_job_on_e2b(fake: FakeE2B, tmp_path: Path) -> None:
    relay = _relay_on(fake, tmp_path / "relay")
    token = relay.add_token("e2e")
    relay.start()
    try:
        runs = {
            "echo": _relay_run(relay, token, "echo", "-p", "message=hi from e2b"),
            "http-status": _relay_run(relay, token, "http-status", "-p", f'urls:=["{fake.url}/"]'),
            "python": _relay_run(relay, token, "python"),
        }
    finally:
        relay.stop()
    for job, run in runs.items():
        assert (job, run["state"], run["provider"]) == (job, "succeeded", "e2b"), run
    assert runs["echo"]["stdout"] == "hi from e2b\n"
    assert runs["http-status"]["stdout"] == f"200 {fake.url}/\n"
    created = fake.ledger.created
    assert [c["metadata"][TAG_CLUSTER] for c in created] == ["e2e"] * 3
    assert {c["metadata"][TAG_RUN] for c in created} == {run["id"] for run in runs.values()}
    assert created[0]["allow_internet_access"] is False  # echo: egress []
    assert created[1]["allow_internet_access"] is True  # http-status: egress ["*"]
    assert {sid for sid, _ in fake.ledger.terminated} == {c["sandbox_id"] for c in created}
    assert SECRET_CANARY not in relay.log()
    assert all(SECRET_CANARY not in json.dumps(run) for run in runs.values())


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_a_relay_killed_mid_run_leaves_nothing_after_restart(fake: FakeE2B, tmp_path: Path) -> None:
    relay = _relay_on(fake, tmp_path / "relay")
    token = relay.add_token("e2e")
    relay.start()
    answer = relay.post(token, {"job": "sleep", "params": {"seconds": 60}, "wait": False})
    assert answer.status_code == 202
    deadline = time.monotonic() + 20
    while not fake.ledger.commands and time.monotonic() < deadline:
        time.sleep(0.05)
    relay.kill()  # SIGKILL: no finally runs; the sandbox is left running at E2B
    assert len(fake.ledger.alive()) == 1
    relay.start()  # the reaper's startup sweep finds it by its cluster tag
    try:
        deadline = time.monotonic() + 20
        while fake.ledger.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        run = relay.wait_final(token, answer.json()["id"])
    finally:
        relay.stop()
    assert fake.ledger.alive() == set()
    assert run["state"] == "lost"


@pytest.mark.slow  # a relay per fault, end to end (the contract suite covers each fault)
@pytest.mark.parametrize(
    ("fault", "value", "status", "code"),
    [
        ("create_status", 429, 503, "provider_rate_limited"),
        ("create_status", 500, 503, "provider_unavailable"),
        ("create_status", 401, 502, "provider_auth"),
        ("create_allocates_then_fails", True, 503, "provider_unavailable"),
        ("vanish_after_s", 0.5, 502, "sandbox_lost"),
        ("cut_stream", True, 200, None),  # followed again: the run still succeeds
        ("terminate_failures", 1, 200, None),  # the run succeeded; the reaper kills it
    ],
)
def test_relay_answers_each_e2b_fault_as_a_user_expects(
    fake: FakeE2B, tmp_path: Path, fault: str, value: object, status: int, code: str | None
) -> None:
    relay = _relay_on(fake, tmp_path / "relay")
    token = relay.add_token("e2e")
    relay.start()
    try:
        setattr(fake.faults, fault, value)
        answer = relay.post(token, {"job": "sleep", "params": {"seconds": 1}})
        fake.reset()
        deadline = time.monotonic() + 15
        while fake.ledger.alive() and time.monotonic() < deadline:
            time.sleep(0.1)  # a failed kill is retried by the reaper (every second here)
    finally:
        relay.stop()
    body = answer.json()
    assert answer.status_code == status, body
    if code is None:
        assert (body["state"], body["stdout"]) == ("succeeded", "sleeping\nwoke\n")
    else:
        assert body["error"]["code"] == code
        assert "injected" not in body["error"]["message"]
    if code == "provider_rate_limited":
        assert int(answer.headers["Retry-After"]) >= 1
    assert "injected" not in relay.log() and SECRET_CANARY not in relay.log()
