"""A protocol-level fake of Modal's servers for the ``modal`` client (pinned: modal==1.6.4).

Follows: ``shared/reference/modal.md`` (modal 1.6.4, the version the relay pins; the
``modal_proto`` messages it ships are the API's schema): the list answers pages of at most
:data:`~testing.fakes.modal.control.LIST_PAGE` sandboxes, newest first, before
``before_timestamp``, and an empty page at the end; an unknown sandbox is ``NOT_FOUND``; an
exec's env is added to the sandbox's (its inline secrets) and the default environment; a
sandbox ends at its ``timeout_secs``. ``tests/fakes/test_modal_documented.py`` checks those
shapes.

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

from testing.fakes.modal.server import FakeModal, running_fake
from testing.fakes.modal.state import Faults, Ledger

__all__ = ["FakeModal", "Faults", "Ledger", "running_fake"]
