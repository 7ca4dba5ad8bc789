"""What marks a VM as the relay's: its name, chosen before the create, and its tags.

exe.dev's VM names are ``[a-zA-Z0-9][a-zA-Z0-9-]*`` (the SDK checks them before ``rm``), a
host name under ``exe.xyz`` (a DNS label: at most 63 characters), shared by every account,
and said (an unverified page) not to end in ``-<digits>``. Tags are plain words; exe.dev
documents no character set for them, so the relay keeps to lower-case letters, digits and
``-`` and writes a run id with an escape that reads back exactly (:func:`escaped`).
"""

from __future__ import annotations

import hashlib
import re
import string
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from relay.providers.contract import TAG_ATTEMPT, TAG_CLUSTER, TAG_RUN, SandboxSpec

TAG_LIFETIME = "relay-lifetime"
"""The lifetime (seconds) the relay gives the VM, for an operator to check: exe.dev has no
lifetime of its own to hold it."""
TAG_CREATED = "relay-created"
"""The VM's creation time (Unix seconds), for the reaper where ``ls`` gives none (its
``created_at`` is optional)."""
KEYS = (TAG_CLUSTER, TAG_RUN, TAG_ATTEMPT, TAG_LIFETIME, TAG_CREATED)
"""Each tag is ``<key>-<value>`` (no key starts another key followed by ``-``)."""
_PLAIN = frozenset(string.ascii_lowercase + string.digits)
_LETTERS = string.ascii_lowercase


def escaped(value: str) -> str:
    """``value`` in ``[a-z0-9-]`` and back (:func:`unescaped`): ``_`` is ``-u``, ``-`` is
    ``-d``, any other character ``-x`` and four hex digits per UTF-16 unit (``run_a`` →
    ``run-ua``)."""
    words: list[str] = []
    for character in value:
        if character in _PLAIN:
            words.append(character)
        elif character == "_":
            words.append("-u")
        elif character == "-":
            words.append("-d")
        else:
            units = character.encode("utf-16-be")
            words += [f"-x{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2)]
    return "".join(words)


def unescaped(text: str) -> str | None:
    """What :func:`escaped` made ``text`` of (None: not its work)."""
    units = bytearray()
    index = 0
    try:
        while index < len(text):
            character = text[index]
            if character != "-":
                if character not in _PLAIN:
                    return None
                units += character.encode("utf-16-be")
                index += 1
                continue
            code = text[index + 1]
            if code == "u":
                units += "_".encode("utf-16-be")
                index += 2
            elif code == "d":
                units += "-".encode("utf-16-be")
                index += 2
            elif code == "x":
                units += bytes.fromhex(text[index + 2 : index + 6])
                index += 6
            else:
                return None
        return units.decode("utf-16-be")
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def vm_name(spec: SandboxSpec) -> str:
    """``<cluster>-<run id, 14 characters of a-z0-9->-<6 letters of a hash of the run id>``:
    made from the run id alone, so a create that failed or never answered is found by this
    name whatever it answered, and ending in letters (never ``-<digits>``)."""
    run = re.sub(r"[^a-z0-9]+", "-", spec.run_id.lower()).strip("-")[:14].strip("-")
    digest = hashlib.sha256(spec.run_id.encode()).digest()
    letters = "".join(_LETTERS[byte % len(_LETTERS)] for byte in digest[:6])
    return f"{spec.cluster}-{run or 'run'}-{letters}"


def tags_for(spec: SandboxSpec) -> list[str]:
    """The VM's tags: its cluster, its run (and which attempt of it, on a route), its
    lifetime and its creation time."""
    values = {TAG_CLUSTER: spec.cluster, TAG_RUN: escaped(spec.run_id)}
    if spec.attempt is not None:
        values[TAG_ATTEMPT] = str(spec.attempt)
    values |= {TAG_LIFETIME: str(spec.lifetime_s), TAG_CREATED: str(int(time.time()))}
    return [f"{key}-{value}" for key, value in values.items()]


def tags_of(tags: Iterable[str]) -> dict[str, str]:
    """The relay's tags of a VM back into values (others are ignored)."""
    found: dict[str, str] = {}
    for tag in tags:
        for key in KEYS:
            if tag.startswith(f"{key}-") and key not in found:
                value = tag.removeprefix(f"{key}-")
                read = unescaped(value) if key == TAG_RUN else value
                if read:
                    found[key] = read
    return found


def created_at_of(tags: Mapping[str, str]) -> datetime | None:
    """The creation time the relay tagged a VM with (none on one made elsewhere)."""
    try:
        return datetime.fromtimestamp(int(tags[TAG_CREATED]), UTC)
    except (KeyError, ValueError, OverflowError, OSError):
        return None
