"""The OpenAPI 3.1 document, generated from the same pydantic models the handlers use."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from relay import __version__
from relay.errors import ERROR_CLASSES
from relay.run_state import RunState
from relay.runs.models import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_OUTCOME_HOURS,
    MAX_SEARCH_CHARS,
    ErrorBody,
    Health,
    Index,
    JobList,
    JobsReload,
    OperatorHealth,
    OutcomeReport,
    ProviderList,
    Run,
    RunList,
    RunRequest,
    RunSummary,
    SpendReport,
    UsageReport,
)

_REF = "#/components/schemas/{model}"
_STATE = "(" + "|".join(state.value for state in RunState) + ")"
_FILTER = {"type": "string", "maxLength": 255, "description": "printable characters only"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json(
    name: str,
    description: str,
    headers: dict[str, Any] | None = None,
    links: dict[str, Any] | None = None,
) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref(name)}},
    }
    if headers:
        answer["headers"] = headers
    if links:
        answer["links"] = links
    return answer


def _errors(*statuses: int) -> dict[str, Any]:
    answers = {}
    for status in statuses:
        codes = sorted({cls.code for cls in ERROR_CLASSES if cls.status == status})
        headers = _CHALLENGE if status == 401 else None
        answers[str(status)] = _json("ErrorBody", "error codes: " + ", ".join(codes), headers)
    return answers


_CHALLENGE = {
    "WWW-Authenticate": {
        "schema": {"type": "string"},
        "description": 'the scheme to use: `Bearer realm="relay"`, with `, error="invalid_token"` '
        "where a token was sent and refused (unknown, expired)",
    }
}


_AUTH: list[dict[str, list[str]]] = [{"bearer": []}]
_RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}
_LOCATION = {
    "Location": {
        "schema": {"type": "string"},
        "description": "the run's URL: under RELAY_PUBLIC_URL, else relative (/v1/runs/{id}); "
        "never built from the request's Host",
    }
}
_RUN_LINKS = {
    "GetRun": {"operationId": "getRun", "parameters": {"run_id": "$response.body#/id"}},
    "CancelRun": {"operationId": "cancelRun", "parameters": {"run_id": "$response.body#/id"}},
}
"""A run answer leads to the run's own URL (clients and fuzzers follow these)."""
_RETRY = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
_STORE_DOWN = {
    "503": _json(
        "ErrorBody",
        "error codes: store_unavailable (the relay's database is down, restarting or full; "
        "retry after Retry-After)",
        _RETRY,
    )
}
"""Every operation that reads or writes the store may answer this (relay/http/app.py)."""
_RATE_LIMIT = {
    name: {"schema": {"type": "string"}, "description": text}
    for name, text in (
        (
            "RateLimit-Policy",
            "the token's limits, an IETF structured-field list (draft-ietf-httpapi-ratelimit-"
            'headers): `"concurrent";q=2;qu="concurrent-requests"`, `"runs-day";q=100;w=86400`, '
            '`"usd-day";q=150;qu="usd-cents";w=86400` (USD in whole cents); only for a token '
            "with limits",
        ),
        (
            "RateLimit",
            'what is left of each: `"runs-day";r=99;t=3600` (`r` remaining, `t` seconds until '
            "it is back); only for a token with limits",
        ),
    )
}


_RUN_EVENT: dict[str, Any] = {
    "title": "RunEvent",
    "description": "One line of GET /v1/runs/{run_id}/events.",
    "type": "object",
    "required": ["event"],
    "properties": {
        "event": {"type": "string", "enum": ["state", "output", "attempt", "ping", "run"]},
        "state": {"type": "string", "description": "for `state`: the run's new state"},
        "stream": {"type": "string", "enum": ["stdout", "stderr"]},
        "text": {"type": "string", "description": "for `output`: the next chunk, in order"},
        "provider": {
            "type": "string",
            "description": "for `attempt`: a provider of the run's route that did not run it",
        },
        "error": {**_ref("ErrorInfo"), "description": "for `attempt`: why"},
        "message": {
            "type": "string",
            "description": "for `attempt`: what happened and where the run goes, one line "
            "(`e2b: create timed out after 10 s; trying daytona`)",
        },
        "run": {**_ref("Run"), "description": "for `run`: the final run; the last line"},
    },
}


_SERIALIZED = (
    Run,
    RunSummary,
    RunList,
    ErrorBody,
    JobList,
    ProviderList,
    Health,
    UsageReport,
    SpendReport,
    OperatorHealth,
    OutcomeReport,
    JobsReload,
    Index,
)
"""The answers' models, described as the relay writes them."""


DESCRIPTION = """\
An endpoint you own that runs **declared jobs** in short-lived sandboxes (local bubblewrap,
E2B, Modal, Vercel, Daytona, Sprites…) and answers with JSON. The provider keys stay here.

- **Auth**: `Authorization: Bearer <token>` on every `/v1` call (or the header the relay
  names in `RELAY_AUTH_HEADER`). A token may run the jobs it lists; an admin token reads every
  token's runs and reloads the jobs (`relay tokens new NAME --admin`).
- **A run**: `POST /v1/runs` with `{"job": "echo", "params": {"message": "hi"}}` waits for the
  run and answers it (`state`, `exit_code`, `stdout`, `stderr`, `error`); `wait: false` answers
  `202` at once, to poll or follow (`GET /v1/runs/{run_id}/events`). A retry with the same
  `Idempotency-Key` never starts a second sandbox.
- **Errors**: `{"error": {"code", "message", "request_id"}}`, the `code` stable.
- **Webhooks**: a run with a `callback_url` is POSTed there when it ends, signed as
  [Standard Webhooks](https://www.standardwebhooks.com/) sign (see *Webhooks* below: `runFinished`).
- **Also here**: [`/console`](/console) (the operator console, an admin token),
  [`/healthz`](/healthz) and [`/readyz`](/readyz) (no token), `/metrics`, and `/mcp`
  (the jobs as MCP tools, not described here).
"""
"""What ``/docs`` shows above the operations (Markdown)."""


@cache
def document() -> dict[str, Any]:
    """The whole document; cached, since it depends on code only."""
    common = _errors(401, 405, 431, 500)  # 431: headers over a cap (connections.py)
    paths: dict[str, Any] = {
        "/v1/runs": {"post": _create_run(common), "get": _list_runs(common)},
        "/v1/runs/{run_id}": {"get": _get_run(common), "delete": _cancel_run(common)},
        "/v1/runs/{run_id}/events": {"get": _run_events(common)},
        "/v1/runs/{run_id}/artifacts/{name}": {"get": _get_artifact(common)},
        **_reference_paths(common),
        **_operations_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "relay", "version": __version__, "description": DESCRIPTION},
        "paths": paths,
        "webhooks": {"runFinished": {"post": _run_finished()}},
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "metrics": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def _schemas() -> dict[str, Any]:
    """Every model's JSON schema (the request as validated, answers as written)."""
    _, schemas = models_json_schema(
        [(model, "serialization") for model in _SERIALIZED] + [(RunRequest, "validation")],
        ref_template=_REF,
    )
    definitions: dict[str, Any] = schemas["$defs"]
    definitions["RunEvent"] = _RUN_EVENT
    return definitions


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "A retry with the same key returns the same run.",
    "schema": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_IDEMPOTENCY_KEY_CHARS,
        "pattern": "^[\\x21-\\x7e]([\\x20-\\x7e]*[\\x21-\\x7e])?$",
    },
}


def _create_run(common: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/runs``."""
    examples = {
        "job": {"value": {"job": "echo", "params": {"message": "hi"}}},
        "async": {"value": {"job": "echo", "params": {"message": "later"}, "wait": False}},
    }
    return {
        "summary": "Submit a run (waits for it unless `wait` is false)",
        "operationId": "createRun",
        "security": _AUTH,
        "parameters": [_IDEMPOTENCY_KEY],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref("RunRequest"), "examples": examples}},
        },
        "responses": {
            "200": _json("Run", "the finished run", {**_LOCATION, **_RATE_LIMIT}, _RUN_LINKS),
            "429": _json(
                "ErrorBody",
                "error codes: rate_limited (a limit of the token's, its fair share of the "
                "relay's runs at once, the relay's own, or every provider of the run's "
                "route at its RELAY_<NAME>_MAX_CONCURRENT, each named), budget_exceeded",
                {**_RETRY, **_RATE_LIMIT},
            ),
            "202": _json(
                "Run", "accepted; poll Location", {**_LOCATION, **_RATE_LIMIT}, _RUN_LINKS
            ),
            **_errors(400, 403, 409, 413, 415, 422, 502, 503, 504),
            **common,
        },
    }


def _list_runs(common: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/runs``."""
    return {
        "summary": "This token's runs (every token's for an admin token), newest first",
        "operationId": "listRuns",
        "security": _AUTH,
        "parameters": [
            {
                "name": "state",
                "in": "query",
                "description": "One state, or several separated by commas (any of them): "
                "`failed,timed_out,error,lost` lists every failure.",
                "schema": {"type": "string", "pattern": f"^{_STATE}(,{_STATE})*$"},
            },
            {"name": "job", "in": "query", "schema": _FILTER},
            {
                "name": "q",
                "in": "query",
                "description": "A run's whole id, or text found in its job's or its token's "
                "name (any case); combine it with `since` on a large store.",
                "schema": {"type": "string", "maxLength": MAX_SEARCH_CHARS},
            },
            {
                "name": "limit",
                "in": "query",
                "schema": {"type": "integer", "minimum": 1, "maximum": 200},
            },
            {"name": "cursor", "in": "query", "schema": _FILTER},
            {
                "name": "token",
                "in": "query",
                "description": "Only this token's runs (another token's: admin tokens only).",
                "schema": _FILTER,
            },
            {"name": "provider", "in": "query", "schema": _FILTER},
            *(
                {
                    "name": name,
                    "in": "query",
                    "description": f"Runs created {text} this ISO 8601 time (UTC if no zone).",
                    "schema": {"type": "string", "format": "date-time"},
                }
                for name, text in (("since", "at or after"), ("until", "before"))
            ),
        ],
        "responses": {
            "200": _json(
                "RunList",
                "a page of run summaries: no stdout/stderr (read them through "
                "GET /v1/runs/{run_id}), their sizes in stdout_bytes/stderr_bytes; "
                "`request` as the run shows it, unless it is over 4096 characters",
            ),
            **_errors(400, 403),
            **_STORE_DOWN,
            **common,
        },
    }


def _get_run(common: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/runs/{run_id}``."""
    return {
        "summary": "One run",
        "operationId": "getRun",
        "security": _AUTH,
        "parameters": [_RUN_ID],
        "responses": {"200": _json("Run", "the run"), **_errors(404), **_STORE_DOWN, **common},
    }


def _get_artifact(common: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/runs/{run_id}/artifacts/{name}``: one kept artifact, streamed."""
    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "the artifact's `name` as the run lists it (its `url` has it encoded); "
        "may hold `/`",
    }
    return {
        "summary": "One artifact of a run, streamed",
        "description": "The bytes the run kept of a file its job declared (the run's "
        "`artifacts[].url`), streamed from the relay's store a chunk at a time, with the run's "
        "own auth. Always an attachment (`Content-Disposition`), never cached "
        "(`Cache-Control: no-store`), `Content-Security-Policy: sandbox`; `ETag` is its "
        "SHA-256. A skipped artifact, or a name the run does not have, is 404; contents "
        "kept in object storage (RELAY_ARTIFACTS_URL) whose object is gone from the bucket "
        "are 410 `artifact_gone`.",
        "operationId": "getArtifact",
        "security": _AUTH,
        "parameters": [_RUN_ID, name],
        "responses": {
            "200": {
                "description": "the artifact's bytes, with the content type its name says",
                "headers": {
                    "Content-Disposition": {"schema": {"type": "string"}},
                    "Content-Length": {"schema": {"type": "integer"}},
                    "ETag": {"schema": {"type": "string"}},
                },
                "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
            },
            **_errors(404, 410),
            **_STORE_DOWN,
            **common,
        },
    }


def _cancel_run(common: dict[str, Any]) -> dict[str, Any]:
    """``DELETE /v1/runs/{run_id}``."""
    return {
        "summary": "Cancel a run: its sandbox is terminated now",
        "operationId": "cancelRun",
        "security": _AUTH,
        "parameters": [_RUN_ID],
        "responses": {
            "200": _json(
                "Run",
                "the run as the cancel left it: canceled, or the job's own outcome when its "
                "job had ended before the cancel (its sandbox still being terminated)",
            ),
            **_errors(404, 409),
            **_STORE_DOWN,
            **common,
        },
    }


def _run_events(common: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/runs/{run_id}/events``: the NDJSON stream of one run."""
    return {
        "summary": "The run's state changes and output as they happen, then the run",
        "description": (
            "Newline-delimited JSON, one object per line, from the start of the run "
            "whenever you connect: `{event: state, state}`, `{event: output, stream, "
            "text}` (in order), `{event: ping}` (every 15 s of silence), and last "
            "`{event: run, run}` with the final run; then the stream closes (at the latest "
            "a few seconds after the run ended). A token may hold "
            "`RELAY_MAX_STREAMS_PER_TOKEN` streams open at once."
        ),
        "operationId": "runEvents",
        "security": _AUTH,
        "parameters": [_RUN_ID],
        "responses": {
            "200": {
                "description": "an NDJSON stream ending with the final run",
                "content": {"application/x-ndjson": {"schema": _ref("RunEvent")}},
            },
            "429": _json(
                "ErrorBody",
                "error codes: too_many_streams (RELAY_MAX_STREAMS_PER_TOKEN open)",
                _RETRY,
            ),
            **_errors(404),
            **_STORE_DOWN,
            **common,
        },
    }


_WEBHOOK_HEADERS = [
    {
        "name": name,
        "in": "header",
        "required": required,
        "description": text,
        "schema": {"type": "string"},
    }
    for name, required, text in (
        (
            "webhook-id",
            True,
            "The delivery's id (`dlv_…`), the same on every attempt: dedupe on it.",
        ),
        ("webhook-timestamp", True, "When this attempt was signed, in Unix seconds."),
        (
            "webhook-signature",
            True,
            "`v1,<base64 HMAC-SHA256>` of `<webhook-id>.<webhook-timestamp>.<body>` (Standard "
            "Webhooks), keyed with the token's webhook secret (else `RELAY_WEBHOOK_SECRET`): a "
            "`whsec_` secret's base64-decoded bytes, any other secret's UTF-8 bytes. Any "
            "Standard Webhooks library verifies it (`Webhook(secret).verify(body, headers)`); "
            "refuse a timestamp more than 5 minutes off.",
        ),
        (
            "Relay-Signature",
            True,
            "The relay's older signature of the same body: `t=<unix seconds>,v1=<hex HMAC-SHA256 "
            'of "<t>.<body>">` keyed with the secret\'s UTF-8 bytes '
            "(`relay.client.verify_signature` checks either).",
        ),
        ("Relay-Run-Id", True, "The run's id."),
        ("Relay-Delivery-Id", True, "The same as `webhook-id`."),
        ("Relay-Delivery-Attempt", True, "1 for the first attempt, then 2, 3…"),
    )
]


def _run_finished() -> dict[str, Any]:
    """The webhook: what a ``callback_url`` receives when its run ends."""
    return {
        "summary": "A run ended: its callback_url receives it, signed",
        "description": (
            "Sent once the run is final (`succeeded`, `failed`, `timed_out`, `canceled`, "
            "`error` or `lost`), from the relay to the run's `callback_url`. The body is "
            "exactly what `GET /v1/runs/{run_id}` answers at that moment (with `deliveries`). "
            "Verify the signature over the raw body before parsing it. Any 2xx answer ends "
            "the delivery; anything else (a redirect too), a timeout (`RELAY_WEBHOOK_TIMEOUT_S`) "
            "or a connection error is retried after `RELAY_WEBHOOK_BACKOFF_S * 2^(attempt-1)`, "
            "with jitter, up to `RELAY_WEBHOOK_MAX_ATTEMPTS` attempts. The answer's body is "
            "never read."
        ),
        "operationId": "runFinished",
        "security": [],
        "parameters": _WEBHOOK_HEADERS,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref("Run")}},
        },
        "responses": {
            "2XX": {"description": "delivered: no further attempt"},
            "default": {"description": "not delivered: retried later, until the attempts run out"},
        },
    }


def _reference_paths(common: dict[str, Any]) -> dict[str, Any]:
    """What a token may use: jobs, its usage, providers."""

    def read(
        summary: str, operation: str, model: str, description: str, store: bool = False
    ) -> dict[str, Any]:
        stored = _STORE_DOWN if store else {}
        return {
            "get": {
                "summary": summary,
                "operationId": operation,
                "security": _AUTH,
                "responses": {"200": _json(model, description), **stored, **common},
            }
        }

    return {
        "/v1/jobs": read("Jobs this token may run", "listJobs", "JobList", "jobs"),
        "/v1/jobs/reload": {
            "post": {
                "summary": "Read this replica's jobs folder again (admin tokens only)",
                "description": (
                    "What `relay jobs reload` and `SIGHUP` do: the whole folder is read and "
                    "checked first; if it loads, it replaces the jobs at once (a run already "
                    "planned keeps its plan), the warm pools follow and open `/mcp` sessions "
                    "are told; if not, nothing changes, the answer is `422 jobs_invalid` "
                    "naming the file and the problem, and `/readyz` says it (`degraded`) until "
                    "a reload succeeds. Each replica reloads its own folder: behind a balancer, "
                    "call each one."
                ),
                "operationId": "reloadJobs",
                "security": _AUTH,
                "responses": {
                    "200": _json("JobsReload", "the jobs now served, and what changed"),
                    **_errors(400, 403),
                    "422": _json(
                        "ErrorBody",
                        "error codes: jobs_invalid (the folder does not load: the message "
                        "names the file and the problem; the last good jobs serve on)",
                    ),
                    **common,
                },
            }
        },
        "/v1/usage": read(
            "This token's runs, sandbox seconds and spend today and this month",
            "getUsage",
            "UsageReport",
            "usage and limits",
            store=True,
        ),
        "/v1/providers": read("Enabled providers", "listProviders", "ProviderList", "providers"),
        "/v1/spend": {
            "get": {
                "summary": "Runs and USD per day, token and provider (every token's for an "
                "admin token), and each token's standing against its limits today",
                "operationId": "getSpend",
                "security": _AUTH,
                "parameters": [
                    {
                        "name": "days",
                        "in": "query",
                        "description": "How many UTC days back, today included (default 30).",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 92},
                    }
                ],
                "responses": {
                    "200": _json("SpendReport", "spend per day"),
                    **_errors(400),
                    **_STORE_DOWN,
                    **common,
                },
            }
        },
        "/v1/outcomes": {
            "get": {
                "summary": "How every token's runs ended, per job and per provider, over the "
                "last `hours` (admin tokens only)",
                "operationId": "getOutcomes",
                "security": _AUTH,
                "parameters": [
                    {
                        "name": "hours",
                        "in": "query",
                        "description": "How many hours back from now (default 24).",
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_OUTCOME_HOURS},
                    }
                ],
                "responses": {
                    "200": _json("OutcomeReport", "what the console's jobs page shows"),
                    **_errors(400, 403),
                    **_STORE_DOWN,
                    **common,
                },
            }
        },
        "/v1/health": {
            "get": {
                "summary": "Providers, reaper and webhook backlog (admin tokens only)",
                "operationId": "getOperatorHealth",
                "security": _AUTH,
                "responses": {
                    "200": _json("OperatorHealth", "what the console's health page shows"),
                    **_errors(403),
                    **_STORE_DOWN,
                    **common,
                },
            }
        },
    }


def _operations_paths() -> dict[str, Any]:
    """What operators and machines read, without a run token: health, metrics, this."""
    return {
        "/": {
            "get": {
                "summary": "Where to go from here: the docs, the console, health",
                "description": "JSON, or a small page of links when `Accept` prefers HTML. "
                "Nothing beyond what `/healthz` says: no version, no secret.",
                "operationId": "index",
                "security": [],
                "responses": {
                    "200": {
                        "description": "links",
                        "content": {
                            "application/json": {"schema": _ref("Index")},
                            "text/html": {"schema": {"type": "string"}},
                        },
                    }
                },
            }
        },
        "/healthz": {
            "get": {
                "summary": "Liveness",
                "operationId": "healthz",
                "security": [],
                "responses": {"200": {"description": "alive"}},
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness",
                "operationId": "readyz",
                "security": [],
                "responses": {
                    "200": _json("Health", "ready or degraded"),
                    "503": _json("Health", "not ready", _RETRY),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (bearer RELAY_METRICS_TOKEN when that is set)",
                "operationId": "metrics",
                "security": [{}, {"metrics": []}],
                "responses": {
                    "200": {
                        "description": "the Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "security": [],
                "responses": {"200": {"description": "OpenAPI 3.1"}},
            }
        },
    }
