"""A protocol-level fake of E2B (control plane + envd) for the real ``e2b`` SDK (2.63.0).

Follows: ``shared/reference/e2b.md`` (e2b 2.63.0, the version the relay pins) for the wire,
and E2B's public API spec (``spec/openapi.yml`` of e2b-dev/infra) for what the server
answers: a listed sandbox carries the documented fields only, the list's ``limit`` is 1 to
100 (else 400), an unknown sandbox is 404, a sandbox ends at its timeout, and a command's
``envs`` are added to the sandbox's ``envVars`` and its default environment.
``tests/fakes/test_e2b_documented.py`` checks those shapes. Files are read back as envd
2.63's SDK reads them: ``filesystem.Filesystem/ListDir`` (Connect, JSON codec, an
``EntryInfo`` per entry as in the SDK's ``filesystem_pb``) and ``GET /files?path=``.

``running_fake()`` serves it on 127.0.0.1 in a background thread; ``fake.url`` goes into
both ``e2b_api_url`` and ``e2b_sandbox_url``. ``fake.ledger`` is the ground truth tests
read; ``fake.faults`` injects failures. Any API key works except ``bad-key`` (401).
"""

from __future__ import annotations

from testing.fakes.e2b.server import FakeE2B, running_fake
from testing.fakes.e2b.world import Faults, Ledger

__all__ = ["FakeE2B", "Faults", "Ledger", "running_fake"]
