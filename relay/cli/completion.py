"""``relay completion bash|zsh|fish``: a completion script, written from the argument tree.

The script holds the tree as it is (commands, actions, options, and the values of the few
arguments with a fixed set: shells, providers), so completing costs the shell nothing and
never runs ``relay``. Load it once per shell::

    eval "$(relay completion bash)"      # ~/.bashrc
    eval "$(relay completion zsh)"       # ~/.zshrc (after compinit)
    relay completion fish | source       # ~/.config/fish/config.fish
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from relay import client as relay_client
from relay.cli.arguments import parser


@dataclass
class Node:
    """One command path (``""``, ``"tokens"``, ``"tokens new"``) and what may follow it."""

    path: str
    commands: dict[str, str] = field(default_factory=dict)
    """Each command (or action) that may come next, and its help line."""
    options: dict[str, str] = field(default_factory=dict)
    values: list[str] = field(default_factory=list)
    """The values its positional argument may take, where they are a fixed set."""


def _help(text: str | None) -> str:
    return " ".join((text or "").split()).replace("%(default)s", "")


def _walk(command: argparse.ArgumentParser, path: str, nodes: list[Node]) -> None:
    node = Node(path)
    nodes.append(node)
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                node.commands[name] = _help(helps.get(name))
                _walk(child, f"{path} {name}".strip(), nodes)
        elif action.option_strings and action.help != argparse.SUPPRESS:
            for option in action.option_strings:
                node.options[option] = _help(action.help)
        elif action.choices is not None and not action.option_strings:
            node.values = [str(choice) for choice in action.choices]


def tree() -> list[Node]:
    """Every command path of ``relay``; ``run`` and ``exec`` take the client's options, and
    ``probe`` the registry's provider names."""
    nodes: list[Node] = []
    _walk(parser(), "", nodes)
    borrowed = {
        "run": relay_client.arguments("relay run"),
        "exec": relay_client.arguments("relay exec", raw=True),
    }
    from relay.providers.registry import PROVIDERS

    for node in nodes:
        if node.path in borrowed:
            found: list[Node] = []
            _walk(borrowed[node.path], node.path, found)
            node.options = found[0].options
        if node.path == "probe":
            node.values = [name for name in PROVIDERS if name != "memory"]
    return nodes


def _words(names: Iterable[str]) -> str:
    return " ".join(names)


def _cases(nodes: list[Node], words: Callable[[Node], list[str]]) -> str:
    """A shell ``case`` arm per path that has words: ``"tokens") echo "new list …" ;;``."""
    arms = [(node.path, words(node)) for node in nodes]
    return "\n".join(
        f'        "{path}") echo "{_words(found)}" ;;' for path, found in arms if found
    )


def bash(nodes: list[Node]) -> str:
    """Bash 3.2 up (macOS's): a case per path, compgen over its words."""
    commands = _cases(nodes, lambda node: list(node.commands))
    options = _cases(nodes, lambda node: list(node.options))
    values = _cases(nodes, lambda node: node.values)
    return f"""# relay completion for bash: eval "$(relay completion bash)"
_relay_commands() {{
    case "$1" in
{commands}
    esac
}}
_relay_options() {{
    case "$1" in
{options}
    esac
}}
_relay_values() {{
    case "$1" in
{values}
    esac
}}
_relay() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" at="" word i
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        case " $(_relay_commands "$at") " in
            *" $word "*) at="${{at:+$at }}$word" ;;
        esac
    done
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$(_relay_options "$at")" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$(_relay_commands "$at") $(_relay_values "$at")" -- "$cur"))
    fi
}}
complete -F _relay relay
"""


def _zsh_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace(":", "\\:").replace("'", "'\\''")


def _zsh_pair(name: str, text: str) -> str:
    """``'name:help'`` for ``_describe`` (a colon in either escaped)."""
    return f"'{_zsh_quote(name)}:{_zsh_quote(text)}'"


def zsh(nodes: list[Node]) -> str:
    """zsh: the same walk, each word offered with its help line."""
    cases = []
    for node in nodes:
        described = [_zsh_pair(name, text) for name, text in node.commands.items()]
        options = [_zsh_pair(name, text) for name, text in node.options.items()]
        values = [f"'{_zsh_quote(value)}'" for value in node.values]
        cases.append(
            f'        "{node.path}")\n'
            f"            commands=({' '.join(described)})\n"
            f"            options=({' '.join(options)})\n"
            f"            values=({' '.join(values)}) ;;"
        )
    body = "\n".join(cases)
    return f"""# relay completion for zsh: eval "$(relay completion zsh)" (after compinit)
_relay_node() {{
    case "$1" in
{body}
    esac
}}
_relay() {{
    local at="" word i
    local -a commands options values names
    for ((i = 2; i < CURRENT; i++)); do
        word="${{words[i]}}"
        _relay_node "$at"
        names=(${{commands%%:*}})
        if (( ${{names[(Ie)$word]}} )); then at="${{at:+$at }}$word"; fi
    done
    _relay_node "$at"
    if [[ "$PREFIX" == -* ]]; then
        _describe -t options 'option' options
    else
        _describe -t commands 'command' commands
        (( ${{#values}} )) && compadd -a values
    fi
}}
compdef _relay relay
"""


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish(nodes: list[Node]) -> str:
    """fish: one ``complete`` line per word, under the condition that its path is typed."""
    lines = [
        "# relay completion for fish: relay completion fish | source",
        "function __relay_at",
        "    set -l at ''",
        "    for word in (commandline -opc)[2..-1]",
        "        if contains -- $word (__relay_commands $at)",
        '            set at (string trim -- "$at $word")',
        "        end",
        "    end",
        '    test "$at" = "$argv[1]"',
        "end",
        "function __relay_commands",
        "    switch $argv[1]",
    ]
    for node in (node for node in nodes if node.commands):
        lines.append(f"        case {_fish_quote(node.path)}")
        lines.append(f"            printf '%s\\n' {_words(node.commands)}")
    lines += ["    end", "end", "complete -c relay -f"]
    for node in nodes:
        when = "-n " + _fish_quote("__relay_at " + _fish_quote(node.path))
        for name, text in node.commands.items():
            lines.append(f"complete -c relay {when} -a {name} -d {_fish_quote(text)}")
        for value in node.values:
            lines.append(f"complete -c relay {when} -a {value}")
        for name, text in node.options.items():
            flag = f"-l {name[2:]}" if name.startswith("--") else f"-s {name[1:]}"
            lines.append(f"complete -c relay {when} {flag} -d {_fish_quote(text)}")
    return "\n".join(lines) + "\n"


SCRIPTS = {"bash": bash, "zsh": zsh, "fish": fish}


def cmd_completion(args: argparse.Namespace) -> int:
    print(SCRIPTS[args.shell](tree()), end="")
    return 0
