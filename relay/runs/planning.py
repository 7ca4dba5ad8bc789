"""From a request to a plan: scopes, job, params, caps and provider, checked and resolved.

Nothing here writes or waits: :meth:`Planner.plan` either raises a RelayError naming what
is wrong with the request or returns the exact argv, environment, files, timeout and
sandbox spec the run service will execute.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from relay.auth import Principal
from relay.errors import (
    CallbackRefused,
    EnvConflict,
    FileConflict,
    Forbidden,
    ProviderNotEnabled,
    UnknownJob,
    ValidationFailed,
)
from relay.providers.contract import RESERVED_ENV, Egress, Provider, Resources, SandboxSpec
from relay.runs.callback_urls import parse_callback_url
from relay.runs.catalog import Catalog, JobSpec
from relay.runs.models import SIZES, RunRequest, Size, path_clash
from relay.settings import Settings


@dataclass(frozen=True)
class Plan:
    """A validated request, resolved to exactly what will run and where."""

    job: str | None
    provider: str
    argv: list[str]
    env: dict[str, str]
    files: dict[str, bytes]
    stdin: bytes | None
    workdir: str | None
    timeout_s: float
    spec: SandboxSpec
    artifacts: tuple[str, ...] = ()
    """Paths and globs (relative to the workdir) whose files are kept with the run."""
    artifacts_required: bool = False
    """The run fails unless every artifact is kept whole (its job's ``artifacts_required``)."""


def request_hash(request: RunRequest) -> str:
    # A request without artifacts hashes as before they existed: a retry across an
    # upgrade is the same request.
    unset = {"wait"} if request.artifacts else {"wait", "artifacts"}
    body = request.model_dump(mode="json", exclude=unset)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def image_for(
    provider: str, asked: str | None, job: JobSpec | None, default: str | None
) -> str | None:
    """The request's image, else the job's image for this provider ("" = the provider's
    own default), else the job's image."""
    if asked:
        return asked
    if job is not None and provider in job.images:
        return job.images[provider] or None
    return default


def merged_env(own: dict[str, str], asked: Mapping[str, str]) -> dict[str, str]:
    """The job's variables plus the request's; a request never replaces one of the job's
    (its ``env`` table and param variables) or one the relay sets itself."""
    for name in sorted(asked):
        if name in RESERVED_ENV:
            raise EnvConflict(f"env {name!r} is set by the relay itself")
        if name in own:
            raise EnvConflict(f"env {name!r} is set by the job (its env or a param)")
    return {**own, **asked}


def merged_files(own: dict[str, bytes], asked: Mapping[str, str]) -> dict[str, bytes]:
    """The job's files (and its ``params.json``) plus the request's; the job's always win,
    so a request file may not have the same path as one of them, nor be its folder or
    inside it."""
    for path in sorted(asked):
        for theirs in sorted(own):
            if path_clash([posixpath.normpath(theirs), path]) is not None:
                raise FileConflict(f"file {path!r} collides with the job's own {theirs!r}")
    return {**own, **{path: text.encode("utf-8") for path, text in asked.items()}}


def check_workdir(workdir: str | None, files: Mapping[str, bytes]) -> None:
    """A workdir must be a folder: not one of the files, nor inside one."""
    if workdir is None or workdir == ".":
        return
    for path in files:
        normal = posixpath.normpath(path)
        if workdir == normal or workdir.startswith(normal + "/"):
            raise ValidationFailed(f"workdir {workdir!r} is a file ({path!r}), not a folder")


def narrower_egress(job: tuple[str, ...], asked: list[str]) -> tuple[str, ...]:
    """The asked egress if it is within the job's; a caller can narrow, never widen."""
    if job == ("*",) or set(asked) <= set(job):
        return tuple(asked)
    raise Forbidden("this job does not allow that egress; a request may only narrow it")


OVERRIDABLE = frozenset(
    ("image", "size", "env", "stdin", "files", "workdir", "timeout_s", "egress", "artifacts")
)
"""What a request may set for a job only where the job's ``allow`` lists it."""


class Planner:
    """Resolves requests against one relay's settings, job catalog and providers."""

    def __init__(
        self, settings: Settings, catalog: Catalog, providers: Mapping[str, Provider]
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.providers = providers

    def choose_provider(self, principal: Principal, asked: str, job: JobSpec | None) -> str:
        name = asked
        if name == "auto":
            name = job.provider if job and job.provider != "auto" else self.settings.providers[0]
        if name not in self.providers:
            raise ProviderNotEnabled(f"provider {name!r} is not enabled on this relay")
        if not principal.may_use_provider(name):
            raise Forbidden(f"this token may not use provider {name!r}")
        if job and job.provider not in ("auto", name):
            raise Forbidden(f"job {job.name!r} runs only on {job.provider!r}")
        return name

    def plan(self, principal: Principal, request: RunRequest, run_id: str) -> Plan:
        """Check scopes, job, params and limits; raise a RelayError or return the plan."""
        if request.callback_url is not None:
            parse_callback_url(request.callback_url, allow_http=self.settings.webhook_allow_http)
            secret = self.settings.webhook_secret
            if principal.webhook_secret is None and secret is None:
                raise CallbackRefused(
                    "no webhook secret to sign callbacks for this token: set "
                    "RELAY_WEBHOOK_SECRET, or give the token one (`relay tokens new NAME "
                    "--webhook-secret`)"
                )
        if (request.job is None) == (request.command is None):
            raise ValidationFailed("send exactly one of `job` or `command`")
        job: JobSpec | None = None
        if request.job is not None:
            if not principal.may_run_job(request.job):
                raise Forbidden(f"this token may not run job {request.job!r}")
            job = self.catalog.get(request.job)
            if job is None:
                known = sorted(name for name in self.catalog.jobs if principal.may_run_job(name))
                raise UnknownJob(
                    f"no job named {request.job!r}; jobs here: {', '.join(known) or 'none'} "
                    "(a job added since the last reload needs one: `relay jobs reload`, or SIGHUP)"
                )
            overrides = {
                key
                for key in OVERRIDABLE & request.model_fields_set
                if getattr(request, key) not in (None, {}, [])
            }
            refused = sorted(overrides - job.allow)
            if refused:
                raise Forbidden(f"job {job.name!r} does not let a request set `{refused[0]}`")
            argv, env, files = job.render(job.resolve_params(request.params))
            egress = job.egress
            base_timeout, image, size = job.timeout_s, job.image, job.size
        else:
            if not principal.command:
                raise Forbidden("this token may not run a raw command")
            if request.params:
                raise ValidationFailed("`params` belong to a job; a raw command has none")
            argv, env, files = list(request.command or []), {}, {}
            egress, base_timeout, image = ("*",), self.settings.default_timeout_s, None
            size = Size.small
        if request.egress is not None:
            egress = narrower_egress(egress, request.egress)
        elif job is None:
            egress = ()
        env = merged_env(env, request.env)
        files = merged_files(files, request.files)
        check_workdir(request.workdir, files)
        caps = [self.settings.max_timeout_s, base_timeout if job else self.settings.max_timeout_s]
        if principal.max_timeout_s is not None:
            caps.append(principal.max_timeout_s)
        timeout_s = min([request.timeout_s or base_timeout, *caps])
        size = request.size or size
        provider = self.choose_provider(principal, request.provider, job)
        cpu, memory_mb, disk_mb = SIZES[size]
        spec = SandboxSpec(
            run_id=run_id,
            cluster=self.settings.cluster,
            timeout_s=timeout_s,
            grace_s=self.settings.grace_s,
            image=image_for(provider, request.image, job, image),
            resources=Resources(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb),
            egress=Egress(tuple(egress)),
            pip=job.pip if job else (),
            job=job.name if job else None,
        )
        self.providers[provider].check(spec)
        stdin = request.stdin.encode("utf-8") if request.stdin is not None else None
        declared = job.artifacts if job else ()
        return Plan(
            job=job.name if job else None,
            provider=provider,
            argv=argv,
            env=env,
            files=files,
            stdin=stdin,
            workdir=request.workdir,
            timeout_s=timeout_s,
            spec=spec,
            artifacts=tuple(dict.fromkeys((*declared, *request.artifacts))),
            artifacts_required=job.artifacts_required if job else False,
        )
