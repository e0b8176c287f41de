"""Slurm's compressed lists, as a job step's environment holds them: host lists
(``node[1-3,7],gpu[01-02]``; zero padding kept) and task counts per node (``2(x3),1``).

The text is untrusted: anything malformed is a ConfigError naming the variable and what is wrong,
and the sizes are capped before anything is expanded. Pure functions; thread-safe.
"""

from __future__ import annotations

import itertools
import re

from paramserver.base.errors import ConfigError

MAX_HOSTS = 100_000  # nodes of one list; far beyond any job step, small enough to expand at once
MAX_TASKS = 100_000  # tasks of one step
_MAX_TEXT = 1_000_000  # characters of one variable
_NAME_PART = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")
_COUNT = re.compile(r"([0-9]{1,6})(?:\(x([0-9]{1,6})\))?")


def expand_hosts(text: str, what: str) -> list[str]:
    """The host names of a Slurm host list, in order; `what` names the list in errors (the variable).

    ``a,b``, ``node[1-3,7]``, ``gpu[01-02]`` (the width of a range's first number is kept), several
    brackets in one name (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2). Refused: empty items, nested or
    unbalanced brackets, a range running backwards, characters no host name has, a name listed
    twice, more than MAX_HOSTS names."""
    if not text or len(text) > _MAX_TEXT:
        raise ConfigError(f"{what} must be a Slurm host list such as node[1-4], got {_shown(text)}")
    hosts: list[str] = []
    for item in _split_outside_brackets(text, what):
        hosts += _expand_item(item, what, MAX_HOSTS - len(hosts))
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise ConfigError(f"{what} names host {host!r} twice: {_shown(text)}")
        seen.add(host)
    return hosts


def expand_counts(text: str, what: str) -> list[int]:
    """The tasks on each node of a Slurm task-count list (``2(x3),1`` is [2, 2, 2, 1]); each count is at
    least 1 (every node of a step runs a task), at most MAX_HOSTS nodes and MAX_TASKS tasks in all."""
    if not text or len(text) > _MAX_TEXT:
        raise ConfigError(f"{what} must be Slurm task counts such as 2(x3),1, got {_shown(text)}")
    counts: list[int] = []
    for item in text.split(","):
        match = _COUNT.fullmatch(item)
        if match is None:
            raise ConfigError(f"{what}: {item!r} is not a task count N or N(xM), in {_shown(text)}")
        count, repeat = int(match[1]), int(match[2] or 1)
        if count < 1 or repeat < 1:
            raise ConfigError(f"{what}: {item!r} counts no task (each node of a step runs at least one)")
        if len(counts) + repeat > MAX_HOSTS or sum(counts) + count * repeat > MAX_TASKS:
            raise ConfigError(f"{what} counts more than {MAX_HOSTS} nodes or {MAX_TASKS} tasks: {_shown(text)}")
        counts += [count] * repeat
    return counts


def _split_outside_brackets(text: str, what: str) -> list[str]:
    items, start, inside = [], 0, False
    for at, char in enumerate(text):
        if char == "[":
            if inside:
                raise ConfigError(f"{what}: nested '[' at character {at} of {_shown(text)}")
            inside = True
        elif char == "]":
            if not inside:
                raise ConfigError(f"{what}: ']' without '[' at character {at} of {_shown(text)}")
            inside = False
        elif char == "," and not inside:
            items.append(text[start:at])
            start = at + 1
    if inside:
        raise ConfigError(f"{what}: '[' never closed in {_shown(text)}")
    items.append(text[start:])
    if any(not item for item in items):
        raise ConfigError(f"{what} has an empty host name: {_shown(text)}")
    return items


def _expand_item(item: str, what: str, room: int) -> list[str]:
    """One comma-separated item: literal parts and bracketed ranges, expanded as their product."""
    parts: list[list[str]] = []
    size = 1
    for at, piece in enumerate(re.split(r"\[([^\]]*)\]", item)):
        if at % 2 == 0:  # outside brackets: a literal part of the name
            if not _NAME_PART.fullmatch(piece):
                raise ConfigError(f"{what}: {item!r} holds characters no host name has")
            parts.append([piece])
            continue
        numbers = _range_numbers(piece, item, what, room)
        size *= len(numbers)
        if size > room:
            raise ConfigError(f"{what} names more than {MAX_HOSTS} hosts (at {item!r})")
        parts.append(numbers)
    return ["".join(names) for names in itertools.product(*parts)]


def _range_numbers(text: str, item: str, what: str, room: int) -> list[str]:
    """The numbers of one bracket (``1-3,07``), each as wide as the range's first number."""
    numbers: list[str] = []
    for piece in text.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise ConfigError(f"{what}: [{text}] in {item!r} must hold numbers and ranges such as [1-3,7]")
        low, high = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if high < low:
            raise ConfigError(f"{what}: range {piece!r} in {item!r} runs backwards")
        if len(numbers) + high - low + 1 > room:
            raise ConfigError(f"{what} names more than {MAX_HOSTS} hosts (at {item!r})")
        width = len(match[1])
        numbers += [str(n).zfill(width) for n in range(low, high + 1)]
    return numbers


def _shown(text: str) -> str:
    """The text as an error quotes it: at most 200 characters."""
    return repr(text if len(text) <= 200 else text[:200] + "...")
