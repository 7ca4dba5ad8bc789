"""From a request to a plan: scopes, job, params, caps and route, checked and resolved.

Nothing here writes or waits: :meth:`Planner.plan` either raises a RelayError naming what
is wrong with the request or returns the exact argv, environment, files, timeout and the
run's route: the providers that can take it, in order, each with the sandbox spec made for
it (its image; its ``check`` passed). A provider that cannot take the run (its size, its
egress, the token's providers) is left out, never given a wider spec; a route left with
none is :class:`~relay.errors.NoRoute`, naming each provider's reason.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from relay.auth import Principal
from relay.errors import (
    CallbackRefused,
    EnvConflict,
    FileConflict,
    Forbidden,
    NoRoute,
    ProviderNotEnabled,
    RelayError,
    UnknownJob,
    ValidationFailed,
)
from relay.providers.contract import RESERVED_ENV, Egress, Provider, Resources, SandboxSpec
from relay.runs.callback_urls import parse_callback_url
from relay.runs.catalog import Catalog, JobSpec
from relay.runs.models import SIZES, RunRequest, Size, path_clash
from relay.settings import Settings
from relay.store.records import maker


@dataclass(frozen=True)
class Candidate:
    """One provider of a run's route, and the sandbox spec made for it."""

    provider: str
    spec: SandboxSpec


@dataclass(frozen=True)
class Plan:
    """A validated request, resolved to exactly what will run and where."""

    job: str | None
    provider: str
    """The first provider of the route (the run's until another one runs it)."""
    argv: list[str]
    env: dict[str, str]
    files: dict[str, bytes]
    stdin: bytes | None
    workdir: str | None
    timeout_s: float
    spec: SandboxSpec
    """The first provider's spec."""
    route: tuple[Candidate, ...] = ()
    """Every provider that can take the run, in the order tried (the first is
    :attr:`provider`); empty in a plan made by hand: that provider alone."""
    retry_safe: bool = False
    """The job may run again elsewhere after a sandbox lost under it (``retry = "safe"``)."""
    ranking: str = "order"
    """How the route is ranked before it is tried (the job's ``route``, else
    ``RELAY_ROUTE_CHOICE``): relay/runs/ranking.py."""
    skipped: tuple[tuple[str, str], ...] = ()
    """Providers of the route left out at the admission, and why (at their cap)."""
    artifacts: tuple[str, ...] = ()
    """Paths and globs (relative to the workdir) whose files are kept with the run."""
    artifacts_required: bool = False
    """The run fails unless every artifact is kept whole (its job's ``artifacts_required``)."""
    artifacts_token_bytes: int | None = None
    """The token's own cap on what its runs' artifacts keep together (its
    ``max_artifact_bytes``); None: RELAY_ARTIFACTS_MAX_TOKEN_BYTES."""


def request_hash(request: RunRequest) -> str:
    # A request without artifacts hashes as before they existed: a retry across an
    # upgrade is the same request.
    unset = {"wait"} if request.artifacts else {"wait", "artifacts"}
    body = request.model_dump(mode="json", exclude=unset)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


make_spec = maker(SandboxSpec)
make_plan = maker(Plan)


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


RESOURCES = {size: Resources(*SIZES[size]) for size in Size}
"""Each size's resources, made once: a spec's are one of these (they are frozen)."""
MAX_EGRESSES = 256
"""Egress policies kept made, by their hosts (a job's, or one a request narrowed it to)."""


class Planner:
    """Resolves requests against one relay's settings, job catalog and providers."""

    def __init__(
        self, settings: Settings, catalog: Catalog, providers: Mapping[str, Provider]
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.providers = providers
        self._egresses: dict[tuple[str, ...], Egress] = {}
        self._defaults: dict[str, tuple[JobSpec, tuple[str, ...], dict[str, str], dict[str, bytes]]]
        self._defaults = {}

    def _rendered(
        self, job: JobSpec, params: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, str], dict[str, bytes]]:
        """``job`` rendered for ``params``: argv, env and files (the caller's own copies).
        Without params (the job's defaults) it is the same every run, so it is rendered
        once per job (a reload makes new jobs, rendered again)."""
        if params:
            return job.render(job.resolve_params(params))
        found = self._defaults.get(job.name)
        if found is None or found[0] is not job:
            argv, env, files = job.render(job.resolve_params(params))
            found = (job, tuple(argv), env, files)
            self._defaults[job.name] = found
        return list(found[1]), dict(found[2]), dict(found[3])

    def _egress(self, hosts: tuple[str, ...]) -> Egress:
        """The (frozen) policy of ``hosts``, made once while few are in use."""
        found = self._egresses.get(hosts)
        if found is None:
            found = Egress(hosts)
            if len(self._egresses) < MAX_EGRESSES:
                self._egresses[hosts] = found
        return found

    def route_names(self, principal: Principal, asked: str, job: JobSpec | None) -> tuple[str, ...]:
        """The providers a run may go to, in order, before each is checked: the request's
        one (where its token may choose it and it is on the job's route), else the job's
        route, else the relay's (``RELAY_ROUTE``)."""
        named = job.route_names if job is not None else ()
        if asked == "auto":
            return named or tuple(self.settings.default_route)
        if asked not in self.providers:
            raise ProviderNotEnabled(f"provider {asked!r} is not enabled on this relay")
        if not principal.may_use_provider(asked):
            raise Forbidden(f"this token may not use provider {asked!r}")
        if job is not None and named and asked not in named:
            where = repr(named[0]) if len(named) == 1 else f"its route ({', '.join(named)})"
            raise Forbidden(f"job {job.name!r} runs only on {where}")
        return (asked,)

    def routed(
        self,
        principal: Principal,
        names: tuple[str, ...],
        spec: SandboxSpec,
        job: JobSpec | None,
        *,
        asked_image: bool,
    ) -> tuple[Candidate, ...]:
        """The providers of ``names`` that can take a run of ``spec``, each with its own
        spec (its image: ``image_for``); :class:`NoRoute` naming each one's reason when
        none can (a route of one raises that provider's own refusal)."""
        route: list[Candidate] = []
        refusals: dict[str, RelayError] = {}
        for name in names:
            provider = self.providers.get(name)
            if provider is None:
                refusals[name] = ProviderNotEnabled(f"provider {name!r} is not enabled here")
                continue
            if not principal.may_use_provider(name):
                refusals[name] = Forbidden(f"this token may not use provider {name!r}")
                continue
            image = spec.image if asked_image else image_for(name, None, job, spec.image)
            own = spec if image == spec.image else replace(spec, image=image)
            try:
                provider.check(own)
            except ValidationFailed as refused:  # its size, its egress: the request's shape
                refusals[name] = refused
                continue
            route.append(Candidate(name, own))
        if route:
            return tuple(route)
        if len(refusals) == 1:
            raise next(iter(refusals.values()))
        reasons = "; ".join(f"{name}: {error.message}" for name, error in refusals.items())
        raise NoRoute(f"no provider on this run's route can take it ({reasons})")

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
            asked = OVERRIDABLE & request.model_fields_set
            if asked:  # most runs set none: no look at each
                overrides = {key for key in asked if getattr(request, key) not in (None, {}, [])}
                refused = sorted(overrides - job.allow)
                if refused:
                    raise Forbidden(f"job {job.name!r} does not let a request set `{refused[0]}`")
            argv, env, files = self._rendered(job, request.params)
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
        if request.env:  # else the job's own (``_rendered`` made the plan's copies)
            env = merged_env(env, request.env)
        if request.files:
            files = merged_files(files, request.files)
        check_workdir(request.workdir, files)
        caps = [self.settings.max_timeout_s, base_timeout if job else self.settings.max_timeout_s]
        if principal.max_timeout_s is not None:
            caps.append(principal.max_timeout_s)
        timeout_s = min([request.timeout_s or base_timeout, *caps])
        size = request.size or size
        names = self.route_names(principal, request.provider, job)
        shape = make_spec(
            run_id=run_id,
            cluster=self.settings.cluster,
            timeout_s=timeout_s,
            grace_s=self.settings.grace_s,
            image=request.image or image,
            resources=RESOURCES[size],
            egress=self._egress(tuple(egress)),
            pip=job.pip if job else (),
            job=job.name if job else None,
            attempt=None,
        )
        route = self.routed(principal, names, shape, job, asked_image=bool(request.image))
        stdin = request.stdin.encode("utf-8") if request.stdin is not None else None
        declared = job.artifacts if job else ()
        return make_plan(
            job=job.name if job else None,
            provider=route[0].provider,
            argv=argv,
            env=env,
            files=files,
            stdin=stdin,
            workdir=request.workdir,
            timeout_s=timeout_s,
            spec=route[0].spec,
            route=route,
            retry_safe=job is not None and job.retry == "safe",
            ranking=(job.route if job is not None else None) or self.settings.route_choice,
            skipped=(),
            artifacts=tuple(dict.fromkeys((*declared, *request.artifacts)))
            if request.artifacts
            else declared,
            artifacts_required=job.artifacts_required if job else False,
            artifacts_token_bytes=principal.max_artifact_bytes,
        )
