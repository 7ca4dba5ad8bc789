"""A protocol-level fake of the relay's job Worker for Cloudflare (deploy/cloudflare).

It answers the Worker's HTTP contract, ``deploy/cloudflare/openapi.yaml`` (version 1.0.0),
and nothing else: request bodies are checked against that document's ``JobRequest``, and
tests/providers/test_fake_cloudflare.py checks every answer against it, the document the
Worker's own tests (deploy/cloudflare/test) assert against too. Where the document leaves
behaviour open, the fake does what the Worker's source does (deploy/cloudflare/src) with
``@cloudflare/sandbox`` 0.12.10: one job per id, idempotent create, the command run at once
and its container destroyed when it ends, a deadline alarm at ``created + timeout_s +
grace_s``, a DELETE that answers 200 only once the destroy is done (202 otherwise), a
listing of live jobs by tag, output as NDJSON. Commands are real processes in a private
directory per job, under bubblewrap where it works (no network when egress is ``[]``)::

    from testing.fakes.cloudflare import KEY, running_fake
    with running_fake() as fake:
        httpx.post(f"{fake.url}/v1/jobs", json=job, headers={"authorization": f"Bearer {KEY}"})
        fake.ledger.alive()            # jobs whose container is not destroyed
        fake.faults.create_hang = True
        fake.call("vanish", "run_x")   # the Worker restarted under a command: lost

Only :data:`KEY` is accepted (401 otherwise, ``bad-key`` included); ``running_fake(key=None)``
is a Worker whose secret was never set (403 for everything).
"""

from testing.fakes.cloudflare.app import BAD_KEY, BODY_MARKER
from testing.fakes.cloudflare.ledger import Faults, Ledger
from testing.fakes.cloudflare.server import KEY, FakeCloudflare, running_fake

__all__ = ["BAD_KEY", "BODY_MARKER", "KEY", "FakeCloudflare", "Faults", "Ledger", "running_fake"]
