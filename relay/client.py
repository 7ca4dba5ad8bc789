"""A relay client in one file, standard library only: copy it into any repo.

    python client.py JOB -p message=hi            # RELAY_URL, RELAY_TOKEN: env, else .env
    python client.py JOB -p count:=3 --no-auth-header   # a network secret adds the header
    python client.py JOB --stdin FILE --env K=V --file PATH[=DEST]
    python client.py JOB --no-wait                # print the accepted run (JSON), exit 0
    python client.py --attach RUN_ID              # follow a run submitted before
    python client.py -- ls -la                    # a raw command (tokens with that scope)
    RELAY_AUTH_HEADER=X-Api-Key python client.py JOB   # the token goes raw in that header

The job's output is printed as it happens (``GET /v1/runs/{id}/events``): stdout to
stdout, stderr to stderr. Ctrl-C stops following and says how to follow or cancel the
run; a second Ctrl-C within a few seconds cancels it.

Exits with the job's exit code, else by what went wrong (:data:`EXIT_CODES`, printing one
``error: …`` line): 2 usage, 3 auth, 4 not found, 5 a limit, 6 the relay, provider or
network failed, 7 the run was canceled, 124 the job timed out, 130 after Ctrl-C. A retried
submit reuses one Idempotency-Key, so it never starts a second sandbox. On an auth error
the response body is never printed.

A webhook receiver checks each callback with ``verify_signature(secret, header, body)``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import os
import sys
import textwrap
import threading
import time
import typing
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FINAL = {"succeeded", "failed", "timed_out", "canceled", "error", "lost"}
RETRYABLE = {429, 502, 503, 504}
MAX_MESSAGE_CHARS = 300

EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_LIMIT = 5
EXIT_UNAVAILABLE = 6
EXIT_CANCELED = 7
EXIT_TIMED_OUT = 124
EXIT_INTERRUPTED = 130
EXIT_STDOUT_CLOSED = 141
"""As a program ended by SIGPIPE (128 + 13): the shell's own code for it."""
EXIT_CODES = {
    0: "the job succeeded (or the command did what it was asked)",
    EXIT_USAGE: "usage: a bad argument or setting, or a request the relay refused as asked "
    "(400, 409, 413, 415, 422)",
    EXIT_AUTH: "auth: the token is missing, unknown or expired, or may not do that (401, 403)",
    EXIT_NOT_FOUND: "not found: no such run (or not yours), job or token (404, unknown_job)",
    EXIT_LIMIT: "limit: a rate, concurrency or spend limit; retry later (429)",
    EXIT_UNAVAILABLE: "the relay, the provider or the network failed (5xx, unreachable; a run "
    "that ended in error or lost)",
    EXIT_CANCELED: "the run was canceled",
    EXIT_TIMED_OUT: "the job timed out",
    EXIT_INTERRUPTED: "Ctrl-C (the run goes on unless a second one canceled it)",
    EXIT_STDOUT_CLOSED: "whoever read the output went away (relay runs list | head)",
}
"""Exit codes by what went wrong. A job that ran and failed exits with its own code, so a
script that must tell a job's 3 from an auth error reads the run (``--json``)."""


class RelayClientError(Exception):
    """The relay answered with an error, or could not be reached."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        code: str | None = None,
        *,
        run_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.run_id = run_id
        self.retry_after = retry_after


AUTH_HINTS = {
    401: "check RELAY_TOKEN (and RELAY_AUTH_HEADER when another header carries it)",
    403: "this token may not do that: a job it does not list, a provider it may not use, a "
    "field the job does not allow, or a raw command without the command scope "
    "(relay tokens new NAME --command)",
    407: "a proxy on the way wants credentials of its own",
}


AUTH_CODES = {
    "token_expired": "the token has expired (token_expired): ask its owner for a new one "
    "(relay tokens rotate NAME --expires …), or use the new value if it was rotated",
}
"""Relay error codes an auth failure may name, and what to do; only these are read from it."""


def _error_detail(error: urllib.error.HTTPError) -> dict[str, Any] | None:
    try:
        payload = json.loads(error.read() or b"{}")
    except ValueError:
        return None
    detail = payload.get("error") if isinstance(payload, dict) else None
    return detail if isinstance(detail, dict) else None


def _http_error(error: urllib.error.HTTPError) -> RelayClientError:
    """What an error answer may show: the relay's own code and message, nothing else."""
    if error.code in (401, 403, 407):
        # Never echo what came back with an auth failure (a proxy's page may quote a key):
        # what to check is said from the status alone, or from a code the relay names.
        code = (_error_detail(error) or {}).get("code") if error.code == 401 else None
        if code in AUTH_CODES:
            return RelayClientError(AUTH_CODES[str(code)], error.code, str(code))
        return RelayClientError(
            f"the relay (or a proxy before it) refused the request: HTTP {error.code}; "
            + AUTH_HINTS[error.code],
            error.code,
        )
    detail = _error_detail(error)
    if not isinstance(detail, dict):
        return RelayClientError(f"HTTP {error.code}", error.code)
    message = str(detail.get("message") or f"HTTP {error.code}")[:MAX_MESSAGE_CHARS]
    try:
        retry_after: float | None = float(error.headers.get("Retry-After", ""))
    except ValueError:
        retry_after = None
    run_id = detail.get("run_id")
    return RelayClientError(
        message,
        error.code,
        str(detail.get("code") or ""),
        run_id=run_id if isinstance(run_id, str) else None,
        retry_after=retry_after,
    )


class Spinner:
    """A spinner and the time waited, on stderr, only when stderr is a terminal."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        started = time.monotonic()
        frame = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - started
            spin = self.FRAMES[frame % len(self.FRAMES)]
            self.stream.write(f"\r{spin} {self.label} {elapsed:5.1f}s")
            self.stream.flush()
            frame += 1
        self.stream.write("\r\033[K")
        self.stream.flush()

    def __enter__(self) -> Spinner:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Clear the spinner (the job's output is about to be printed); safe to repeat."""
        if self.enabled and not self._stop.is_set():
            self._stop.set()
            self._thread.join()


class Client:
    """Submit and poll runs. ``token=None`` sends no Authorization (the network adds it)."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        auth_header: str = "Authorization",
        timeout_s: float = 90.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.auth_header = auth_header
        self.timeout_s = timeout_s

    def _prepare(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)  # noqa: S310
        request.add_header("Content-Type", "application/json")
        request.add_header("Accept", "application/json")
        if self.token:
            value = self.token
            if self.auth_header.lower() == "authorization":
                value = f"Bearer {self.token}"
            request.add_header(self.auth_header, value)
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        return request

    def _request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        request = self._prepare(method, path, body, headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as error:
            raise _http_error(error) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            raise RelayClientError(f"cannot reach the relay: {reason}") from None
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = None
        if not isinstance(payload, dict):  # a proxy's page, not the relay: never shown
            raise RelayClientError(f"HTTP {status} from something that is not the relay", status)
        return status, payload

    def submit(
        self, request: dict[str, Any], *, idempotency_key: str | None = None, attempts: int = 4
    ) -> dict[str, Any]:
        """POST a run; retries transient failures with the same Idempotency-Key."""
        key = idempotency_key or str(uuid.uuid4())
        delay = 1.0
        for attempt in range(attempts):
            try:
                _status, run = self._request("POST", "/v1/runs", request, {"Idempotency-Key": key})
                return run
            except RelayClientError as error:
                # A run was made (the error names it): the same key would only return it
                # again, so there is nothing to retry.
                transient = error.status is None or error.status in RETRYABLE
                if not transient or error.run_id or attempt == attempts - 1:
                    raise
                time.sleep(min(60.0, max(delay, error.retry_after or 0.0)))
                delay *= 2
        raise AssertionError("unreachable")

    def get(self, run_id: str, *, attempts: int = 4) -> dict[str, Any]:
        """GET a run; a busy or briefly broken relay (429/502/503/504, e.g. its database
        restarting) is asked again after its ``Retry-After``: reading is safe."""
        delay = 1.0
        for attempt in range(attempts):
            try:
                return self._request("GET", f"/v1/runs/{run_id}")[1]
            except RelayClientError as error:
                transient = error.status is None or error.status in RETRYABLE
                if not transient or attempt == attempts - 1:
                    raise
                time.sleep(min(60.0, max(delay, error.retry_after or 0.0)))
                delay *= 2
        raise AssertionError("unreachable")

    def wait(
        self, run: dict[str, Any], *, poll_s: float = 1.0, max_wait_s: float | None = None
    ) -> dict[str, Any]:
        """Poll until the run is final (or ``max_wait_s`` has passed: RelayClientError).

        A poll the network or a busy relay failed is simply tried again: reading is safe.
        """
        end = None if max_wait_s is None else time.monotonic() + max_wait_s
        while run.get("state") not in FINAL:
            if end is not None and time.monotonic() >= end:
                raise RelayClientError(
                    f"run {run.get('id')} is still {run.get('state')} after {max_wait_s:g} s"
                )
            time.sleep(poll_s)
            try:
                run = self.get(run["id"])
            except RelayClientError as error:
                if error.status is not None and error.status not in RETRYABLE:
                    raise
        return run

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.wait(self.submit(request))

    def events(self, run_id: str) -> Iterator[dict[str, Any]]:
        """The run's events as they happen (``GET /v1/runs/{id}/events``): ``state``,
        ``output`` (``stream``, ``text``), ``ping``, and last ``run`` (the final run).
        Each connection starts again from the beginning of the run."""
        request = self._prepare("GET", f"/v1/runs/{run_id}/events")
        request.add_header("Accept", "application/x-ndjson")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310
                for line in answer:
                    if line.strip():
                        event = json.loads(line)
                        if isinstance(event, dict):
                            yield event
        except urllib.error.HTTPError as error:
            raise _http_error(error) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise RelayClientError(f"the event stream broke: {reason}") from None

    def follow(
        self,
        run_id: str,
        *,
        stdout: Any = None,
        stderr: Any = None,
        on_output: Any = None,
        attempts: int = 4,
    ) -> dict[str, Any]:
        """Write the run's output to ``stdout``/``stderr`` as it happens and return the final
        run. A broken stream is opened again (after what was already written); a relay
        without the stream is polled, and the rest of the output written at the end."""
        written = {"stdout": 0, "stderr": 0}
        streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}

        def write(stream: str, text: str) -> None:
            if not text:
                return
            if on_output is not None:
                on_output()
            streams[stream].write(text)
            streams[stream].flush()
            written[stream] += len(text)

        said = [0]  # a route's failed attempts told so far (the stream starts over on a break)

        def tell(run: dict[str, Any]) -> dict[str, Any]:
            for line in failed_attempts(run)[said[0] :]:
                write("stderr", line + "\n")
            return run

        delay = 1.0
        for attempt in range(attempts):
            seen = {"stdout": 0, "stderr": 0}
            told = 0
            try:
                for event in self.events(run_id):
                    if event.get("event") == "output" and event.get("stream") in seen:
                        stream, text = event["stream"], str(event.get("text", ""))
                        skip = max(0, written[stream] - seen[stream])  # shown before a break
                        seen[stream] += len(text)
                        write(stream, text[skip:])
                    elif event.get("event") == "attempt":
                        told += 1
                        if told > said[0]:  # one line per failed attempt, on stderr
                            said[0] = told
                            streams["stderr"].write(f"{event.get('message', '')}\n")
                            streams["stderr"].flush()
                    elif event.get("event") == "run" and isinstance(event.get("run"), dict):
                        return tell(dict(event["run"]))
            except RelayClientError as error:
                if error.status in (404, 405) or attempt == attempts - 1:
                    break  # no stream here (an older relay, a proxy): poll instead
                if error.status is not None and error.status not in RETRYABLE:
                    raise
                time.sleep(min(60.0, max(delay, error.retry_after or 0.0)))
                delay *= 2
        run = self.wait(self.get(run_id))
        for stream in ("stdout", "stderr"):
            write(stream, str(run.get(stream) or "")[written[stream] :])
        return tell(run)

    def download_artifacts(
        self, run: dict[str, Any], folder: Path, *, on_skipped: Any = None
    ) -> list[Path]:
        """Download each artifact the run kept into ``folder`` (its name, a relative path,
        under it), streamed to disk and checked against its SHA-256; the paths written.
        ``on_skipped(entry)`` hears of each entry the run did not keep."""
        written = []
        for entry in run.get("artifacts") or []:
            url = entry.get("url")
            if not url:
                if on_skipped is not None:
                    on_skipped(entry)
                continue
            if not str(url).startswith("/v1/runs/"):  # the token goes to the relay only
                raise RelayClientError(f"artifact {entry.get('name')!r} has a foreign url")
            target = artifact_path(folder, str(entry.get("name", "")))
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".part")
            digest = hashlib.sha256()
            request = self._prepare("GET", str(url), headers={"Accept": "*/*"})
            try:
                with (
                    urllib.request.urlopen(request, timeout=self.timeout_s) as answer,  # noqa: S310
                    partial.open("wb") as out,
                ):
                    while chunk := answer.read(1 << 16):
                        digest.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as error:
                partial.unlink(missing_ok=True)
                raise _http_error(error) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                partial.unlink(missing_ok=True)
                raise RelayClientError(
                    f"cannot reach the relay: {getattr(error, 'reason', error)}"
                ) from None
            if digest.hexdigest() != entry.get("sha256"):
                partial.unlink(missing_ok=True)
                raise RelayClientError(f"artifact {target.name}: its bytes do not match its sha256")
            partial.replace(target)
            written.append(target)
        return written

    def cancel(self, run_id: str) -> dict[str, Any]:
        """Cancel a run (``DELETE /v1/runs/{id}``); 409 ``run_finished`` if it ended."""
        return self._request("DELETE", f"/v1/runs/{run_id}")[1]

    def reload_jobs(self) -> dict[str, Any]:
        """Have the relay read its jobs folder again (``POST /v1/jobs/reload``, an admin
        token); ``422 jobs_invalid`` names the file at fault, the last good jobs serve on."""
        return self._request("POST", "/v1/jobs/reload")[1]

    def list_runs(self, **query: Any) -> dict[str, Any]:
        """This token's runs, newest first: ``state``, ``job``, ``limit``, ``cursor``."""
        shown = {key: value for key, value in query.items() if value is not None}
        path = "/v1/runs" + ("?" + urllib.parse.urlencode(shown) if shown else "")
        return self._request("GET", path)[1]


def failed_attempts(run: dict[str, Any]) -> list[str]:
    """One line per provider a run was tried on that did not run it (a route's failover):
    ``e2b: E2B did not create the sandbox in time``."""
    lines = []
    for attempt in run.get("attempts") or []:
        if not isinstance(attempt, dict):
            continue
        error, sandbox = attempt.get("error"), attempt.get("sandbox_id")
        ran = sandbox is not None and sandbox == run.get("sandbox_id")
        if isinstance(error, dict) and not ran:  # the one that ran it: the run's own error
            lines.append(f"{attempt.get('provider')}: {error.get('message', '')}")
    return lines


STANDARD_SECRET_PREFIX = "whsec_"  # noqa: S105  # a prefix, not a secret


def artifact_path(folder: Path, name: str) -> Path:
    """Where an artifact named ``name`` goes under ``folder``; a name that would leave it
    (absolute, ``..``, empty parts, control characters) is refused."""
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
        or any(not char.isprintable() for char in name)
    ):
        raise RelayClientError(f"artifact name {name[:100]!r} is not a relative path")
    return folder.joinpath(*parts)


def standard_webhooks_key(secret: str | bytes) -> bytes:
    """The HMAC key of the Standard Webhooks signature for a relay webhook secret.

    As the Standard Webhooks spec says, a ``whsec_`` secret is the base64 of the key; any
    other secret (the relay's own are plain text) is the key as UTF-8 bytes. A receiver's
    library takes the second kind as bytes: ``Webhook(secret.encode())``, or as the string
    ``"whsec_" + base64(secret)``.
    """
    if isinstance(secret, bytes):
        return secret
    if secret.startswith(STANDARD_SECRET_PREFIX):
        encoded = secret[len(STANDARD_SECRET_PREFIX) :]
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4))
    return secret.encode()


def standard_webhooks_signature(
    secret: str | bytes, message_id: str, stamp: int, body: bytes
) -> str:
    """``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`` (``webhook-signature``)."""
    signed = f"{message_id}.{stamp}.".encode() + body
    digest = hmac.new(standard_webhooks_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_signature(
    secret: str | bytes,
    header: str | typing.Mapping[str, str] | None,
    body: bytes,
    tolerance_s: float = 300.0,
    *,
    now: float | None = None,
) -> bool:
    """True when a delivery signs exactly ``body`` with ``secret`` and its time is within
    ``tolerance_s`` of now; pass the raw request body.

    ``header`` is either the request's headers (any mapping, such as ``self.headers`` of
    ``http.server``): the Standard Webhooks ``webhook-id``, ``webhook-timestamp`` and
    ``webhook-signature`` are checked, else ``Relay-Signature``; or the ``Relay-Signature``
    value alone (``t=…,v1=…``).

    Receivers should also ignore a delivery id (``webhook-id``, the same as
    ``Relay-Delivery-Id``) they have already handled: a delivery is retried until it is
    answered with a 2xx.
    """
    moment = time.time() if now is None else now
    if header is not None and not isinstance(header, str):
        headers = {str(key).lower(): value for key, value in header.items()}
        if headers.get("webhook-signature"):
            return _verify_standard(secret, headers, body, tolerance_s, moment)
        header = headers.get("relay-signature")
    if not header:
        return False
    stamp: int | None = None
    signatures: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isascii() and value.isdigit():  # "²" is a digit to isdigit
            stamp = int(value)
        elif key == "v1":
            signatures.append(value)
    if stamp is None or not signatures:
        return False
    if abs(moment - stamp) > tolerance_s:
        return False
    key_bytes = secret.encode() if isinstance(secret, str) else secret
    expected = hmac.new(key_bytes, f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(expected, candidate) for candidate in signatures)


def _verify_standard(
    secret: str | bytes, headers: dict[str, str], body: bytes, tolerance_s: float, now: float
) -> bool:
    message_id = headers.get("webhook-id", "")
    stamp_text = headers.get("webhook-timestamp", "")
    if not message_id or not (stamp_text.isascii() and stamp_text.isdigit()):
        return False
    stamp = int(stamp_text)
    if abs(now - stamp) > tolerance_s:
        return False
    expected = standard_webhooks_signature(secret, message_id, stamp, body).encode()
    candidates = headers["webhook-signature"].split()  # several, space-separated
    return any(hmac.compare_digest(expected, candidate.encode()) for candidate in candidates)


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """``key=text`` is a string; ``key:=json`` is a JSON value (number, bool, list)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        if ":=" in pair and pair.index(":=") < pair.index("=") + 1:
            key, raw = pair.split(":=", 1)
            try:
                params[key] = json.loads(raw)
            except ValueError:
                raise ValueError(
                    f"param {key!r}: {raw!r} is not JSON; use {key}:=3, {key}:=true, "
                    f'{key}:=\'["a","b"]\', or {key}=text for a string'
                ) from None
        elif "=" in pair:
            key, value = pair.split("=", 1)
            params[key] = value
        else:
            raise ValueError(f"param {pair!r}: use key=value or key:=json")
    return params


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``--env K=V`` pairs."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key:
            raise ValueError(f"--env {pair!r}: use NAME=value")
        env[key] = value
    return env


def read_files(specs: list[str]) -> dict[str, str]:
    """``--file PATH[=DEST]``: the local file's text, sent as ``DEST`` (default: its name)."""
    files: dict[str, str] = {}
    for spec in specs:
        local, _, dest = spec.partition("=")
        try:
            files[dest or Path(local).name] = Path(local).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--file {local}: cannot be read as text ({error})") from None
    return files


def read_stdin(source: str) -> str:
    """``--stdin FILE`` or ``--stdin -`` (this process's own stdin)."""
    try:
        return sys.stdin.read() if source == "-" else Path(source).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--stdin {source}: cannot be read as text ({error})") from None


def dotenv(path: Path = Path(".env")) -> dict[str, str]:
    """``KEY=value`` lines of a ``.env`` file (``#`` comments, ``export``, quotes)."""
    found: dict[str, str] = {}
    try:
        lines = path.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return found
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.removeprefix("export ").split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def setting(name: str, default: str | None = None) -> str | None:
    """A caller's setting (``RELAY_URL``, ``RELAY_TOKEN``…): the environment, else ``.env``."""
    value = os.environ.get(name)
    if value is None:
        value = dotenv().get(name)
    return default if value is None else value


def client_from_environment(args: argparse.Namespace | None = None) -> Client:
    """A client for ``RELAY_URL`` with ``RELAY_TOKEN`` (environment, else ``.env``);
    ValueError when there is no token and ``--no-auth-header`` was not given."""
    no_auth = bool(getattr(args, "no_auth_header", False))
    token = None if no_auth else setting("RELAY_TOKEN")
    if token is None and not no_auth:
        raise ValueError(
            "set RELAY_TOKEN (in the environment or .env), or pass --no-auth-header "
            "when a proxy adds the token"
        )
    url = getattr(args, "url", None) or setting("RELAY_URL", "http://127.0.0.1:8080")
    if urllib.parse.urlsplit(str(url)).scheme not in ("http", "https"):
        # urllib would say "unknown url type" or look a host up for ftp://
        raise ValueError("RELAY_URL (or --url) must start with https:// or http://")
    header = getattr(args, "auth_header", None) or setting("RELAY_AUTH_HEADER", "Authorization")
    return Client(str(url), token, auth_header=str(header))


def exit_code(run: dict[str, Any]) -> int:
    """A finished run's exit code: the job's own, else by how it ended (:data:`EXIT_CODES`)."""
    state = run.get("state")
    if state == "succeeded":
        return 0
    if state == "failed":
        return int(run.get("exit_code") or 1)  # a failed run with no code still failed
    if state == "timed_out":
        return EXIT_TIMED_OUT
    if state == "canceled":
        return EXIT_CANCELED
    return EXIT_UNAVAILABLE  # error, lost


def error_exit_code(error: RelayClientError) -> int:
    """The exit code for a refusal or failure (:data:`EXIT_CODES`), from its status."""
    status = error.status
    if status is None or not 400 <= status < 500:  # unreachable, 5xx, or not the relay
        return EXIT_UNAVAILABLE
    if status in (401, 403, 407):
        return EXIT_AUTH
    if status == 404 or error.code == "unknown_job":
        return EXIT_NOT_FOUND
    if status == 429:
        return EXIT_LIMIT
    return EXIT_USAGE


def exit_codes_text() -> str:
    """The exit codes, for a command's ``--help``."""
    lines = ["exit codes (the job's own when it ran and failed):"]
    lines += [f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items()]
    return "\n".join(lines)


CANCEL_WINDOW_S = 3.0
"""After a first Ctrl-C, a second one within this many seconds cancels the run."""


def interrupted(client: Client, run_id: str, prog: str) -> int:
    """The first Ctrl-C while following: say how to follow or cancel the run, and cancel
    it if a second Ctrl-C comes within :data:`CANCEL_WINDOW_S`."""
    follow = "relay run --attach" if prog.startswith("relay") else f"{prog} --attach"
    cancel = "relay runs cancel" if prog.startswith("relay") else "curl -X DELETE …/v1/runs/"
    try:  # a second Ctrl-C may come as soon as the words are out
        print(
            f"\nrun {run_id} is still going. Follow it: {follow} {run_id}   "
            f"Cancel it: {cancel} {run_id}\n"
            f"(Ctrl-C again within {CANCEL_WINDOW_S:g} s cancels it now)",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(CANCEL_WINDOW_S)
    except KeyboardInterrupt:
        try:
            client.cancel(run_id)
        except RelayClientError as error:
            print(f"error: cancel of {run_id} failed: {error}", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"canceled {run_id}", file=sys.stderr)
    return EXIT_INTERRUPTED


class OneLineParser(argparse.ArgumentParser):
    """Usage mistakes are one ``error: …`` line naming the help to read, exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def arguments(prog: str = "client.py", *, raw: bool = False) -> argparse.ArgumentParser:
    """The client's options; ``raw``: for a raw command only (``relay exec``), no job."""
    what = "Run a raw command (tokens with the command scope)" if raw else "Run a declared job"
    parser = OneLineParser(
        prog=prog,
        usage=f"{prog} [OPTIONS] -- ARGV..." if raw else None,
        description=textwrap.fill(
            f"{what} on a relay and print its output as it happens. "
            "RELAY_URL and RELAY_TOKEN come from the environment, else from .env."
            + ("" if raw else f" A raw command (command scope) goes after --: {prog} -- ls -la"),
            width=78,
        ),
        epilog=exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if not raw:
        parser.add_argument("job", nargs="?", help="the job to run (or --attach RUN_ID)")
        parser.add_argument(
            "-p",
            "--param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a string param; KEY:=JSON for numbers, booleans, lists",
        )
    parser.add_argument("--stdin", metavar="FILE|-", help="send this file (or - for this "
                        "process's stdin) as the job's stdin")  # fmt: skip
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="an environment variable for the job (repeat)")  # fmt: skip
    parser.add_argument("--file", action="append", default=[], metavar="PATH[=DEST]",
                        help="upload a text file into the job's workdir (repeat)")  # fmt: skip
    parser.add_argument("--url", help="the relay (default: RELAY_URL, else http://127.0.0.1:8080)")
    parser.add_argument(
        "--no-auth-header", action="store_true", help="send no token: a network secret adds it"
    )
    parser.add_argument(
        "--auth-header",
        help="header for RELAY_TOKEN (default: RELAY_AUTH_HEADER, else Authorization); "
        "any name but Authorization carries the token raw",
    )
    parser.add_argument("--idempotency-key", help="reuse a key across runs of this script")
    parser.add_argument("--no-wait", action="store_true", help="print the accepted run, exit 0")
    if not raw:
        parser.add_argument("--attach", "--run", dest="attach", metavar="RUN_ID",
                            help="follow a run submitted before")  # fmt: skip
    parser.add_argument(
        "--max-wait-s",
        type=float,
        default=3600.0,
        help="how long to follow a run before giving up (default 3600; the run goes on)",
    )
    parser.add_argument(
        "--attempts", type=int, default=4, help="tries of a submit the network or relay failed"
    )
    parser.add_argument("--json", action="store_true", help="print the whole run as JSON")
    parser.add_argument(
        "--artifacts",
        metavar="DIR",
        help="once the run ends, download the files its job declared (its artifacts) into DIR",
    )
    parser.add_argument("--artifact", action="append", default=[], metavar="PATH|GLOB",
                        help="keep this file of the workdir too (repeat; a job must allow "
                        "`artifacts`)")  # fmt: skip
    return parser


def request_body(args: argparse.Namespace, command: list[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command} if command else {"job": args.job}
    if args.param:
        body["params"] = parse_params(args.param)
    elif not command:
        body["params"] = {}
    if args.stdin is not None:
        body["stdin"] = read_stdin(args.stdin)
    if args.env:
        body["env"] = parse_env(args.env)
    if args.file:
        body["files"] = read_files(args.file)
    if args.artifact:
        body["artifacts"] = list(args.artifact)
    return body


def stdout_closed() -> int:
    """What a command does when whoever read its output went away (``| head``): no
    traceback, nothing more written, and the exit code of a program ended by SIGPIPE."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_STDOUT_CLOSED


def main(argv: list[str] | None = None, *, prog: str = "client.py", raw: bool = False) -> int:
    """Run the client; ``raw``: a raw command only (``relay exec``)."""
    try:
        code = _main(argv, prog, raw)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a printed traceback
    except BrokenPipeError:
        return stdout_closed()
    return code


def _main(argv: list[str] | None, prog: str, raw: bool) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] | None = None
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = arguments(prog, raw=raw)
    args = parser.parse_args(argv)
    if raw:
        args.job = args.attach = None
        args.param = []
    given = [bool(args.job), bool(args.attach), bool(command)]
    if sum(given) != 1:
        wanted = "a command after --" if raw else "a JOB, --attach RUN_ID, or a command after --"
        print(f"error: give {wanted} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    run: dict[str, Any] = {}
    try:
        client = client_from_environment(args)
        body = None if args.attach else request_body(args, command)
        spinner = Spinner(args.job or args.attach or (command or [""])[0])
        with spinner:
            if body is not None:
                body["wait"] = not args.no_wait and args.json  # --json: no live output
                run = client.submit(
                    body, idempotency_key=args.idempotency_key, attempts=max(1, args.attempts)
                )
            else:
                run = client.get(args.attach)
            if args.no_wait:
                print(json.dumps(run, indent=2))
                return 0
            if args.json:
                run = client.wait(run, max_wait_s=args.max_wait_s)
            elif run.get("state") in FINAL:
                spinner.stop()
                for line in failed_attempts(run):
                    print(line, file=sys.stderr)
                sys.stdout.write(run.get("stdout", ""))
                sys.stderr.write(run.get("stderr", ""))
            else:
                run = client.follow(run["id"], on_output=spinner.stop)
    except KeyboardInterrupt:
        if run.get("id") and run.get("state") not in FINAL:
            return interrupted(client, str(run["id"]), prog)
        return EXIT_INTERRUPTED
    except RelayClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return error_exit_code(error)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(run, indent=2))
    if args.artifacts and run.get("state") in FINAL:
        try:
            saved(client.download_artifacts(run, Path(args.artifacts), on_skipped=skipped))
        except RelayClientError as error:
            print(f"error: {error}", file=sys.stderr)
            return error_exit_code(error)
    return finished(run)


def saved(paths: list[Path]) -> None:
    for path in paths:
        print(f"saved {path}", file=sys.stderr)


def skipped(entry: dict[str, Any]) -> None:
    print(f"not kept: {entry.get('name')}: {entry.get('skipped') or 'skipped'}", file=sys.stderr)


def finished(run: dict[str, Any]) -> int:
    """Say why a run that did not run to its end ended (one ``error:`` line), and return
    its exit code (:func:`exit_code`)."""
    if run.get("state") not in ("succeeded", "failed"):
        why = run.get("error") or {}
        print(
            f"error: run {run.get('id')} {run.get('state')}: {why.get('message', '')}",
            file=sys.stderr,
        )
    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
