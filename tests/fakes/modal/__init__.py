"""A protocol-level fake of Modal's servers for the ``modal`` client (pinned: modal==1.6.4).

The real client talks gRPC to it over loopback: the control plane (apps, images, tokens,
``Sandbox*V2``) and the per-sandbox task command router (execs, stdio, waits) share one
port. Sandboxes are private temp directories; execs are real subprocesses in their own
process groups.

::

    with running_fake() as fake:
        settings = Settings(modal_server_url=fake.url, modal_token_id="x", ...)
        fake.faults.create_status = 429
        fake.ledger.alive()
"""

from __future__ import annotations

from tests.fakes.modal.server import FakeModal, running_fake
from tests.fakes.modal.state import Faults, Ledger

__all__ = ["FakeModal", "Faults", "Ledger", "running_fake"]
