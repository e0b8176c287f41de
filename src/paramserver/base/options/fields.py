"""What an :class:`~paramserver.base.options.options.Options` field says besides its name, type and default.

An option is one field: ``option(default, Flag(...))`` declares its command-line flag, the flag's
help and its meaning in the docs; ``option(default, no_flag="why", doc="meaning")`` one that no flag
sets (a cluster file's ``"options"`` and ``PARAMSERVER_OPTIONS`` still do). A number's simple range
is declared with it too (``positive=True``, ``at_least=1``, ``between=(0, 65535)``), and checked by
base/options/checks.py with the rules between options. The CLI
(launch/cli/option_flags.py) builds its flags from these fields and launch/cli/docs.py the option
tables of docs/cli.md and docs/configuration.md, so none of them holds a list of options of its own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

_NAMED_DEFAULT = re.compile(r" \(default [^;()]*\)")  # "(default {default})" in a flag's help

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
    becomes the option's default. `metavar` names the value in the docs (``--keep K``); `doc` is the
    option's meaning in docs/cli.md and docs/configuration.md (else `help`), `shown` the default
    column of docs/cli.md (else the default, written as a person would). `byte_size`: an int flag
    that also takes ``16GiB``, ``512MiB``.
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


@dataclass(frozen=True)
class Range:
    """The values a number option takes: from `low` (excluded when `above`) to `high`; `says`, how an
    error and the docs put it ("positive", "at least 1", "between 1024 and 2147483647")."""

    low: float
    high: float = math.inf
    above: bool = False
    says: str = ""

    def holds(self, value: float) -> bool:
        return (value > self.low if self.above else value >= self.low) and value <= self.high


def option(
    default: Any,
    flag: Flag | None = None,
    *,
    no_flag: str = "",
    doc: str = "",
    choices: tuple[str, ...] = (),
    positive: bool = False,
    at_least: float | None = None,
    between: tuple[float, float] | None = None,
    says: str = "",
) -> Any:
    """An Options field: its default, and its `flag` or why it has none (`no_flag`) with what it means
    (`doc`, the docs' words; a flag's meaning is the flag's doc or help); `choices`, the only values it
    takes (checked by Options, offered by the flag). A number's range, at most one of: `positive`,
    `at_least`, `between` (both ends included); `says`, the range in other words than the plain ones."""
    if (flag is None) == (not no_flag):
        raise TypeError("an option has a flag, or a reason (no_flag) why it has none")
    if flag is None and not doc:
        raise TypeError(f"an option without a flag ({no_flag}) needs its meaning: doc=")
    if flag is not None and doc:
        raise TypeError(f"option {flag.name}: its meaning is the flag's doc (Flag(..., doc=)), not option(doc=)")
    bound = _range(positive, at_least, between, says)
    metadata = {"flag": flag, "no_flag": no_flag, "doc": doc, "choices": choices, "range": bound}
    return dataclasses.field(default=default, metadata=metadata)


def _range(positive: bool, at_least: float | None, between: tuple[float, float] | None, says: str) -> Range | None:
    if positive + (at_least is not None) + (between is not None) > 1:
        raise TypeError("an option's range is one of positive=, at_least= or between=")
    if positive:
        return Range(0, above=True, says=says or "positive")
    if at_least is not None:
        return Range(at_least, says=says or f"at least {at_least}")
    if between is not None:
        return Range(*between, says=says or f"between {between[0]} and {between[1]}")
    if says:
        raise TypeError("says= words a range: give positive=, at_least= or between= with it")
    return None


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's flag; None for an option no flag sets."""
    return field.metadata.get("flag")


def meaning_of(field: dataclasses.Field) -> str:
    """What the option means, as the docs' tables say it: its flag's doc, else its flag's help less
    its default (the tables show the default in a column of its own), else its own doc.

    Raises TypeError for a field declared without option() or with no words of its meaning."""
    flag = flag_of(field)
    if flag is not None:
        return flag.doc or _NAMED_DEFAULT.sub("", flag.help.format(default=field.default))
    if doc := field.metadata.get("doc", ""):
        return doc
    raise TypeError(f"option {field.name!r} has no meaning: declare it with option(default, Flag(...)) or doc=")


def choices_of(field: dataclasses.Field) -> tuple[str, ...]:
    """The only values the option takes; () when any value of its type may do."""
    return field.metadata.get("choices", ())


def range_of(field: dataclasses.Field) -> Range | None:
    """The values the number option takes; None when any value of its type may do."""
    return field.metadata.get("range")


def one_of(choices: tuple[str, ...]) -> str:
    """The choices as an error names them: 'a', 'b' or 'c'."""
    quoted = [repr(choice) for choice in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
