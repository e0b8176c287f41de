"""A process's logging, set up once: human lines (the default) or JSON lines (docs/operations.md, "Logs").

JSON lines (`log_format` "json", python-json-logger) are ready for Loki or ELK; each is one object:

    {"time": "2026-12-04T09:30:00.123456+00:00", "level": "INFO", "logger": "paramserver.node.ps_node",
     "message": "ps 0 serving on 127.0.0.1:41235 ...", "node": "ps-0", "role": "ps",
     "event": "ps_started"}

`node` and `role` name the process ("ps-0", "worker-1", "chief-0", "launcher"); `step`, `event` and
`duration_s` appear when the record carries them (`log.info(..., extra={"event": ..., "duration_s": ...})`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JSON_FIELDS = "%(levelname)s %(name)s %(message)s %(node)s %(role)s"
_RENAMED = {"levelname": "level", "name": "logger"}


class _NodeFields(logging.Filter):
    """Adds the process's node and role to every record the handler writes."""

    def __init__(self) -> None:
        super().__init__()
        self.node = ""
        self.role = ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.node, record.role = self.node, self.role
        return True


_fields = _NodeFields()  # one per process: the node a process is does not change
_handler: logging.Handler | None = None


def json_formatter() -> logging.Formatter:
    """JSON lines: time (ISO 8601, UTC), level, logger, message, node, role, and the record's extras."""
    return JsonFormatter(_JSON_FIELDS, rename_fields=_RENAMED, timestamp="time")


def configure_logging(
    level: str = "INFO",
    log_format: str = "text",
    node: str = "",
    role: str = "",
    stream: TextIO | None = None,
    force: bool = False,
) -> None:
    """Send this process's log records to `stream` (default stderr) as `log_format` lines at `level`.

    Replaces the handler an earlier call installed (and only that one). As logging.basicConfig
    does, leaves a process whose logging was set up by others (handlers on the root logger) as it
    is, unless `force`. Raises ValueError for an unknown level or format, before changing anything.
    """
    global _handler
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger()
    name_node(node, role)
    if not force and any(h is not _handler for h in root.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_fields)
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric)
    _handler = handler


def name_node(node: str, role: str) -> None:
    """Name this process in its log lines from now on (once its role is known)."""
    _fields.node, _fields.role = node, role


def node_name(role: str, index: int) -> str:
    """A node's name in logs: its role and index, e.g. "ps-0", "worker-1"."""
    return f"{role}-{index}"


def as_json_line(line: str, node: str, role: str, **extra: Any) -> str:
    """A child's output line as a JSON line: a JSON object passes as it is (a node's own JSON log
    line); anything else (a print of the script, a progress line) becomes one, as an INFO
    "output" record of `node`."""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    record = {
        "time": datetime.fromtimestamp(time.time(), UTC).isoformat(),
        "level": "INFO",
        "logger": "output",
        "message": line,
        "node": node,
        "role": role,
        **extra,
    }
    return json.dumps(record)
