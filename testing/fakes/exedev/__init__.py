"""A protocol-level fake of exe.dev's HTTPS API, for the real ``exedev`` SDK (0.4.0).

Written from the SDK's own wire code (``exedev/_wire.py``, ``_async.py``, ``_errors.py``,
``types.py`` of exedev 0.4.0) and exe.dev's public docs: "HTTPS API"
(https://exe.dev/docs/https-api), "HTTPS API: Run commands on VM"
(https://exe.dev/docs/https-api-run-on-vm), the sandbox page (https://exe.dev/sandbox) and
the SDK's README; summarised in ``/work/shared/reference/exedev.md``. Every call is
``POST /exec`` with a Bearer token and a lobby command line as the body; the fake serves
``new``, ``ls``, ``rm``, ``ssh`` (an NDJSON stream of base64 stdout/stderr lines, then the
exit code or an error, blank lines as heartbeats), ``tag``, ``egress``, ``restart`` and
``whoami``. Commands run as real processes in a private directory per VM (bubblewrap where
it works), so the SDK's file scripts work::

    from testing.fakes.exedev import running_fake
    with running_fake() as fake:
        client = exedev.AsyncClient("any-token", base_url=fake.url)
        fake.ledger.alive()            # VMs not deleted
        fake.faults.create_hang = True
        token = fake.issue_token("ci", tag="relay", cmds=("new", "ls", "rm", "ssh"))

Any bearer token is accepted (unlimited) except ``bad-key`` (401); ``issue_token`` makes a
limited one. There is no stdin, and no deadline for a command or a VM: exe.dev documents
none, so a VM lives until ``rm``.
"""

from testing.fakes.exedev.app import BAD_KEY, BODY_MARKER
from testing.fakes.exedev.ledger import Faults, Ledger
from testing.fakes.exedev.server import FakeExedev, running_fake
from testing.fakes.exedev.world import HOME

__all__ = ["BAD_KEY", "BODY_MARKER", "HOME", "FakeExedev", "Faults", "Ledger", "running_fake"]
