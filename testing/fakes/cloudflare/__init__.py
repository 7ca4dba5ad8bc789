"""A protocol-level fake of the relay's job Worker for Cloudflare (deploy/cloudflare).

It answers the Worker's HTTP contract, ``deploy/cloudflare/openapi.yaml`` (version 1.2.0),
and nothing else: request bodies are checked against that document's ``JobRequest`` and
``RunRequest``, and tests/providers/test_fake_cloudflare.py checks every answer against it,
the document the Worker's own tests (deploy/cloudflare/test) assert against too. Where the
document leaves behaviour open, the fake does what the Worker's source does
(deploy/cloudflare/src) with ``@cloudflare/sandbox`` 0.12.10: one job per id, idempotent
create; a one-shot job's command run at once and its container destroyed when it ends; a
two-step job's container ``ready`` before the create answers, its one run (a retry is the
same run), its container kept after the command until a DELETE or the deadline, its files
listed and read meanwhile (``files.py``); a deadline
alarm at ``created + timeout_s + grace_s``, a DELETE that answers 200 only once the destroy
is done (202 otherwise), a listing of live jobs by tag, output as NDJSON. Commands are real
processes in a private directory per job, under bubblewrap where it works (no network when
egress is ``[]``)::

    from testing.fakes.cloudflare import KEY, running_fake
    with running_fake() as fake:
        headers = {"authorization": f"Bearer {KEY}"}
        httpx.post(f"{fake.url}/v1/jobs", json=job, headers=headers)
        httpx.post(f"{fake.url}/v1/jobs/{job_id}/run", json=command, headers=headers)
        fake.ledger.alive()            # jobs whose container is not destroyed
        fake.faults.create_hang = True
        fake.call("vanish", "run_x")   # the Worker restarted under a command: lost

Only :data:`KEY` is accepted (401 otherwise, ``bad-key`` included); ``running_fake(key=None)``
is a Worker whose secret was never set (403 for everything); ``running_fake(open_auth=True)``
one that answers without a key at all (what the relay must refuse to use).
"""

from testing.fakes.cloudflare.app import BAD_KEY, BODY_MARKER
from testing.fakes.cloudflare.ledger import Faults, Ledger
from testing.fakes.cloudflare.server import KEY, FakeCloudflare, running_fake

__all__ = ["BAD_KEY", "BODY_MARKER", "KEY", "FakeCloudflare", "Faults", "Ledger", "running_fake"]
