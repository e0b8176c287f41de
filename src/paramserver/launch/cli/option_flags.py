"""The flags that set options, built from the `Options` fields (base/options/options.py): a field's flag
gives its name, type, choices and help; its group says which commands take it.

A flag not given leaves its option out of `given_options`, so that PARAMSERVER_OPTIONS, a cluster
file and the option's default still apply: every flag's argparse default is None.
"""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, fields
from typing import Any

from paramserver.base.byte_size import parse_byte_size
from paramserver.base.options.fields import CONSISTENCY, LIMITS, OPERATIONS, RUN, SECURITY, Flag, choices_of, flag_of
from paramserver.base.options.options import Options

STARTS_NODES = ("run", "demo", "node", "k8s", "slurm")
_TYPES = {"int": int, "float": float}  # a str option's flag takes its words as they are
CALLS_NODES = ("status", "shutdown", "health")


@dataclass(frozen=True)
class FlagGroup:
    """Where a group's flags go: the commands that take them, the title of their part of --help
    (None: among the command's own flags), and their heading and words in docs/cli.md."""

    commands: tuple[str, ...]
    title: str | None
    heading: str
    about: str


GROUPS = {
    RUN: FlagGroup(("run", "demo"), None, "Local runs", "`run` and `demo` only."),
    CONSISTENCY: FlagGroup(
        STARTS_NODES, None, "Consistency, checkpoints and recovery", "`run`, `demo`, `node`, `k8s` and `slurm`."
    ),
    LIMITS: FlagGroup(
        STARTS_NODES,
        "limits (docs/security.md)",
        "Limits, tables bigger than memory, communication",
        "`run`, `demo`, `node`, `k8s` and `slurm`. Every PS enforces its limits before it takes memory "
        "([security.md](security.md#limits-and-bad-input)).",
    ),
    OPERATIONS: FlagGroup(
        STARTS_NODES,
        "operations (docs/operations.md)",
        "Operations",
        "`run`, `demo`, `node`, `k8s` and `slurm` ([operations.md](operations.md)).",
    ),
    SECURITY: FlagGroup(
        (*STARTS_NODES[:3], *CALLS_NODES),
        "security (docs/security.md)",
        "Security",
        "`run`, `demo` and `node`; `status`, `shutdown` and `health` too, to reach a cluster that uses them "
        "(docs/security.md). `k8s` takes `--certs DIR` and `--tokens DIR` instead; `slurm` takes none.",
    ),
}


def flagged_fields(group: str | None = None) -> list[tuple[Field, Flag]]:
    """The Options fields a flag sets (of one group, or all), in the order Options declares them."""
    found = [(f, flag) for f in fields(Options) if (flag := flag_of(f)) is not None]
    return [(f, flag) for f, flag in found if group is None or flag.group == group]


def add_option_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Every option flag `command` takes, group by group."""
    for key, group in GROUPS.items():
        if command not in group.commands:
            continue
        target = parser.add_argument_group(group.title) if group.title else parser
        for f, flag in flagged_fields(key):
            target.add_argument(flag.name, dest=f.name, default=None, help=help_of(f, flag), **_kind(f, flag))


def help_of(field: Field, flag: Flag) -> str:
    """The flag's help, its default written in."""
    return flag.help.format(default=field.default)


def _kind(field: Field, flag: Flag) -> dict[str, Any]:
    """argparse's action, type, choices and metavar for the option's type."""
    if field.type == "bool":  # the flag says the other value than the default
        return {"action": "store_false" if field.default else "store_true"}
    kind: dict[str, Any] = {"type": _byte_size if flag.byte_size else _TYPES.get(str(field.type))}
    if choices := choices_of(field):
        kind["choices"] = list(choices)
    else:  # the name argparse would give it, from the flag (the option's name may differ)
        kind["metavar"] = flag.name.removeprefix("--").replace("-", "_").upper()
    return kind


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (unset ones left out)."""
    given = {f.name: getattr(args, f.name, None) for f, _ in flagged_fields()}
    return {name: value for name, value in given.items() if value is not None}


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
