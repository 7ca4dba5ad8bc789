"""A protocol-level fake of E2B (control plane + envd) for the real ``e2b`` SDK (2.63.0).

``running_fake()`` serves it on 127.0.0.1 in a background thread; ``fake.url`` goes into
both ``e2b_api_url`` and ``e2b_sandbox_url``. ``fake.ledger`` is the ground truth tests
read; ``fake.faults`` injects failures. Any API key works except ``bad-key`` (401).
"""

from __future__ import annotations

from tests.fakes.e2b.server import FakeE2B, running_fake
from tests.fakes.e2b.world import Faults, Ledger

__all__ = ["FakeE2B", "Faults", "Ledger", "running_fake"]
