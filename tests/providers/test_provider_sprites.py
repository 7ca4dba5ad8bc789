"""The Sprites provider through the real ``sprites-py`` SDK, against the protocol fake.

Every test ends with zero sprites left in the fake's ledger (autouse fixture).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderTimeout,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
)
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    OutputSink,
    Resources,
    SandboxSpec,
)
from relay.providers.sprites import (
    LIMITS as SPRITES_LIMITS,
)
from relay.providers.sprites import (
    SpritesProvider,
    config_for,
    labels_for,
    network_policy_for,
    sprite_name,
    tags_of,
)
from relay.settings import Settings
from testing.fakes.sprites import BODY_MARKER, FakeSprites, running_fake
from testing.relay_server import SECRET_CANARY, RelayProcess
from testing.rigs.sprites import TOKEN, settings_for
from testing.sprites_faults import killed_relay


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeSprites]:
    with running_fake() as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left(fake: FakeSprites) -> Iterator[None]:
    fake.reset()
    yield
    fake.reset()
    alive = fake.ledger.alive()
    for name in alive:  # don't let one failure cascade into the next test
        fake.call("delete", name)
    assert alive == set(), f"sprites left behind: {alive}"


@pytest.fixture
async def provider(fake: FakeSprites) -> AsyncIterator[SpritesProvider]:
    sprites = SpritesProvider(settings_for(fake))
    yield sprites
    await sprites.aclose()


def spec(run_id: str = "run_test1", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "test", "timeout_s": 20.0}
    values.update(fields)
    return SandboxSpec(**values)  # type: ignore[arg-type]


# --- the mapping ----------------------------------------------------------------------


def test_egress_maps_to_domain_rules_or_is_refused() -> None:
    assert network_policy_for(("*",)) is None
    deny_all = network_policy_for(())
    assert deny_all is not None
    assert [(r.domain, r.action) for r in deny_all.rules] == [("*", "deny")]
    some = network_policy_for(("PyPI.org", "*.github.com"))
    assert some is not None
    # The docs' order: the allows first, then deny * (first match keeps it meaning this).
    assert [(r.domain, r.action) for r in some.rules] == [
        ("pypi.org", "allow"),
        ("*.github.com", "allow"),
        ("*", "deny"),
    ]
    for hosts in (("10.0.0.0/8",), ("1.2.3.4",), ("*", "pypi.org"), ("pypi.org:443",)):
        with pytest.raises(EgressUnsupported):
            network_policy_for(hosts)


def test_sizes_map_or_are_refused() -> None:
    config = config_for(spec(resources=Resources(cpu=1.5, memory_mb=3000, disk_mb=4097)))
    assert (config.cpus, config.ram_mb, config.storage_gb) == (2, 3000, 5)
    for size in (Resources(cpu=16), Resources(memory_mb=65536)):
        with pytest.raises(SizeUnsupported):
            config_for(spec(resources=size))


def test_names_and_labels_find_the_run_again() -> None:
    job = spec("run_ABC_0123456789xyz", timeout_s=20, grace_s=10)
    name = sprite_name(job)
    assert name.startswith("test-run-abc-01234") and len(name) <= 63
    # The run's own name: what a failed create left is found by it, without a listing.
    assert sprite_name(job) == name != sprite_name(spec("run_ABC_0123456789xyZ"))
    longest = spec("run_" + "f" * 27, cluster="c" * 40)
    assert len(sprite_name(longest)) <= 63
    tags = tags_of(labels_for(job))
    created = int(tags.pop("relay-created"))
    assert tags == {TAG_CLUSTER: "test", TAG_RUN: job.run_id, "relay-lifetime": "30"}
    assert abs(created - time.time()) < 5


def test_a_missing_token_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="RELAY_SPRITES_TOKEN"):
        SpritesProvider(Settings(_env_file=None, providers=["sprites"]))  # type: ignore[call-arg]


def test_the_provider_says_it_has_no_hard_lifetime() -> None:
    assert SPRITES_LIMITS["hard_lifetime"] is False and SPRITES_LIMITS["lifetime"] == "reaper"


# --- against the fake -------------------------------------------------------------------


async def test_a_run_creates_a_labelled_sized_sprite_and_deletes_it(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    job = spec(egress=Egress(("pypi.org",)), resources=Resources(cpu=2, memory_mb=2048))
    async with provider.sandbox(job) as box:
        await box.upload({"in.txt": b"from a file\n"})
        sink = OutputSink(1000)
        result = await box.exec(
            ["sh", "-c", 'cat in.txt; echo "$GREETING"; pwd; cat; exit 3'],
            stdin=b"piped\n",
            env={"GREETING": "hi"},
            workdir=None,
            timeout_s=10,
            output=sink,
        )
        policy = fake.world.sprites[box.id].policy
    assert result.exit_code == 3
    assert sink.text("stdout") == "from a file\nhi\n/workspace\npiped\n"
    entry = fake.ledger.create_of(box.id)
    assert entry is not None and entry["config"] == {"cpus": 2, "ram_mb": 2048, "storage_gb": 1}
    assert policy == [{"domain": "pypi.org", "action": "allow"}, {"domain": "*", "action": "deny"}]
    assert fake.ledger.tokens == {TOKEN}
    command = fake.ledger.commands[-1]
    # The job's argv is passed whole, after the wrapper's own: no shell parses it.
    assert command["argv"][-3:] == ["sh", "-c", 'cat in.txt; echo "$GREETING"; pwd; cat; exit 3']
    assert "timeout -s KILL 12 " in command["argv"][2]  # timeout_s + the margin
    assert command["argv"][4] == "/workspace"
    # The env went in a file, not in the exec's env (which would replace HOME, PATH…).
    assert command["argv"][5].startswith("/tmp/relay-exec-") and command["env_names"] == []
    assert box.id in {name for name, _ in fake.ledger.deleted}


async def test_a_jobs_env_keeps_the_sprites_default_environment(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """The docs: an exec's env replaces the default environment. The job must see the
    sprite's own HOME and PATH plus its variables, as on every other provider."""
    value = 'it\'s "quoted" $(id) `id` $HOME\nsecond line'
    async with provider.sandbox(spec()) as box:
        sink = OutputSink(4000)
        result = await box.exec(
            ["sh", "-c", 'echo "HOME=$HOME"; echo "PATH=$PATH"; printf %s "$ODD"; ls /tmp'],
            stdin=None,
            env={"ODD": value, "PLAIN": "x"},
            workdir=None,
            timeout_s=10,
            output=sink,
        )
    lines = sink.text("stdout").split("\n")
    assert result.exit_code == 0, sink.text("stderr")
    assert lines[0] == "HOME=/home/sprite" or lines[0].endswith("/home/sprite"), lines
    assert "/usr/bin" in lines[1].split("=", 1)[1].split(":")
    assert "\n".join(lines[2:4]) == value  # word for word: nothing expanded or run
    assert "relay-exec" not in sink.text("stdout")  # the variables' file is gone


async def test_an_allowed_host_is_reachable_and_another_is_not(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """The fake applies the policy first-match (its proxy checks each host): with the
    relay's rules, the allowed host answers and any other is refused."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = ("127.0.0.1", server.server_address[1])
    fake.world.hosts.update({"pypi.org": address, "example.com": address})
    script = (
        "import urllib.request, urllib.error\n"
        "for host in ('pypi.org', 'example.com'):\n"
        "    try:\n"
        "        code = urllib.request.urlopen(f'http://{host}/', timeout=5).status\n"
        "    except urllib.error.HTTPError as exc:\n"
        "        code = exc.code\n"
        "    print(host, code)\n"
    )
    try:
        async with provider.sandbox(spec(egress=Egress(("pypi.org",)))) as box:
            sink = OutputSink(1000)
            await box.exec(
                ["python3", "-c", script],
                stdin=None,
                env={"UNRELATED": "1"},
                workdir=None,
                timeout_s=20,
                output=sink,
            )
    finally:
        fake.world.hosts.clear()
        server.shutdown()
        server.server_close()
    assert sink.text("stdout") == "pypi.org 200\nexample.com 403\n", sink.text("stderr")
    assert [(host, allowed) for _, host, allowed in fake.ledger.egress[-2:]] == [
        ("pypi.org", True),
        ("example.com", False),
    ]


SWEPT_S = 15.0
"""How long the sweep after a failed create may take on a busy machine (it takes one delete)."""


async def test_a_late_create_answer_leaves_no_sprite(fake: FakeSprites) -> None:
    """The sprite exists, the answer comes after the relay gave up: swept by its name,
    beside serving (relay/providers/aftercare.py), as the caller has its answer."""
    impatient = SpritesProvider(settings_for(fake, create_timeout_s=0.5))
    fake.faults.create_delay_s = 3.0
    try:
        with pytest.raises(ProviderTimeout):
            async with impatient.sandbox(spec("run_late")):
                pytest.fail("no sandbox should be yielded")
        [sweep] = impatient.aftercare.tasks
        await asyncio.wait_for(asyncio.shield(sweep), SWEPT_S)
        assert sweep.exception() is None
    finally:
        await impatient.aftercare.finish()  # as a closing relay does, before the client goes
        await impatient.aclose()
    assert len(fake.ledger.created) >= 1 and fake.ledger.alive() == set()


async def test_a_failing_policy_call_leaves_no_sprite(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """The sprite was made; setting its network policy failed: the run fails, and the
    sprite (open network, no lifetime) is deleted at once."""
    fake.faults.policy_status = 500
    with pytest.raises(ProviderUnavailable):
        async with provider.sandbox(spec("run_policy")):
            pytest.fail("no sandbox should be yielded")
    [entry] = [e for e in fake.ledger.created if e["labels"][1] == f"{TAG_RUN}=run_policy"]
    assert entry["name"] not in fake.ledger.alive() and fake.ledger.alive() == set()


async def test_list_owned_reads_each_sprite_and_pages_as_documented(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """List items carry no labels (the docs): each sprite under the prefix is read for
    them, over pages of at most 50; another cluster's and unlabelled sprites are left out."""
    ours = {f"test-run-{n:03d}-abcdef": f"run_{n:03d}" for n in range(53)}
    for name, run_id in ours.items():
        labels = [f"{TAG_CLUSTER}=test", f"{TAG_RUN}={run_id}", "relay-created=1"]
        fake.call("allocate", {"name": name, "labels": labels})
    fake.call("allocate", {"name": "test-2-run-x-abcdef", "labels": [f"{TAG_CLUSTER}=test-2"]})
    fake.call("allocate", {"name": "test-by-hand"})
    try:
        owned = {ref.sandbox_id: ref.run_id for ref in await provider.list_owned()}
    finally:
        for name in fake.ledger.alive():
            fake.call("delete", name)
    assert owned == ours
    assert fake.ledger.list_sizes and all(1 <= size <= 50 for size in fake.ledger.list_sizes)


async def test_no_egress_means_no_network_in_the_fake(provider: SpritesProvider) -> None:
    async with provider.sandbox(spec()) as box:
        sink = OutputSink(1000)
        await box.exec(
            ["cat", "/proc/net/dev"], stdin=None, env={}, workdir=None, timeout_s=10, output=sink
        )
    interfaces = {line.split(":")[0].strip() for line in sink.text("stdout").splitlines()[2:]}
    assert interfaces <= {"lo"}


async def test_a_sprite_deleted_under_a_command_is_sandbox_lost(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    with pytest.raises(SandboxLost):
        async with provider.sandbox(spec()) as box:
            fake.call("delete", box.id)
            await box.exec(
                ["sleep", "5"], stdin=None, env={}, workdir=None, timeout_s=10, output=OutputSink(9)
            )


async def test_the_in_sprite_timeout_kills_a_command_the_relay_forgot(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """No provider-side lifetime: a command whose relay let go (its socket closed, as
    when the relay is killed) is ended by the in-sprite ``timeout -s KILL``."""
    async with provider.sandbox(spec()) as box:
        with anyio.move_on_after(0.5):
            await box.exec(
                ["sleep", "30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=0.1,
                output=OutputSink(9),
            )
        [session] = fake.world.sprites[box.id].sessions.values()
        started = time.monotonic()
        while session.exit_code is None and time.monotonic() - started < 8:
            await anyio.sleep(0.05)
    assert session.exit_code == 137  # SIGKILL, at timeout_s + the margin (3 s), not 30 s
    assert time.monotonic() - started < 4


async def test_list_owned_keeps_to_its_cluster(fake: FakeSprites) -> None:
    mine = SpritesProvider(settings_for(fake))
    other = SpritesProvider(settings_for(fake, cluster="test-2"))
    try:
        async with (
            other.sandbox(spec(cluster="test-2")) as theirs,
            mine.sandbox(spec("run_mine")) as box,
        ):
            owned = {ref.sandbox_id: ref.run_id for ref in await mine.list_owned()}
        assert owned == {box.id: "run_mine"} and theirs.id not in owned
    finally:
        await mine.aclose()
        await other.aclose()


async def test_a_sprite_listed_without_created_at_still_has_an_age(
    fake: FakeSprites, provider: SpritesProvider
) -> None:
    """Without an age, the reaper leaves a sprite of no known run alone, and nothing else
    ever deletes a sprite: the relay's own label stands in for the optional created_at."""
    fake.faults.created_at_missing = True
    before = time.time()
    async with provider.sandbox(spec("run_ageless")) as box:
        [ref] = [ref for ref in await provider.list_owned() if ref.sandbox_id == box.id]
    assert ref.created_at is not None
    assert before - 1 <= ref.created_at.timestamp() <= time.time()


# --- live --------------------------------------------------------------------------------

# Read before the autouse fixture in tests/conftest.py clears RELAY_* from the environment.
LIVE_TOKEN = os.environ.get("RELAY_SPRITES_TOKEN")


@pytest.mark.live
@pytest.mark.skipif(not LIVE_TOKEN, reason="needs RELAY_SPRITES_TOKEN")
async def test_live_tiny_contract() -> None:
    settings = Settings(_env_file=None, cluster="relay-live-test", sprites_token=LIVE_TOKEN)  # type: ignore[call-arg]
    sprites = SpritesProvider(settings)
    try:
        job = spec(
            run_id="run_live", timeout_s=60.0, cluster="relay-live-test", egress=Egress(("*",))
        )
        async with sprites.sandbox(job) as box:
            await box.upload({"hello.txt": b"hi\n"})
            sink = OutputSink(1000)
            result = await box.exec(
                ["sh", "-c", "cat hello.txt; echo $X"],
                stdin=None,
                env={"X": "y"},
                workdir=None,
                timeout_s=60,
                output=sink,
            )
            assert (result.exit_code, sink.text("stdout")) == (0, "hi\ny\n")
            assert box.id in {ref.sandbox_id for ref in await sprites.list_owned()}
        assert box.id not in {ref.sandbox_id for ref in await sprites.list_owned()}
    finally:
        await sprites.aclose()


# --- end to end: a real relay process with RELAY_PROVIDERS=sprites against the fake -------


def relay_on_fake(fake: FakeSprites, root: Path) -> RelayProcess:
    return RelayProcess(
        root,
        providers="sprites",
        sprites_base_url=fake.url,
        sprites_token=SECRET_CANARY,
        max_wait_s=20,
        log_level="debug",  # the SDK's and websockets' own lines too: no env value in them
    )


@pytest.fixture(scope="module")
def sprites_relay(
    fake: FakeSprites, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayProcess]:
    server = relay_on_fake(fake, tmp_path_factory.mktemp("sprites-relay"))
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log() and BODY_MARKER not in server.log()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_every_example_job_runs_on_sprites(
    fake: FakeSprites, sprites_relay: RelayProcess
) -> None:
    token = sprites_relay.tokens["ops"]
    echo = sprites_relay.post(token, {"job": "echo", "params": {"message": "hi; $(id)"}}).json()
    assert (echo["state"], echo["stdout"], echo["provider"]) == (
        "succeeded",
        "hi; $(id)\n",
        "sprites",
    ), echo
    assert fake.ledger.create_of(echo["sandbox_id"]) is not None

    snippet = "import json; print(json.load(open('params.json'))['label'])"
    python = sprites_relay.post(token, {"job": "python", "stdin": snippet}).json()
    assert (python["state"], python["stdout"]) == ("succeeded", "snippet\n"), python

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        body = {"job": "http-status", "params": {"urls": [url]}}
        status = sprites_relay.post(token, body).json()
    finally:
        server.shutdown()
        server.server_close()
    assert (status["state"], status["stdout"]) == ("succeeded", f"200 {url}\n"), status
    assert fake.ledger.tokens >= {SECRET_CANARY}
    assert fake.ledger.alive() == set()

    providers = sprites_relay.get(token, "/v1/providers").json()["providers"]
    assert providers == [
        {"name": "sprites", "enabled": True, "isolation": None, "limits": SPRITES_LIMITS}
    ]


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_a_jobs_env_reaches_it_and_no_log_line(
    fake: FakeSprites, sprites_relay: RelayProcess
) -> None:
    """A job's variables join the sprite's default environment; their values travel in
    a file-write body, so no URL and no line the relay logs (at debug) carries them."""
    token = sprites_relay.tokens["ops"]
    value = "env-value-canary-41d7"
    request = {
        "command": ["sh", "-c", 'echo "HOME=$HOME"; echo "$SECRET_VALUE"'],
        "env": {"SECRET_VALUE": value},
    }
    run = sprites_relay.post(token, request).json()
    assert (run["state"], run["stdout"]) == ("succeeded", f"HOME=/home/sprite\n{value}\n"), run
    assert [c["env_names"] for c in fake.ledger.commands if c["sprite"] == run["sandbox_id"]] == [
        []
    ]
    log = sprites_relay.log()
    assert run["id"] in log  # the lines about this run are there…
    assert value not in log  # …and the value in none of them


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_timeout_and_provider_faults(fake: FakeSprites, sprites_relay: RelayProcess) -> None:
    token = sprites_relay.tokens["ops"]
    slow = {"command": ["sh", "-c", "echo begun; sleep 60"], "timeout_s": 1}
    run = sprites_relay.post(token, slow).json()
    assert (run["state"], run["stdout"]) == ("timed_out", "begun\n"), run
    assert fake.ledger.alive() == set()

    echo = {"job": "echo", "params": {"message": "x"}}
    for fault, value, status, code in [
        ("create_status", 500, 503, "provider_unavailable"),
        ("create_status", 429, 503, "provider_rate_limited"),
        ("create_status", 401, 502, "provider_auth"),
        ("vanish_after_s", 0.8, 502, "sandbox_lost"),
        ("policy_status", 500, 503, "provider_unavailable"),
    ]:
        fake.faults.reset()
        setattr(fake.faults, fault, value)
        request = echo if fault == "create_status" else {"command": ["sleep", "30"]}
        answer = sprites_relay.post(token, request)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (status, code), answer.text
        assert BODY_MARKER not in answer.text and SECRET_CANARY not in answer.text
        assert fake.ledger.alive() == set()


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_e2e_a_killed_relay_leaves_sprites_the_next_one_reaps(
    fake: FakeSprites, tmp_path: Path
) -> None:
    """kill -9 while one run's command runs (the store knows its sprite) and another run's
    create is under way (only a listing finds that sprite): nothing on Fly's side would ever
    delete either; the next relay's reaper ends both, and both runs read lost."""
    report = killed_relay(fake, tmp_path)
    assert report.created == 2 and report.runs == 2
    assert report.ok, (report.leaked, report.not_final)


def reap(relay: RelayProcess, *flags: str) -> subprocess.CompletedProcess[str]:
    """``relay reap`` from cron, with the relay's own settings."""
    return subprocess.run(
        [sys.executable, "-m", "relay", "reap", *flags],
        cwd=relay.root, env=relay.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_relay_reap_says_what_it_waits_for_and_now_ends_it_at_once(
    fake: FakeSprites, tmp_path: Path
) -> None:
    """Right after a kill -9 the dead relay's heartbeat is fresh: `relay reap` leaves its
    run and says until when; `relay reap --now` (the operator knows it is dead) ends both."""
    first = relay_on_fake(fake, tmp_path / "relay")
    token = first.add_token("ops", command=True)
    first.start()
    try:
        answer = first.post(token, {"command": ["sleep", "60"], "wait": False})
        run_id = answer.json()["id"]
        deadline = time.monotonic() + 20
        while not fake.ledger.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        first.kill()
    [sprite] = fake.ledger.alive()
    waiting = reap(first)
    assert waiting.returncode == 0, waiting.stderr
    lines = waiting.stdout.splitlines()
    assert lines[0] == "found 1 active run(s); sandboxes listed: sprites 1", lines
    prefix = f"left for now: run {run_id} (sprites sandbox {sprite}): "
    [left] = [line for line in lines if line.startswith(prefix)]
    assert "last heartbeat was" in left and re.search(r"\(until \S+Z, in \d+ s\)$", left), left
    assert lines[-1] == "if you know no relay runs on this database: relay reap --now"
    assert fake.ledger.alive() == {sprite}
    now = reap(first, "--now")
    assert now.returncode == 0, now.stderr
    assert f"terminated sprites {sprite}" in now.stdout.splitlines(), now.stdout
    assert f"marked {run_id} lost" in now.stdout.splitlines(), now.stdout
    assert fake.ledger.alive() == set()


def test_the_sdk_tells_fly_nothing_of_the_relays_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """sprites-py's client-signals headers describe the calling process (its parent, CI and
    agent variables); the relay opts out unless the operator set SPRITES_CLIENT_SIGNALS."""
    from sprites import _signals

    monkeypatch.setenv("SPRITES_CLIENT_SIGNALS", "")
    monkeypatch.delenv("SPRITES_CLIENT_SIGNALS")  # restored to unset afterwards
    monkeypatch.setenv("CI", "1")  # something the signals would report
    _signals._computed.cache_clear()
    settings = Settings(_env_file=None, sprites_token="t", sprites_base_url="http://127.0.0.1:9")  # type: ignore[call-arg]
    provider = SpritesProvider(settings)
    try:
        headers = _signals.signal_headers()
    finally:
        anyio.run(provider.aclose)
        _signals._computed.cache_clear()
    assert not [name for name in headers if name.lower().startswith("fly-client")], headers
