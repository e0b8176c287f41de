"""The audit log of a PS or the coordinator: one JSON object per line, appended (docs/security.md).

Each line: {"time" (ISO 8601, UTC), "node", "who" (token name or "anonymous"), "peer", "what"
(method or event), "outcome" ("ok" or the refusal's status code), "detail" (an object)}. Lines go to
the file Options.audit_log, opened for appending (never truncated) and written one line per write
call, unbuffered; with "" they go to the logger "paramserver.audit" as the same JSON text: refused
calls at WARNING, the others at DEBUG (a default log tells the run's story, not every call).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from typing import Any

from paramserver.base.errors import ConfigError

log = logging.getLogger("paramserver.audit")


class AuditLog:
    """Thread-safe; `close()` when the node stops (later records go to the logger)."""

    def __init__(self, node: str, fd: int | None = None, path: str = "") -> None:
        self.node = node
        self.path = path
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str, node: str) -> AuditLog:
        """The audit log of `node` in file `path` (created 0600 if missing), or on the logger if "" ."""
        if not path:
            return cls(node)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open audit log {path}: {exc}") from None
        return cls(node, fd, path)

    def record(
        self,
        what: str,
        outcome: str = "ok",
        who: str = "anonymous",
        peer: str = "",
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Append one line. A failed write is logged, never raised: a call's answer does not depend on it."""
        line = json.dumps(
            {
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "node": self.node,
                "who": who,
                "peer": peer,
                "what": what,
                "outcome": outcome,
                "detail": detail or {},
            },
            default=str,
            separators=(",", ":"),
        )
        with self._lock:
            if self._fd is None:  # the node's log: refusals stand out, the rest is detail (DEBUG)
                log.log(logging.DEBUG if outcome == "ok" else logging.WARNING, "%s", line)
                return
            try:
                os.write(self._fd, (line + "\n").encode())  # O_APPEND: one write, one whole line at the end
            except OSError as exc:
                log.error("cannot append to audit log %s: %s; the record was: %s", self.path, exc, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
