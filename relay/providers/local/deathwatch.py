"""The deathwatch: one small process per relay that outlives it, to kill the sandboxes a
relay killed outright leaves half-made.

Each sandbox's host-side processes are tied to the relay (relay/providers/local/invocation.py:
``setpriv --pdeathsig``, checked, then ``timeout``, which kills its process group when the
relay dies). Gaps are left that no option of bubblewrap's closes: once released, its child
(the sandbox's PID 1) leaves that process group (``--new-session``) and only then ties
itself to bubblewrap (``--die-with-parent``); and bubblewrap writes its child's pid on the
info pipe before it lets that child go on, so a relay killed then makes bubblewrap die of
SIGPIPE, and ``timeout`` follow it, before the relay's death reaches ``timeout``: nothing
kills the group, and the child waits for bubblewrap forever. A relay killed in either
window left the sandbox running, untied.

So the relay tells a watcher of each command before it starts it (a line ``+ KEY
SANDBOX`` on a pipe), and that it ended (``- KEY``). The watcher is a POSIX shell reading
the pipe, in a session of its own, tied to nothing: when the pipe reads end of file, the
relay is gone (or closing, with nothing left to watch), and it kills every process that
carries a listed sandbox's marker in its environment (every host-side process of a
sandbox, and its PID 1, does: killing PID 1 ends the sandbox's whole PID namespace), again
until none is left (a process caught forking leaves a child the first look missed).

A relay that forks (a test's harness) starts a watcher of its own in the child: the
parent's pipe would never read end of file while the parent lives.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import weakref

from relay.providers.contract import SANDBOX_MARKER

log = logging.getLogger("relay.providers.local")

_ROUNDS = 100
"""Looks for what is left at most (5 s): a killed process is gone in milliseconds."""

_WATCH = f"""
live=
while read -r op key sandbox; do
  case $op in
    +) live="$live $key:$sandbox" ;;
    -) kept=
       for entry in $live; do [ "${{entry%%:*}}" = "$key" ] || kept="$kept $entry"; done
       live=$kept ;;
  esac
done
markers=
for entry in $live; do markers="$markers -e {SANDBOX_MARKER}=${{entry#*:}}"; done
[ -n "$markers" ] || exit 0
round=0
while [ "$round" -lt {_ROUNDS} ]; do
  pids=$(grep -lzxF $markers /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  [ -n "$pids" ] || exit 0
  kill -KILL $pids 2>/dev/null
  round=$((round + 1))
  sleep 0.05
done
"""
_CLOSE_TIMEOUT_S = 5.0


class Deathwatch:
    """The watcher of one relay process (started on first use, see the module's docstring)."""

    def __init__(self, shell: str, env: dict[str, str]) -> None:
        self.shell = shell
        self.env = env
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: int | None = None
        self._owner: int | None = None  # the pid that started it: a forked child starts anew
        self._broken = False
        self._finalizer: weakref.finalize[..., Deathwatch] | None = None
        self._keys = itertools.count(1)

    def _started(self) -> int | None:
        """The pipe to this process's watcher, started now if need be."""
        if self._owner == os.getpid() and self._pipe is not None:
            return self._pipe
        if self._owner is not None and self._owner != os.getpid():
            self._pipe, self._process = None, None  # the parent's: it watches the parent
            if self._finalizer is not None:
                self._finalizer.detach()
        read, write = os.pipe()  # neither end inherited by any other child of the relay
        try:
            self._process = subprocess.Popen(
                [self.shell, "-c", _WATCH, "relay-deathwatch"],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # a terminal's Ctrl-C is the relay's, not its
            )
        except OSError as exc:
            os.close(write)
            self._warn(f"could not start ({exc.strerror})")
            return None
        finally:
            os.close(read)
        os.set_blocking(write, False)  # a stuck watcher must never hold a run
        self._pipe, self._owner = write, os.getpid()
        # A provider dropped without aclose (a test's) ends its watcher as aclose would.
        self._finalizer = weakref.finalize(self, _end, write, self._process)
        return write

    def watch(self, sandbox_id: str) -> int:
        """Kill every process of ``sandbox_id`` if this relay dies before :meth:`forget`
        of the key answered (one per command: a sandbox may run several at once)."""
        key = next(self._keys)
        self._send(f"+ {key} {sandbox_id}\n")
        return key

    def forget(self, key: int) -> None:
        self._send(f"- {key}\n")

    def _send(self, line: str) -> None:
        pipe = self._started()
        if pipe is None:
            return
        try:
            os.write(pipe, line.encode())
        except OSError as exc:  # gone (killed by hand) or not reading: the ties still hold
            self._warn(f"stopped listening ({type(exc).__name__})")

    def _warn(self, what: str) -> None:
        if not self._broken:
            self._broken = True
            log.warning(
                "local provider: the deathwatch %s; a sandbox whose relay is killed at the "
                "moment it is released may then outlive it until its hard lifetime",
                what,
            )

    def close(self) -> None:
        """End the watcher (it kills what is still listed: nothing, once every sandbox
        was terminated) and reap it."""
        if self._owner != os.getpid() or self._pipe is None:
            return
        self._pipe = None
        if self._finalizer is not None:
            self._finalizer()


def _end(pipe: int, process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        os.close(pipe)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(_CLOSE_TIMEOUT_S)
