"""A protocol-level fake of Daytona (control API + toolbox), for the real ``daytona`` SDK.

Follows: ``shared/reference/daytona.md`` (daytona 0.226.1, the version the relay pins; its
generated API clients are the published API's schema): a list item is the sandbox DTO
without ``env`` and ``kvm``, paged by ``limit`` and ``nextCursor``; unknown ids are 404 with
``{statusCode, message, code, source}``; a command runs with the sandbox's ``env`` on top of
the default environment; TTL and auto-stop/auto-delete end a sandbox the relay forgot.
``tests/fakes/test_daytona_documented.py`` checks those shapes.

It speaks what ``daytona`` 0.226.1's async client sends (create, get, list, delete; toolbox
sessions, session commands, their log WebSocket, bulk upload), runs commands as real local
processes in a private directory per sandbox, enforces TTL and auto-stop/auto-delete
itself, keeps a ledger and injects faults::

    from testing.fakes.daytona import running_fake
    with running_fake() as fake:
        settings = Settings(daytona_api_url=fake.api_url, daytona_api_key="k", ...)
        fake.ledger.alive()          # sandboxes that exist now
        fake.faults.create_status = 429
        fake.call("vanish", sandbox_id)  # kill a sandbox under a running command

Any bearer key is accepted except ``bad-key`` (401). With bubblewrap, ``networkBlockAll``
is enforced (private network namespace); allow-lists are recorded, not enforced.
"""

from testing.fakes.daytona.app import BAD_KEY, BODY_MARKER
from testing.fakes.daytona.server import FakeDaytona, running_fake
from testing.fakes.daytona.world import Faults, Ledger

__all__ = ["BAD_KEY", "BODY_MARKER", "FakeDaytona", "Faults", "Ledger", "running_fake"]
