"""Fly.io Sprites provider, through the ``sprites-py`` SDK (``sprites``, 0.7.2).

A Sprite is a persistent Linux computer; the relay uses each as a short-lived sandbox:
one sprite per run, deleted when the run ends. Mapping (see docs/providers/sprites.md):

* name: ``<cluster>-<run id>-<hash of the run id>``, chosen by the relay before it calls
  create, so a create that failed or answered late is swept by that name, never by a
  listing; labels (``relay-cluster=…``, ``relay-run=…``, ``relay-lifetime=…``,
  ``relay-created=…``) mark the sprite as the relay's;
* the reaper's listing: the name prefix ``<cluster>-`` is the only filter of the list call,
  and a list item is ``{name, org_slug, updated_at}`` only (the docs), so each listed sprite
  is read once (``GET /v1/sprites/{name}``) for its labels; pages of :data:`PAGE_SIZE`
  (the API takes 1 to 50);
* **no provider-side hard lifetime**: the Sprites API has no TTL, auto-stop or
  auto-delete field, so a sprite lives until it is deleted. Every command runs under an
  in-sprite ``timeout -s KILL`` (the run's timeout plus a margin), so its processes die
  on their own even if the relay vanishes, and the relay's reaper is what deletes a
  sprite the relay forgot: it is the only guarantee (:data:`LIMITS`, ``/v1/providers``);
* egress ``()`` → a network policy denying ``*``; a list of host names (or ``*.domain``)
  → allow each, then deny ``*`` (the docs' order: their example lists the allows first,
  and nothing documents another precedence); ``("*",)`` → no policy. IP addresses and
  CIDR ranges are refused (the policy has domain rules only);
* env: the docs say an exec's ``env`` *replaces* the sprite's default environment (HOME,
  PATH gone), and it would travel in the exec WebSocket's URL; the job's variables are
  written to a file in the sprite instead (a file-write body), which the command's wrapper
  reads into the default environment and removes before the job starts;
* size → ``cpus``, ``ram_mb`` and ``storage_gb`` of the create call.

The token goes to the SDK only as an argument (the SDK reads no variable of its own for
it); the base URL comes from settings so a fake can stand in. Commands go over the
exec WebSocket as an argv list; output is written to the sink frame by frame. One
variable is set in the relay's own process: ``SPRITES_CLIENT_SIGNALS=0`` (unless the
operator set it), the SDK's only switch for its ``Fly-Client-*`` headers.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import math
import os
import posixpath
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import BinaryIO, ClassVar, cast

import anyio
import httpx
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict
from sprites import (
    AsyncCmd,
    AsyncSprite,
    AsyncSpritesClient,
    AuthenticationError,
    ExecError,
    FileNotFoundError_,
    FilesystemError,
    ListOptions,
    NetworkError,
    NetworkPolicy,
    NotFoundError,
    PolicyRule,
    SpriteConfig,
    SpriteError,
)
from sprites.exceptions import APIError

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    FileUnreadable,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.collection import find_entries, find_listing
from relay.providers.contract import (
    DEFAULT_WORKDIR,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    FileEntry,
    OutputSink,
    Rate,
    SandboxRef,
    SandboxSpec,
    StreamName,
)
from relay.providers.lifecycle import (
    DOMAIN,
    TIMEOUT_MARGIN_S,
    ErrorTable,
    ProviderSandbox,
    SandboxProvider,
    variables_file,
)
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.sprites")

TAG_LIFETIME = "relay-lifetime"
"""Label holding the lifetime (seconds) the relay gives the sprite, for an operator to check."""
TAG_CREATED = "relay-created"
"""Label holding the sprite's creation time (Unix seconds): the API's ``created_at`` is
optional to the SDK (absent or unparsable, it reads None), and a sprite of no known run
and no known age is one the reaper must leave alone, here for ever (no provider lifetime)."""
MAX_CPUS = 8
MAX_MEMORY_MB = 16_384
"""The largest size the relay asks for (an assumption: the SDK documents no limits)."""
MAX_RECONNECTS = 3
"""A command stream that breaks is attached to again this many times."""
PAGE_SIZE = 50
"""Sprites per list page: the largest ``max_results`` the API takes (1 to 50)."""
CONCURRENT_READS = 8
"""Sprites read at once while listing (one ``GET`` each, for its labels)."""
LIMITS: dict[str, str | bool] = {"hard_lifetime": False, "lifetime": "reaper"}
"""What ``GET /v1/providers`` says: no provider-side lifetime; the reaper deletes sprites."""

# The job's argv runs as "$@" of this script: no shell ever parses it. $0 is a marker
# that names the exec session (to attach to it again), $1 the workdir, $2 the file of the
# job's variables (or ""): read into the sprite's default environment (set -a exports
# them), then removed. No shell variable of the script's own: a job's could overwrite it.
# LIMIT is the KILL timeout, a number the relay writes in.
_WRAPPER = (
    'cd -- "$1" 2>/dev/null || { mkdir -p -- "$1" 2>/dev/null'
    ' || sudo -n install -d -m 0777 -- "$1"; } && cd -- "$1" || exit 126; '
    'if [ -n "$2" ]; then set -a && . "$2" && set +a && command -p rm -f -- "$2" || exit 126; fi; '
    'shift 2; exec timeout -s KILL LIMIT "$@"'
)
_STATUS = re.compile(r"\(status (\d{3})\)")


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status of an SDK error: a field on APIError, else only in its message
    (``Failed <op> (status N): …``); the message itself is never copied anywhere."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _classify(exc: BaseException) -> ProviderError | type[ProviderError] | None:
    status = _status_of(exc)
    if status is None:
        return ProviderUnavailable if isinstance(exc, NetworkError) else None
    if status in (401, 403):
        return ProviderAuth
    if status == 429:
        seconds = exc.get_retry_after_seconds() if isinstance(exc, APIError) else None
        return ProviderRateLimited(
            "sprites is rate limiting the relay", retry_after=float(seconds or 5)
        )
    if status in (404, 410):
        return SandboxLost
    if status >= 500:
        return ProviderUnavailable
    return ProviderError


ERRORS: ErrorTable = (
    (AuthenticationError, ProviderAuth),
    ((NotFoundError, FileNotFoundError_), SandboxLost),
    (TimeoutError, ProviderTimeout),  # the SDK's own exec timeout is a TimeoutError
    (SpriteError, _classify),
    ((NetworkError, FilesystemError, httpx.TransportError, OSError), ProviderUnavailable),
)


def sprite_name(spec: SandboxSpec) -> str:
    """The run's name under the cluster's prefix (a DNS label: at most 63 characters).

    Made from the run id alone, so what a failed create may have left is found by name,
    whatever the create answered (a run creates one sprite)."""
    run = re.sub(r"[^a-z0-9]+", "-", spec.run_id.lower()).strip("-")[:14].strip("-")
    digest = hashlib.sha256(spec.run_id.encode()).hexdigest()[:6]
    return f"{spec.cluster}-{run or 'run'}-{digest}"


def labels_for(spec: SandboxSpec) -> list[str]:
    tags = {**spec.tags, TAG_LIFETIME: str(spec.lifetime_s), TAG_CREATED: str(int(time.time()))}
    return [f"{key}={value}" for key, value in tags.items()]


def tags_of(labels: Sequence[str]) -> dict[str, str]:
    """``key=value`` labels back into tags (other labels are ignored)."""
    return dict(label.split("=", 1) for label in labels if "=" in label)


def created_at_of(tags: Mapping[str, str]) -> datetime | None:
    """The creation time the relay labelled a sprite with (none on one made elsewhere)."""
    try:
        return datetime.fromtimestamp(int(tags[TAG_CREATED]), UTC)
    except (KeyError, ValueError, OverflowError, OSError):
        return None


def network_policy_for(hosts: tuple[str, ...]) -> NetworkPolicy | None:
    """``()`` → deny all, ``("*",)`` → no policy, else the named domains allowed, then
    ``*`` denied (the docs' order; a first-match reading keeps it meaning what it says)."""
    if hosts == ("*",):
        return None
    rules: list[PolicyRule] = []
    for host in hosts:
        if host == "*" or not DOMAIN.match(host):
            raise EgressUnsupported(
                "sprites can allow host names (or *.domain) only: no IP addresses, "
                'CIDR ranges, or "*" next to other hosts'
            )
        rules.append(PolicyRule(domain=host.lower(), action="allow"))
    rules.append(PolicyRule(domain="*", action="deny"))
    return NetworkPolicy(rules=rules)


def config_for(spec: SandboxSpec) -> SpriteConfig:
    """The create call's size, or :class:`SizeUnsupported` past what the relay asks for."""
    size = spec.resources
    if size.cpu > MAX_CPUS or size.memory_mb > MAX_MEMORY_MB:
        raise SizeUnsupported(
            f"sprites get at most {MAX_CPUS} CPUs and {MAX_MEMORY_MB} MB of memory here"
        )
    return SpriteConfig(
        cpus=max(1, math.ceil(size.cpu)),
        ram_mb=size.memory_mb,
        storage_gb=max(1, math.ceil(size.disk_mb / 1024)),
    )


class _SinkStream:
    """The binary stream the SDK writes each output frame to: straight into the sink."""

    def __init__(self, output: OutputSink, stream: StreamName) -> None:
        self._output, self._stream = output, stream

    def write(self, data: bytes) -> int:
        self._output.write(self._stream, bytes(data))
        return len(data)


READ_TIMEOUT_S = 60
"""The longest one listing or read of a sprite's files may take (the collection's own
budget is shorter, and cancels it first)."""


def _sink(output: OutputSink, stream: StreamName) -> BinaryIO:
    """The SDK types its sinks as binary files; it only ever calls ``write``."""
    return cast(BinaryIO, _SinkStream(output, stream))


class SpritesSandbox(ProviderSandbox):
    """One sprite, used for one run.

    Its files are read as sprites-py 0.7.2 allows: its file API lists names only
    (``iterdir``), so a folder is listed by a ``find`` run in the sprite (links not
    followed, each entry's own type and size), and a file within the cap is read with
    ``filesystem().path(p).read_bytes()`` (``GET /fs/read``); a larger one with
    ``head -c`` (the SDK buffers a command's output, so the cap bounds it)."""

    def __init__(self, provider: SpritesProvider, sprite: AsyncSprite) -> None:
        super().__init__(provider, sprite.name)
        self._sprite = sprite

    async def folder_entries(self, path: str) -> list[FileEntry]:
        try:
            listing = await self._sprite.command(
                *find_listing(path), timeout=READ_TIMEOUT_S
            ).output()
        except ExecError as exc:
            raise FileUnreadable("no such folder") from exc
        return find_entries(listing)

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        try:
            if size is not None and size <= limit:
                yield await self._sprite.filesystem("/").path(path).read_bytes()
                return
            head = self._sprite.command(
                "head", "-c", str(limit), "--", path, timeout=READ_TIMEOUT_S
            )
            yield await head.output()
        except (ExecError, FilesystemError) as exc:
            raise FileUnreadable("the file could not be read") from exc

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        root = self._sprite.filesystem(DEFAULT_WORKDIR)
        for path, content in files.items():
            target = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, path))
            # Parent directories are made by the write itself (mkdirParents).
            await root.path(target).write_bytes(content)

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        if not argv:
            raise ProviderError("there is no command to run")
        directory = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, workdir or "."))
        marker = f"relay-exec-{secrets.token_hex(6)}"
        limit_s = math.ceil(timeout_s + TIMEOUT_MARGIN_S)
        deadline = anyio.current_time() + limit_s
        variables = ""
        if env:
            # Not the exec's env (it would replace HOME, PATH… and ride in the URL).
            variables = f"/tmp/{marker}.env"  # noqa: S108 (in the sprite)
            await (
                self._sprite.filesystem("/")
                .path(variables)
                .write_bytes(variables_file(env), mode=0o600)
            )
        command = self._sprite.command(
            "sh",
            "-c",
            _WRAPPER.replace("LIMIT", str(limit_s)),
            marker,
            directory,
            variables,
            *argv,
            timeout=limit_s,
            stdin=io.BytesIO(stdin) if stdin is not None else None,
            stdout=_sink(output, "stdout"),
            stderr=_sink(output, "stderr"),
        )
        for reconnects in range(MAX_RECONNECTS + 1):
            try:
                await command.run()
                return ExecResult(exit_code=0)
            except ExecError as exc:
                return ExecResult(exit_code=exc.exit_code())
            except NetworkError as exc:
                # The stream ended without an exit status: the sprite is gone (lost),
                # or the connection broke and the command still runs (attach again).
                if await self.provider.gone(self.id):
                    raise SandboxLost("the sprites sandbox was gone during the run") from exc
                if reconnects == MAX_RECONNECTS:
                    raise
                command = await self._attach(marker, deadline, output, exc)
        raise AssertionError("unreachable")

    async def _attach(
        self, marker: str, deadline: float, output: OutputSink, cause: Exception
    ) -> AsyncCmd:
        """The exec session of ``marker`` again (output the server kept is replayed)."""
        log.info("sprites: command stream of sprite %s broke; attaching again", self.id)
        sessions = await self._sprite.list_sessions()
        ours = [session for session in sessions if marker in session.command]
        if not ours:
            # Should the server show commands differently, a lone live session is ours: the
            # relay runs one command at a time in a sprite of its own.
            active = [session for session in sessions if session.is_active]
            ours = active if len(active) == 1 else []
        if not ours:
            raise ProviderUnavailable(
                "the sprites command stream broke and its session was not found"
            ) from cause
        remaining = max(1.0, deadline - anyio.current_time())
        command = self._sprite.attach_session(ours[-1].id, timeout=remaining)
        command.stdout = _sink(output, "stdout")
        command.stderr = _sink(output, "stderr")
        return command


class SpritesSettings(ProviderSettings):
    """``RELAY_SPRITES_*``: the API token, the API URL (a fake, in tests), the region."""

    model_config = SettingsConfigDict(env_prefix="RELAY_SPRITES_")

    token: SecretStr | None = None
    base_url: str = "https://api.sprites.dev"
    region: str | None = None


SIGNALS_OPT_OUT = "SPRITES_CLIENT_SIGNALS"


class SpritesProvider(SandboxProvider[SpritesSandbox]):
    """Runs each job in a fresh Fly.io Sprite, deleted after the run; see the module docstring."""

    name: ClassVar[str] = "sprites"
    label: ClassVar[str] = "sprites"
    # Fly's list prices for Sprites (an assumption, see docs/providers/sprites.md):
    # $0.07 per CPU-hour and $0.04375 per GB-hour of memory; storage is not counted.
    rate: ClassVar[Rate] = Rate(0.07 / 3600, 0.04375 / 3600)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = SpritesSettings
    terminate_timeout_s: ClassVar[float] = 20.0
    limits: dict[str, str | bool] = LIMITS

    def __init__(self, settings: Settings) -> None:
        config = settings.section(SpritesSettings)
        if config.token is None:
            raise ConfigError(
                "RELAY_SPRITES_TOKEN is required when the sprites provider is enabled"
            )
        # The SDK describes the process that calls it (its parent's name, agent and CI
        # variables) to Fly in Fly-Client-* headers unless told not to: a relay's host is
        # the operator's business. Its documented opt-out, unless the operator chose.
        os.environ.setdefault(SIGNALS_OPT_OUT, "0")
        self._client = AsyncSpritesClient(
            config.token.get_secret_value(), base_url=config.base_url, timeout=30.0
        )
        self._region = config.region
        self._cluster = settings.cluster
        self.create_timeout_s = settings.create_timeout_s

    def check(self, spec: SandboxSpec) -> None:
        network_policy_for(spec.egress.hosts)
        config_for(spec)
        if spec.pip:
            raise ValidationFailed(
                "the sprites provider does not install pip packages; install them in the job"
            )
        if spec.image is not None:
            raise ValidationFailed("sprites have no images; leave the job's image unset")

    async def create(self, spec: SandboxSpec) -> SpritesSandbox:
        config = config_for(spec)
        config.region = self._region
        policy = network_policy_for(spec.egress.hosts)
        sprite = await self._client.create_sprite(
            sprite_name(spec), config=config, labels=labels_for(spec)
        )
        if policy is not None:
            # A separate call: if it fails the create fails, and the sweep deletes the sprite.
            await sprite.update_network_policy(policy)
        return SpritesSandbox(self, sprite)

    async def left_by_create(self, spec: SandboxSpec) -> list[str]:
        """The name the create asked for: it exists if the create got that far, whatever
        it answered (late, an error, nothing); deleting a name never made is a 404."""
        return [sprite_name(spec)]

    async def destroy(self, sandbox_id: str) -> None:
        """Delete the sprite (its processes and disk); one already gone (404) is success."""
        await self._client.destroy_sprite(sandbox_id)

    async def gone(self, sandbox_id: str) -> bool:
        try:
            await self._client.get_sprite(sandbox_id)
        except NotFoundError:
            return True
        except (SpriteError, httpx.TransportError):
            return False
        return False

    async def list_tagged(self) -> list[SandboxRef]:
        """Every sprite named under ``<cluster>-`` whose labels say it is this cluster's
        (a cluster named ``<cluster>-x`` shares the prefix): listed, then each one read."""
        names = await self._names(f"{self._cluster}-")
        gate = asyncio.Semaphore(CONCURRENT_READS)
        refs = await asyncio.gather(*(self._owned(name, gate) for name in names))
        return [ref for ref in refs if ref is not None]

    async def _names(self, prefix: str) -> list[str]:
        """The names of every sprite under ``prefix``, page by page."""
        names: list[str] = []
        token: str | None = None
        while True:
            page = await self._client.list_sprites(
                ListOptions(prefix=prefix, max_results=PAGE_SIZE, continuation_token=token)
            )
            names += [info.name for info in page.sprites if info.name.startswith(prefix)]
            if not page.has_more or not page.next_continuation_token:
                return names
            token = page.next_continuation_token

    async def _owned(self, name: str, gate: asyncio.Semaphore) -> SandboxRef | None:
        """The sprite as the reaper sees it, if it is this cluster's (None: not ours, or
        deleted since it was listed)."""
        async with gate:
            try:
                sprite = await self._client.get_sprite(name)
            except NotFoundError:
                return None
        tags = tags_of(sprite.labels)
        if tags.get(TAG_CLUSTER) != self._cluster:
            return None
        created: datetime | None = sprite.created_at or created_at_of(tags)
        return SandboxRef(sprite.name, tags.get(TAG_RUN), created_at=created)

    async def aclose(self) -> None:
        await self._client.aclose()
