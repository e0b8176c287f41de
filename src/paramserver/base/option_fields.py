"""What an :class:`~paramserver.base.options.Options` field says besides its name, type and default.

An option is one field: ``option(default, Flag(...))`` declares its command-line flag, the flag's
help and its row of docs/cli.md; ``option(default, no_flag="why")`` one that no flag sets (a cluster
file's ``"options"`` and ``PARAMSERVER_OPTIONS`` still do). The CLI (launch/cli/option_flags.py)
builds its flags from these fields and launch/cli/docs.py the options tables of docs/cli.md, so
neither holds a list of options of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Which commands take a flag: launch/cli/option_flags.py says, group by group.
RUN = "run"  # the launcher's own: run and demo
CONSISTENCY = "consistency"  # consistency, checkpoints and recovery: every command that starts nodes
LIMITS = "limits"  # what a PS enforces, tables bigger than memory, the wire
OPERATIONS = "operations"  # metrics, logs, summaries, audit, shutdown
SECURITY = "security"  # TLS and tokens: also the commands that call a running cluster
FLAG_GROUPS = (RUN, CONSISTENCY, LIMITS, OPERATIONS, SECURITY)


@dataclass(frozen=True)
class Flag:
    """An option's command-line flag.

    `help` is argparse's help; ``{default}`` in it (with a format spec if wanted: ``{default:g}``)
    becomes the option's default. `metavar` names the value in docs/cli.md (``--keep K``); `doc` is
    the docs row's meaning (else `help`), `shown` its default column (else the default, written as
    a person would). `byte_size`: an int flag that also takes ``16GiB``, ``512MiB``.
    """

    name: str
    group: str
    help: str
    metavar: str = ""
    doc: str = ""
    shown: str = ""
    byte_size: bool = False

    def __post_init__(self) -> None:  # a declaration's mistake, found when the module is imported
        if not self.name.startswith("--"):
            raise TypeError(f"flag {self.name!r} must start with --")
        if self.group not in FLAG_GROUPS:
            raise TypeError(f"flag {self.name}: group {self.group!r} is not one of {FLAG_GROUPS}")


def option(default: Any, flag: Flag | None = None, *, no_flag: str = "", choices: tuple[str, ...] = ()) -> Any:
    """An Options field: its default, and its `flag` or why it has none (`no_flag`); `choices`, the
    only values it takes (checked by Options, offered by the flag)."""
    if (flag is None) == (not no_flag):
        raise TypeError("an option has a flag, or a reason (no_flag) why it has none")
    metadata = {"flag": flag, "no_flag": no_flag, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's flag; None for an option no flag sets."""
    return field.metadata.get("flag")


def choices_of(field: dataclasses.Field) -> tuple[str, ...]:
    """The only values the option takes; () when any value of its type may do."""
    return field.metadata.get("choices", ())


def one_of(choices: tuple[str, ...]) -> str:
    """The choices as an error names them: 'a', 'b' or 'c'."""
    quoted = [repr(choice) for choice in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
