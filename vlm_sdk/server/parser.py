"""The command line's argparse, with what a new user needs from it:

- `-h/--help [GROUP]`: a command with many flags (`serve`, `chat`) lists its common flags and the names
  of its other groups; `--help GROUP` shows one group (a word of its title is enough), `--help all` all.
- an unknown flag is answered with the closest known ones (difflib), with what to use instead of a vLLM
  name that is not accepted (vllm_names.hint_for), or with the command that has it (`chat --port`).

    parser = Parser(prog="vlm-sdk")
    args = parse_with_hints(parser, argv)
"""
from __future__ import annotations

import argparse
import difflib
import sys

from vlm_sdk.server.vllm_names import hint_for

COMMON = "common options"


class Parser(argparse.ArgumentParser):
    """`brief=True`: `--help` shows the positionals, the group titled COMMON and the other groups' names."""

    def __init__(self, *args, brief: bool = False, **kwargs):
        if brief:
            kwargs["add_help"] = False
        super().__init__(*args, **kwargs)
        self.brief = brief
        if brief:
            self.add_argument("-h", "--help", nargs="?", const="", metavar="GROUP", action=_GroupHelp,
                              help="show the common options and the groups; --help GROUP one group (a word of "
                                   "its title), --help all every option")

    def _groups(self) -> list[argparse._ArgumentGroup]:
        return [g for g in self._action_groups if g._group_actions and g.title not in ("positional arguments",)]

    def help_for(self, which: str) -> str:
        """The help text for `which`: "" (the brief help), "all", or a word of a group's title."""
        groups = self._groups()
        if which == "all":
            chosen = groups
        elif which == "":
            chosen = [g for g in groups if g.title in (COMMON, "options")]
        else:
            chosen = [g for g in groups if which.lower() in (g.title or "").lower()]
            if not chosen:
                self.error(f"no option group matches {which!r}; groups: {', '.join(g.title for g in groups)}")
        saved = self._action_groups
        keep = [g for g in saved if g.title == "positional arguments" or g in chosen]
        try:
            self._action_groups = keep
            text = self.format_help()
        finally:
            self._action_groups = saved
        rest = [g for g in groups if g not in chosen]
        if which == "" and rest:
            width = max(len(g.title) for g in rest)
            text += "\nmore options, by group (--help GROUP shows one; --help all every option):\n" + "".join(
                f"  {g.title:<{width}}  {len(g._group_actions)} option(s)\n" for g in rest)
        return text


class _GroupHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.help_for(values or ""), sys.stdout)
        parser.exit()


def parse_with_hints(parser: argparse.ArgumentParser, argv: list[str] | None,
                     commands: dict[str, argparse.ArgumentParser] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, but unknown arguments are refused by the (sub)command's parser with a
    hint for each. `commands`: subcommand name -> its parser (args.command picks the one that refuses)."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    command = getattr(args, "command", None)
    owner = (commands or {}).get(command, parser)
    lines = [unknown_hint(arg, command or "", owner, commands or {}) for arg in extra if arg.startswith("-")]
    words = [arg for arg in extra if not arg.startswith("-")]
    message = "unrecognized arguments: " + " ".join(extra)
    if lines:
        message += "\n" + "\n".join(f"  {line}" for line in lines if line)
    elif words:
        message += " (a question or a path with spaces needs quotes)"
    owner.error(message)
    raise AssertionError("unreachable")  # error() exits


def unknown_hint(arg: str, command: str, owner: argparse.ArgumentParser,
                 commands: dict[str, argparse.ArgumentParser]) -> str:
    flag = arg.split("=", 1)[0]
    hint = hint_for(flag, command)
    if hint:
        return hint
    elsewhere = [name for name, p in commands.items() if name != command and flag in _options(p)]
    if elsewhere:
        return f"{flag} is a flag of `vlm-sdk {elsewhere[0]}`, not of `vlm-sdk {command}`"
    # compared without the dashes, which every flag shares
    known = {s.lstrip("-"): s for s in _options(owner)}
    close = difflib.get_close_matches(flag.lstrip("-"), list(known), n=3, cutoff=0.7)
    if close:
        return f"{flag}: did you mean {' or '.join(known[c] for c in close)}?"
    return f"{flag}: no such flag; --help lists them"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings]
