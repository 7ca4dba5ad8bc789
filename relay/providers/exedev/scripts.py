"""The shell scripts the relay runs on an exe.dev VM, and the archive its files travel in.

exe.dev has no stdin and no way back into a command once its ``ssh`` request is gone, so a
job does not run in the request that starts it: :data:`START` writes its inputs into a run
folder and starts :data:`MONITOR` in a session of its own, which runs the job with its stdin
from a file, its stdout and stderr into files and its exit status into a file; :data:`FOLLOW`
streams those files from given offsets until the job has ended and exits with its status.
A request that breaks is followed again from the bytes already received: nothing is lost or
repeated, and the job never depends on a connection (whether exe.dev kills a command whose
request is dropped is undocumented; the relay deletes the VM at the end either way).

Every script takes its data as positional arguments (``"$@"``, never parsed by a shell) and
keeps none of its own in variables once a job's variables are read, so none can change it.
They need a POSIX shell, ``base64``, util-linux's ``setsid`` and ``flock``, and GNU
coreutils' ``timeout`` and ``tail`` (``--pid``): exe.dev's images (``exeuntu``, Ubuntu) have
them.
"""

from __future__ import annotations

import io
import posixpath
import shlex
import tarfile
import time
from collections.abc import Mapping

from relay.errors import ValidationFailed
from relay.providers.contract import DEFAULT_WORKDIR

MISSING_TOOL = 125
""":data:`START`'s status when the VM lacks what the scripts need (``setsid``, ``flock``,
``timeout``, GNU ``tail``) or its run folder can't be written."""

# Into the folder $W, made first if need be (by sudo where the user can't): the workdir of
# the files (UNPACK) and of the job (MONITOR).
_WORKDIR = (
    'cd -- "$W" 2>/dev/null || { mkdir -p -- "$W" 2>/dev/null'
    ' || sudo -n install -d -m 0777 -- "$W"; } && cd -- "$W" || exit 126'
)

START = """\
d=$1 variables=$2 input=$3 monitor=$4
shift 4
for tool in setsid flock; do command -v "$tool" >/dev/null 2>&1 || exit 125; done
command -p tail --version >/dev/null 2>&1 || exit 125
t=$(command -v timeout) || exit 125
u=$(umask)
umask 077
mkdir -p -- "$d" || exit 125
case $variables in
  ''|-) ;;
  *) printf '%s' "$variables" | base64 -d > "$d/env" || exit 125;;
esac
case $input in
  -) ;;
  '') : > "$d/in";;
  *) printf '%s' "$input" | base64 -d > "$d/in" || exit 125;;
esac
[ -f "$d/in" ] || exit 125
e=
[ -f "$d/env" ] && e=$d/env
: > "$d/out" && : > "$d/err" || exit 125
exec 9> "$d/lock" && flock -n 9 || exit 125
w=$1
shift
setsid sh -c "$monitor" relay-job "$d" "$u" "$w" "$e" "$t" -s KILL "$@" </dev/null >/dev/null 2>&1 &
"""
"""Starts a job and returns. ``$1`` the run folder, ``$2`` the job's variables file
(base64), ``-`` (written there already) or empty, ``$3`` its stdin likewise, ``$4``
:data:`MONITOR`, ``$5`` the workdir, then the kill timeout in seconds and the job's argv.
The monitor inherits a lock on ``$d/lock`` (taken here, so it is held before this returns)
and holds it until it has written the job's status: how :data:`FOLLOW` knows it has ended.
Not its pid: a process ended but not yet reaped looks alive to ``kill -0``."""

MONITOR = (
    """\
d=$1
shift
(
  exec 9>&-
  umask "$1"
  W=$2 && """
    + _WORKDIR
    + """
  if [ -n "$3" ]; then set -a && . "$3" && set +a && command -p rm -f -- "$3" || exit 126; fi
  shift 3
  exec "$@"
) < "$d/in" >> "$d/out" 2>> "$d/err"
echo $? > "$d/exit.new" && mv -f -- "$d/exit.new" "$d/exit"
"""
)
"""Runs the job in a subshell (the job's variables, read there into the VM's default
environment, never reach ``d``; the lock is not the job's to keep), under ``timeout -s
KILL`` (its argv starts with it), and writes its exit status (128+N for signal N) when it
ends, then lets go of the lock by ending. ``W`` is set before the variables
are read and only used before them."""

FOLLOW = """\
flock -s "$1/lock" true &
w=$!
case $2 in end) a=0;; *) a=+$(($2 + 1));; esac
case $3 in end) b=0;; *) b=+$(($3 + 1));; esac
command -p tail -c "$a" -s 0.1 --pid="$w" -f -- "$1/out" &
command -p tail -c "$b" -s 0.1 --pid="$w" -f -- "$1/err" >&2 &
wait
[ -f "$1/exit" ] && exit "$(cat -- "$1/exit")"
exit 255
"""
"""Streams the job's stdout and stderr from byte offsets ``$2`` and ``$3`` (``end``: from
what is there now) until the monitor has ended (a waiter takes the lock it held; the tails
follow that waiter, reaped here at once), then exits with the job's status; 255 without one
(a job's own 255, or none: :data:`STATUS` tells which)."""

STATUS = """\
[ -f "$1/exit" ] && { cat -- "$1/exit"; exit 0; }
flock -n -s "$1/lock" true 2>/dev/null || exit 3
exit 4
"""
"""Prints the job's status and exits 0; 3 while it still runs (:data:`FOLLOW` could not
follow it), 4 when it ended without one (its VM restarted, its monitor was killed)."""
RUNNING, ENDED_WITHOUT_STATUS = 3, 4

UNPACK = (
    f"W={shlex.quote(DEFAULT_WORKDIR)} && ( "
    + _WORKDIR
    + """ ) || exit 126
if [ -n "$2" ]; then tar -xzf "$2" -C / --no-same-owner; c=$?; rm -f -- "$2"; exit $c; fi
printf '%s' "$1" | base64 -d | tar -xzf - -C / --no-same-owner
"""
)
"""Writes the job's files: ``$1`` a gzipped tar (base64) of them, or ``$2`` the path of one
uploaded first; its members are paths from ``/``. The workdir is made first."""


def archive_of(files: Mapping[str, bytes]) -> bytes:
    """The files as a gzipped tar, in memory (a request's files never touch a host path),
    each at its path from ``/`` (relative ones under the workdir), mode 0644."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT) as archive:
        for path, content in files.items():
            target = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, path)).lstrip("/")
            if not target or target == ".":
                raise ValidationFailed(f"{path!r} is not a file's path")
            member = tarfile.TarInfo(target)
            member.size, member.mode, member.mtime = len(content), 0o644, now
            archive.addfile(member, io.BytesIO(content))
    return buffer.getvalue()
