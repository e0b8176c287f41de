"""The ranges of the options and their consistency with each other: what `Options` checks once its
types are right. A simple range is declared with its field (base/options/fields.py, `option(...,
at_least=1)`) and checked here with every other; what reads several options, or more than a range,
is written here. Each problem names its option; `Options` raises them all as one ConfigError."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.consistency_spec import ConsistencySpec, parse_schedule
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.options.fields import choices_of, one_of, range_of

if TYPE_CHECKING:
    from paramserver.base.options.options import Options

MIN_TABLE_MEMORY_BUDGET = 1 << 16  # the least table_memory_budget (a few hundred rows in memory)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")


def range_problems(
    options: Options, num_workers: int | None, skip: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """Problems of the well-typed options (those in `skip` are not), each naming its option."""
    found: list[str] = []

    def need(name: str, ok: Callable[[Any], bool], rule: str) -> None:
        if name not in skip and not ok(getattr(options, name)):
            found.append(f"option {name!r} must be {rule}, got {getattr(options, name)!r}")

    def needs(name: str, *others: str) -> bool:  # may a check of `name` that reads `others` run?
        return not skip.intersection((name, *others))

    for f in fields(options):  # the choices and simple ranges, declared with their fields
        if choices := choices_of(f):
            need(f.name, choices.__contains__, one_of(choices))
        if (bound := range_of(f)) is not None:
            need(f.name, bound.holds, bound.says)
    if needs("max_payload_bytes", "max_message_bytes"):
        need(
            "max_payload_bytes",
            lambda v: v >= options.max_message_bytes,
            f"at least max_message_bytes ({options.max_message_bytes})",
        )
    found += _tier_problems(options, skip)
    need("metrics_bind", _is_host, "a host name or IP address to listen on, e.g. 127.0.0.1, 0.0.0.0 or ::")
    if "compression" not in skip:
        try:
            CompressionSpec.parse(options.compression)
        except InvalidArgumentError as exc:
            found.append(f"option 'compression' is not valid: {exc}")
    for name, other in (("tls_cert", "tls_key"), ("tls_key", "tls_cert")):
        if needs(name, other) and getattr(options, name) and not getattr(options, other):
            found.append(f"option {name!r} needs {other} too")
    if needs("tls_ca", "tls_cert") and options.tls_ca and not options.tls_cert:
        found.append("option 'tls_ca' needs 'tls_cert' and 'tls_key' (mutual TLS: every node shows its own)")
    if needs("heartbeat_timeout_s", "heartbeat_s") and options.heartbeat_s > 0:
        need(
            "heartbeat_timeout_s",
            lambda v: v > 2 * options.heartbeat_s,
            f"more than twice heartbeat_s ({options.heartbeat_s})",
        )
    found += _dense_sync_problems(options, needs)
    found += _elastic_problems(options, num_workers, needs)
    for name in ("checkpoint_every", "checkpoint_every_seconds", "resume"):
        if needs(name, "checkpoint_dir") and getattr(options, name) and not options.checkpoint_dir:
            found.append(f"option {name!r} needs a checkpoint_dir")
    if needs("recovery", "checkpoint_dir") and options.recovery == "partial" and not options.checkpoint_dir:
        found.append("option 'recovery' 'partial' needs a checkpoint_dir (the lost shard is restored from it)")
    return found + _mode_problems(options, num_workers, skip)


def _dense_sync_problems(options: Options, needs: Callable[..., bool]) -> list[str]:
    """What dense_sync 'allreduce' rules out."""
    found = []
    if needs("dense_sync") and options.dense_sync == "allreduce":
        # a timed checkpoint pauses each worker after whichever step it learns of it (a step count's
        # pauses all at that step), and backup workers leave steps behind: the all-reduces must meet
        if needs("checkpoint_every_seconds") and options.checkpoint_every_seconds:
            found.append(
                "option 'checkpoint_every_seconds' needs dense_sync 'ps' (with 'allreduce' the "
                "workers must pause at the same step: use checkpoint_every)"
            )
        if needs("backup_workers") and options.backup_workers:
            found.append("option 'backup_workers' needs dense_sync 'ps' (the dense all-reduce waits for every worker)")
    return found


def _elastic_problems(options: Options, num_workers: int | None, needs: Callable[..., bool]) -> list[str]:
    """What an elastic run (max_workers > 0) rules out: a worker set the steps count on."""
    if not needs("max_workers") or not options.max_workers:
        return []
    found = []
    if needs("backup_workers") and options.backup_workers:
        found.append("option 'backup_workers' needs max_workers 0 (an elastic run's steps wait for those present)")
    if needs("dense_sync") and options.dense_sync == "allreduce":
        found.append("option 'max_workers' needs dense_sync 'ps' (the dense all-reduce's group is fixed at start)")
    if num_workers is not None and num_workers > options.max_workers:
        listed = f"the {num_workers} workers listed"
        found.append(f"option 'max_workers' must be at least {listed}, got {options.max_workers}")
    return found


def _tier_problems(options: Options, skip: frozenset[str] | set[str]) -> list[str]:
    """table_memory_budget and spill_dir: both or neither, and a budget the tables may take."""
    found = []
    budget = options.table_memory_budget
    if "table_memory_budget" not in skip:
        if budget != 0 and budget < MIN_TABLE_MEMORY_BUDGET:
            least = MIN_TABLE_MEMORY_BUDGET
            found.append(f"option 'table_memory_budget' must be 0 (off) or at least {least}, got {budget!r}")
        elif "max_table_memory_bytes" not in skip and 0 < options.max_table_memory_bytes < budget:
            # a derived max_table_memory_bytes (0) is checked against the budget once a PS derives it
            found.append(
                f"option 'table_memory_budget' must be at most max_table_memory_bytes "
                f"({options.max_table_memory_bytes}), got {budget!r}"
            )
        elif budget and "spill_dir" not in skip and not options.spill_dir:
            found.append("option 'table_memory_budget' needs a spill_dir (where the rows beyond it go)")
    if not skip.intersection(("spill_dir", "table_memory_budget")) and options.spill_dir and not budget:
        found.append("option 'spill_dir' needs a table_memory_budget (rows spill only beyond a budget)")
    return found


def _mode_problems(options: Options, num_workers: int | None, skip: frozenset[str] | set[str]) -> list[str]:
    """mode, backup_workers and mode_schedule, as ConsistencySpec and the schedule read them."""
    found = []
    if skip.intersection(("mode", "backup_workers")):
        workers = 1
    else:  # unknown: as many as the backups allow
        workers = num_workers if num_workers is not None else max(options.backup_workers + 1, 1)
    if needs_mode := "mode" not in skip:
        try:
            ConsistencySpec.parse(options.mode, max(workers, 1))
        except InvalidArgumentError as exc:
            found.append(f"option 'mode' is not valid: {exc}")
            needs_mode = False
    if needs_mode and "backup_workers" not in skip and options.backup_workers > 0:
        try:
            ConsistencySpec.parse(options.mode, workers, options.backup_workers)
        except InvalidArgumentError as exc:
            found.append(f"option 'backup_workers' is not valid: {exc}")
    if "mode_schedule" not in skip:
        try:
            for change in parse_schedule(options.mode_schedule):
                ConsistencySpec.parse(change.mode, max(workers, 1))
        except InvalidArgumentError as exc:
            found.append(f"option 'mode_schedule' is not valid: {exc}")
    return found


def _is_host(value: str) -> bool:
    """An IP address, or a host name (letters, digits, '-', '.'): what a server may listen on."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOST_NAME.fullmatch(value))
