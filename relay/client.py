"""A relay client in one file, standard library only: copy it into any repo.

    python client.py JOB -p message=hi            # RELAY_URL, RELAY_TOKEN from the env
    python client.py JOB -p count:=3 --no-auth-header   # a network secret adds the header
    python client.py JOB --no-wait                # print the accepted run (JSON), exit 0
    python client.py --run RUN_ID                 # wait for a run submitted before
    RELAY_AUTH_HEADER=X-Api-Key python client.py JOB   # the token goes raw in that header

Exits with the job's exit code; 124 when the job timed out; 2 (printing ``error: …``)
when the relay or the network failed. A retried submit reuses one Idempotency-Key, so
it never starts a second sandbox. On an auth error the response body is never printed.

A webhook receiver checks each callback with ``verify_signature(secret, header, body)``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

FINAL = {"succeeded", "failed", "timed_out", "canceled", "error", "lost"}
RETRYABLE = {429, 502, 503, 504}
MAX_MESSAGE_CHARS = 300


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


def _http_error(error: urllib.error.HTTPError) -> RelayClientError:
    """What an error answer may show: the relay's own code and message, nothing else."""
    if error.code in (401, 403, 407):
        # Never echo what came back with an auth failure (a proxy's page may quote a key).
        return RelayClientError(
            f"the relay (or a proxy before it) refused the request: HTTP {error.code}",
            error.code,
        )
    try:
        payload = json.loads(error.read() or b"{}")
    except ValueError:
        payload = {}
    detail = payload.get("error") if isinstance(payload, dict) else None
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
        if self.enabled:
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

    def _request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
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


def verify_signature(
    secret: str | bytes,
    header: str | None,
    body: bytes,
    tolerance_s: float = 300.0,
    *,
    now: float | None = None,
) -> bool:
    """True when ``header`` (``Relay-Signature: t=…,v1=…``) signs exactly ``body`` with
    ``secret`` and its time is within ``tolerance_s`` of now; pass the raw request body.

    Receivers should also ignore a ``Relay-Delivery-Id`` they have already handled:
    a delivery is retried until it is answered with a 2xx.
    """
    if not header:
        return False
    stamp: int | None = None
    signatures: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isdigit():
            stamp = int(value)
        elif key == "v1":
            signatures.append(value)
    if stamp is None or not signatures:
        return False
    if abs((time.time() if now is None else now) - stamp) > tolerance_s:
        return False
    key_bytes = secret.encode() if isinstance(secret, str) else secret
    expected = hmac.new(key_bytes, f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(expected, candidate) for candidate in signatures)


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """``key=text`` is a string; ``key:=json`` is a JSON value (number, bool, list)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        if ":=" in pair and pair.index(":=") < pair.index("=") + 1:
            key, raw = pair.split(":=", 1)
            params[key] = json.loads(raw)
        elif "=" in pair:
            key, value = pair.split("=", 1)
            params[key] = value
        else:
            raise ValueError(f"param {pair!r}: use key=value or key:=json")
    return params


def exit_code(run: dict[str, Any]) -> int:
    state = run.get("state")
    if state in ("succeeded", "failed"):
        return int(run.get("exit_code") or 0) if state == "failed" else 0
    if state == "timed_out":
        return 124
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a declared job on a relay.")
    parser.add_argument("job", nargs="?", help="the job to run (or --run RUN_ID)")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--url", default=os.environ.get("RELAY_URL", "http://127.0.0.1:8080"))
    parser.add_argument(
        "--no-auth-header", action="store_true", help="send no token: a network secret adds it"
    )
    parser.add_argument(
        "--auth-header",
        default=os.environ.get("RELAY_AUTH_HEADER", "Authorization"),
        help="header for RELAY_TOKEN; any name but Authorization carries it raw",
    )
    parser.add_argument("--idempotency-key", help="reuse a key across runs of this script")
    parser.add_argument("--no-wait", action="store_true", help="print the accepted run, exit 0")
    parser.add_argument("--run", metavar="RUN_ID", help="wait for a run submitted before")
    parser.add_argument("--max-wait-s", type=float, default=3600.0)
    parser.add_argument(
        "--attempts", type=int, default=4, help="tries of a submit the network or relay failed"
    )
    parser.add_argument("--json", action="store_true", help="print the whole run as JSON")
    args = parser.parse_args(argv)
    if (args.job is None) == (args.run is None):
        parser.error("give a JOB or --run RUN_ID")
    token = None if args.no_auth_header else os.environ.get("RELAY_TOKEN")
    if token is None and not args.no_auth_header:
        print("error: set RELAY_TOKEN, or pass --no-auth-header", file=sys.stderr)
        return 2
    client = Client(args.url, token, auth_header=args.auth_header)
    try:
        with Spinner(args.job or args.run):
            if args.run:
                run = client.get(args.run)
            else:
                body = {"job": args.job, "params": parse_params(args.param)}
                if args.no_wait:
                    body["wait"] = False
                run = client.submit(
                    body, idempotency_key=args.idempotency_key, attempts=max(1, args.attempts)
                )
            if not args.no_wait:
                run = client.wait(run, max_wait_s=args.max_wait_s)
    except (RelayClientError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json or args.no_wait:
        print(json.dumps(run, indent=2))
        if args.no_wait:
            return 0
    else:
        sys.stdout.write(run.get("stdout", ""))
        sys.stderr.write(run.get("stderr", ""))
    if run.get("state") not in ("succeeded", "failed"):
        why = run.get("error") or {}
        print(
            f"error: run {run.get('id')} {run.get('state')}: {why.get('message', '')}",
            file=sys.stderr,
        )
    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
