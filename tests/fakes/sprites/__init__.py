"""A protocol-level fake of the Fly.io Sprites API, for the real ``sprites-py`` SDK.

It speaks the REST calls and the exec WebSocket that ``sprites`` 0.7.2 uses (create, get,
list by prefix, delete, network policy, file write, exec with its binary stream frames,
the session list and attach), runs each command as a real local process in a private
directory per sprite, keeps a ledger and injects faults::

    from tests.fakes.sprites import running_fake
    with running_fake() as fake:
        settings = Settings(sprites_base_url=fake.url, sprites_token="t", ...)
        fake.ledger.alive()          # sprites not deleted
        fake.faults.create_status = 429

Any bearer token is accepted except ``bad-key`` (answers 401). Sprites have no lifetime
(as on Fly): one lives until it is deleted. With bubblewrap, a policy denying ``*`` with
nothing allowed is enforced (private network namespace); allow-lists are recorded only.
"""

from tests.fakes.sprites.app import BAD_KEY, BODY_MARKER
from tests.fakes.sprites.server import FakeSprites, running_fake
from tests.fakes.sprites.world import Faults, Ledger

__all__ = ["BAD_KEY", "BODY_MARKER", "FakeSprites", "Faults", "Ledger", "running_fake"]
