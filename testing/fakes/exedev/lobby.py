"""How the lobby reads a request body: a command line, split with a shell lexer.

exe.dev's HTTPS API page: "The POST body is the ssh command to run, exactly as if it were
typed into the REPL"; its run-on-VM page: "The lobby parses the request body with a shell
lexer" and hands the rest of an ``ssh`` line to the VM. The SDK (``exedev._wire.command_line``)
writes flags as ``--name=value`` (shell-quoted), a repeated flag once per value, a true bool
as ``--flag``, and puts ``--`` before positionals that start with ``-``; the docs' own
examples also write ``--name value``. Both are read here. A flag a command does not take is
refused (422), so nothing undocumented passes unnoticed.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["string", "repeated", "bool"]

FLAGS: dict[str, dict[str, Kind]] = {
    # The flags exedev 0.4.0's AsyncClient.new() can send, and --json (always on anyway).
    "new": {
        "name": "string",
        "tag": "repeated",
        "image": "string",
        "env": "repeated",
        "no-email": "bool",
        "comment": "string",
        "cpu": "string",
        "memory": "string",
        "disk": "string",
        "egress": "string",
        "integration": "repeated",
        "no-pool": "bool",
        "pool": "string",
        "prompt": "string",
        "registry-auth": "string",
        "setup-script": "string",
        "standalone": "bool",
        "json": "bool",
    },
    "ls": {"json": "bool", "l": "bool"},
    "rm": {"json": "bool"},
    "tag": {"d": "bool", "json": "bool"},
    "egress": {"json": "bool"},
    "restart": {"json": "bool"},
    "whoami": {"json": "bool"},
}
"""The lobby commands the fake serves (``ssh`` is read apart: its words go to the VM)."""

TAG_SCOPED = frozenset({"new", "ls", "rm", "ssh", "tag", "egress", "restart", "whoami"})
"""Commands a tag-scoped token may run: those the SDK's docstrings mark "Tag-scoped API
keys may run this command", and ``ls``/``ssh``, without which such a key manages nothing."""


class CommandError(Exception):
    """A command line the lobby refuses: its HTTP status and error text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


@dataclass
class Invocation:
    """One parsed command line."""

    words: list[str]
    verb: str
    flags: dict[str, str | bool | list[str]] = field(default_factory=dict)
    positionals: list[str] = field(default_factory=list)

    def string(self, name: str) -> str | None:
        value = self.flags.get(name)
        return value if isinstance(value, str) else None

    def strings(self, name: str) -> list[str]:
        value = self.flags.get(name)
        return list(value) if isinstance(value, list) else []

    def switch(self, name: str) -> bool:
        return self.flags.get(name) is True


def split(body: str) -> list[str]:
    """The words of a command line, as the lobby's shell lexer reads them."""
    try:
        words = shlex.split(body)
    except ValueError as exc:
        raise CommandError(422, f"cannot parse the command line: {exc}") from None
    if not words:
        raise CommandError(422, "no command")
    return words


def parse(words: list[str]) -> Invocation:
    """The verb, flags and positionals of a lobby command (not ``ssh``)."""
    verb, rest = words[0], words[1:]
    spec = FLAGS.get(verb)
    if spec is None:
        raise CommandError(404, f'no such command "{verb}"')
    invocation = Invocation(words=words, verb=verb)
    index = 0
    while index < len(rest):
        word = rest[index]
        index += 1
        if word == "--":
            invocation.positionals += rest[index:]
            break
        if not word.startswith("-") or word == "-":
            invocation.positionals.append(word)
            continue
        name, has_value, value = word.lstrip("-").partition("=")
        kind = spec.get(name)
        if kind is None:
            raise CommandError(422, f"{verb}: unknown flag --{name}")
        if kind == "bool":
            if has_value and value not in ("true", "false"):
                raise CommandError(422, f"{verb}: --{name} takes true or false")
            invocation.flags[name] = not has_value or value == "true"
            continue
        if not has_value:
            if index >= len(rest):
                raise CommandError(422, f"{verb}: --{name} needs a value")
            value, index = rest[index], index + 1
        if kind == "repeated":
            invocation.flags.setdefault(name, [])
            listed = invocation.flags[name]
            assert isinstance(listed, list)
            listed.append(value)
        else:
            invocation.flags[name] = value
    return invocation


def permitted(cmds: tuple[str, ...] | None, words: list[str]) -> bool:
    """Whether a token limited to ``cmds`` (``--cmds``) may run this command line: one of
    them is a prefix of its words (``"ssh"``, or ``"ssh my-vm"`` for one VM)."""
    if cmds is None:
        return True
    for allowed in cmds:
        prefix = shlex.split(allowed)
        if prefix and words[: len(prefix)] == prefix:
            return True
    return False
