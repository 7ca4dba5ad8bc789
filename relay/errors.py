"""The relay's one error tree.

Every failure a caller can see is a :class:`RelayError`. Each class carries the HTTP
status and the stable ``code`` that ``app.py`` turns into
``{"error": {"code", "message", "request_id"}}``. Messages are written by the relay;
a provider's response body, headers or keys are never copied into one.

::

    RelayError (500 internal)
    ├── InvalidRequest (400 invalid_request)
    │   └── InvalidJson (400 invalid_json)
    ├── Unauthorized (401 unauthorized)
    │   └── TokenExpired (401 token_expired)
    ├── Forbidden (403 forbidden)
    ├── NotFound (404 not_found)
    ├── MethodNotAllowed (405 method_not_allowed)
    ├── IdempotencyConflict (409 idempotency_conflict)
    ├── RunNotCancelable (409 run_finished)
    ├── BodyTooLarge (413 body_too_large)
    ├── HeadersTooLarge (431 headers_too_large) -- answered by the connection (http/connections.py)
    ├── UnsupportedMediaType (415 unsupported_media_type)
    ├── ValidationFailed (422 validation_error)
    │   ├── UnknownJob (422 unknown_job)
    │   ├── InvalidParams (422 invalid_params)
    │   ├── FileConflict (422 file_conflict)
    │   ├── EnvConflict (422 env_conflict)
    │   ├── EgressUnsupported (422 egress_unsupported)
    │   ├── SizeUnsupported (422 size_unsupported)
    │   ├── ProviderNotEnabled (422 provider_not_enabled)
    │   ├── NoRoute (422 no_route)
    │   ├── CallbackRefused (422 callback_refused)
    │   └── JobsInvalid (422 jobs_invalid)
    ├── RateLimited (429 rate_limited)
    │   └── BudgetExceeded (429 budget_exceeded)
    ├── ShuttingDown (503 shutting_down)
    ├── StoreUnavailable (503 store_unavailable)
    ├── FileUnreadable (422 file_unreadable) -- why an artifact was skipped, never an answer
    ├── ProviderError (502 provider_error)
    │   ├── ImageNotFound (502 provider_error) -- the run's own image: no breaker counts it
    │   ├── ProviderAuth (502 provider_auth)
    │   ├── SandboxLost (502 sandbox_lost)
    │   ├── ProviderRateLimited (503 provider_rate_limited)
    │   ├── ProviderUnavailable (503 provider_unavailable)
    │   └── ProviderTimeout (504 provider_timeout)
    └── ConfigError (500 config_error) -- raised at startup, never over HTTP
"""

from __future__ import annotations

from typing import Any, ClassVar


class RelayError(Exception):
    """Base of every error the relay reports; ``status`` and ``code`` are stable API."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    default_message: ClassVar[str] = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.retry_after = retry_after
        self.details = details or {}
        self.headers = dict(headers or {})
        super().__init__(self.message)

    def response_headers(self) -> dict[str, str]:
        """Headers the HTTP answer carries (``Retry-After`` and any extra ones)."""
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return headers


class InvalidRequest(RelayError):
    status, code, default_message = 400, "invalid_request", "the request is malformed"


class InvalidJson(InvalidRequest):
    code, default_message = "invalid_json", "the body is not valid JSON"


class Unauthorized(RelayError):
    """No token, or one the relay does not take. Its answer names the scheme to use in
    ``WWW-Authenticate`` (RFC 9110 §11.6.1: every 401 carries a challenge), with
    ``error="invalid_token"`` where a token was sent and refused (RFC 6750 §3.1): a client
    or a proxy that reads the challenge knows to send (or renew) a bearer token."""

    status, code, default_message = 401, "unauthorized", "a valid token is required"
    invalid_token: bool = False
    """Whether a token was sent and refused (a class's own; ``token_refused`` for one)."""

    @classmethod
    def token_refused(cls, message: str) -> Unauthorized:
        """A token was sent and is not one the relay takes."""
        error = cls(message)
        error.invalid_token = True
        return error

    def response_headers(self) -> dict[str, str]:
        headers = super().response_headers()
        challenge = CHALLENGE + (', error="invalid_token"' if self.invalid_token else "")
        headers.setdefault("WWW-Authenticate", challenge)
        return headers


CHALLENGE = 'Bearer realm="relay"'
"""What a 401 asks for: the relay's bearer token (its header aside: RELAY_AUTH_HEADER)."""


class TokenExpired(Unauthorized):
    """A token past its ``expires``, or a rotated token's old value past its overlap."""

    code, default_message = "token_expired", "the token has expired"
    invalid_token = True


class Forbidden(RelayError):
    status, code, default_message = 403, "forbidden", "this token may not do that"


class NotFound(RelayError):
    status, code, default_message = 404, "not_found", "no such resource"


class ArtifactGone(RelayError):
    """The run lists the artifact but its contents are no longer where they were kept (an
    object deleted from the bucket behind the relay's back, or a bucket not configured)."""

    status, code = 410, "artifact_gone"
    default_message = "this artifact's contents are no longer stored"


class MethodNotAllowed(RelayError):
    status, code, default_message = 405, "method_not_allowed", "method not allowed"


class IdempotencyConflict(RelayError):
    status, code = 409, "idempotency_conflict"
    default_message = "this Idempotency-Key was used with a different request"


class RunNotCancelable(RelayError):
    status, code, default_message = 409, "run_finished", "the run has already finished"


class BodyTooLarge(RelayError):
    status, code, default_message = 413, "body_too_large", "the request body is too large"


class HeadersTooLarge(RelayError):
    """A request's headers over a cap (their bytes, their fields, a chunked body's framing
    with no body bytes): answered by the connection, not by a route
    (relay/http/connections.py)."""

    status, code = 431, "headers_too_large"
    default_message = "the request's headers are too large"


class UnsupportedMediaType(RelayError):
    status, code = 415, "unsupported_media_type"
    default_message = "send the body as JSON with Content-Type: application/json"


class ValidationFailed(RelayError):
    status, code, default_message = 422, "validation_error", "the request is not valid"


class UnknownJob(ValidationFailed):
    code, default_message = "unknown_job", "no such job"


class InvalidParams(ValidationFailed):
    code, default_message = "invalid_params", "the params do not match the job"


class FileConflict(ValidationFailed):
    code = "file_conflict"
    default_message = "a request file would replace one of the job's own files"


class EnvConflict(ValidationFailed):
    code = "env_conflict"
    default_message = "a request variable would replace one the job or the relay sets"


class EgressUnsupported(ValidationFailed):
    code = "egress_unsupported"
    default_message = "the provider cannot enforce this egress policy"


class SizeUnsupported(ValidationFailed):
    code, default_message = "size_unsupported", "the provider cannot give this size"


class ProviderNotEnabled(ValidationFailed):
    code, default_message = "provider_not_enabled", "that provider is not enabled"


class NoRoute(ValidationFailed):
    """No provider of the run's route can take it (its size, its egress, the token's
    providers, a provider's own check): the message names each provider's reason."""

    code = "no_route"
    default_message = "no provider on the route can take this run"


class CallbackRefused(ValidationFailed):
    code, default_message = "callback_refused", "the callback URL is not allowed"


class JobsInvalid(ValidationFailed):
    """A jobs folder that does not load: a reload refused it, the last good jobs serve on."""

    code, default_message = "jobs_invalid", "the jobs folder does not load"


class RateLimited(RelayError):
    status, code, default_message = 429, "rate_limited", "too many runs; retry later"


class BudgetExceeded(RateLimited):
    code, default_message = "budget_exceeded", "the token's spend budget is used up"


class TooManyStreams(RateLimited):
    code, default_message = "too_many_streams", "this token has too many event streams open"


class ShuttingDown(RelayError):
    status, code, default_message = 503, "shutting_down", "the relay is shutting down"


class StoreUnavailable(RelayError):
    """The relay's database refused or did not answer (down, restarting, disk full)."""

    status, code = 503, "store_unavailable"
    default_message = "the relay's database is unavailable; retry later"


class FileUnreadable(RelayError):
    """A path in a sandbox that its provider's file API will not read as a file (not there,
    a folder, a link, a special file, too large for an API that reads whole files): the
    reason an artifact is listed as skipped, in the relay's own words. Never an answer."""

    status, code, default_message = 422, "file_unreadable", "the file could not be read"


class ProviderError(RelayError):
    """A fault at or on the way to the sandbox provider (never carries its body)."""

    status, code, default_message = 502, "provider_error", "the provider failed"


class ProviderRefused(ProviderError):
    """The provider refused what the run asked for with an answer in the 4xx range the
    adapter has no name for (not a refused key, not a rate limit, not a lost sandbox): as
    far as the relay can tell, the run's own fault, which a request can repeat at will, so
    it never counts against the provider's breaker (relay/runs/breakers.py); a route still
    tries the next provider."""

    default_message = "the provider refused the request"


class ImageNotFound(ProviderRefused):
    """The provider has no image (template, snapshot) of the name the run asked for."""

    default_message = "the provider has no such image"


class ProviderAuth(ProviderError):
    code, default_message = "provider_auth", "the provider refused the relay's credentials"


class SandboxLost(ProviderError):
    code, default_message = "sandbox_lost", "the sandbox disappeared during the run"


class ProviderRateLimited(ProviderError):
    status, code = 503, "provider_rate_limited"
    default_message = "the provider is rate limiting; retry later"


class ProviderUnavailable(ProviderError):
    status, code, default_message = 503, "provider_unavailable", "the provider is unavailable"


class ProviderTimeout(ProviderError):
    status, code, default_message = 504, "provider_timeout", "the provider did not answer in time"


class ConfigError(RelayError):
    """A bad setting, token file or job manifest; stops startup with the place named."""

    code, default_message = "config_error", "invalid configuration"


ERROR_CLASSES: tuple[type[RelayError], ...] = (
    RelayError,
    InvalidRequest,
    InvalidJson,
    Unauthorized,
    TokenExpired,
    Forbidden,
    NotFound,
    ArtifactGone,
    MethodNotAllowed,
    IdempotencyConflict,
    RunNotCancelable,
    BodyTooLarge,
    HeadersTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
    UnknownJob,
    InvalidParams,
    FileConflict,
    EnvConflict,
    EgressUnsupported,
    SizeUnsupported,
    ProviderNotEnabled,
    NoRoute,
    CallbackRefused,
    JobsInvalid,
    RateLimited,
    BudgetExceeded,
    TooManyStreams,
    ShuttingDown,
    StoreUnavailable,
    ProviderError,
    ProviderAuth,
    SandboxLost,
    ProviderRateLimited,
    ProviderUnavailable,
    ProviderTimeout,
)
"""Every class that can reach an HTTP answer, for the OpenAPI document."""


def error_for_code(code: str) -> type[RelayError]:
    """The class for a stored error code (runs keep the code, not the object)."""
    for cls in ERROR_CLASSES:
        if cls.code == code:
            return cls
    return RelayError
