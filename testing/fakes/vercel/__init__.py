"""A protocol-level fake of the Vercel Sandbox API, for the real ``vercel-sandbox`` SDK.

Follows: ``shared/reference/vercel.md`` (vercel-sandbox 0.10.0, the version the relay pins;
its API models are the schema the fake answers): the list is ``{sandboxes, pagination:
{count, next, prev}}`` with each sandbox's ``name`` and ``currentSessionId``; an unknown
sandbox is 404; a command's env is added to the sandbox's and the default environment; a
sandbox ends at its time limit. ``tests/fakes/test_vercel_documented.py`` checks those shapes.

It speaks the REST and NDJSON calls that ``vercel.sandbox`` 0.10.0 makes (create, get,
list, stop, destroy, run-and-stream, logs, wait, stdin, kill, file write/mkdir/read),
runs commands as real local processes in a private directory per sandbox, enforces each
sandbox's time limit itself, keeps a ledger and injects faults::

    from testing.fakes.vercel import running_fake
    with running_fake() as fake:
        settings = Settings(vercel_base_url=fake.url, vercel_token="t", ...)
        fake.ledger.alive()          # sandboxes whose session runs now
        fake.faults.create_status = 429

Any bearer token is accepted except ``bad-key`` (answers 401). With bubblewrap, a
``deny-all`` network policy is enforced (private network namespace); custom allow-lists
are recorded, not enforced.
"""

from testing.fakes.vercel.app import BAD_KEY, BODY_MARKER
from testing.fakes.vercel.ledger import Faults, Ledger
from testing.fakes.vercel.server import FakeVercel, running_fake

__all__ = ["BAD_KEY", "BODY_MARKER", "FakeVercel", "Faults", "Ledger", "running_fake"]
