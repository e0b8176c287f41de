"""security/audit.py: JSON lines, appended, one whole line per record from any thread; "" goes to the logger."""

import json
import logging
import threading
from datetime import datetime

import pytest
from tests.wait import finished

from paramserver.base.errors import ConfigError
from paramserver.security.audit import AuditLog


def test_records_are_json_lines_appended_to_what_was_there(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text('{"earlier": true}\n')
    audit = AuditLog.open(str(path), "ps-0")
    audit.record("Checkpoint", "ok", "worker-0", "ipv4:127.0.0.1:5", {"name": "ckpt-000000001"})
    audit.record("SetMode", "PERMISSION_DENIED", "worker-1", "ipv4:127.0.0.1:6", {"message": "no"})
    audit.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"earlier": True}
    first, second = map(json.loads, lines[1:])
    assert first["time"].endswith("+00:00") and datetime.fromisoformat(first["time"]).utcoffset().total_seconds() == 0
    assert {k: first[k] for k in ("node", "who", "peer", "what", "outcome", "detail")} == {
        "node": "ps-0", "who": "worker-0", "peer": "ipv4:127.0.0.1:5", "what": "Checkpoint", "outcome": "ok",
        "detail": {"name": "ckpt-000000001"}}
    assert (second["what"], second["outcome"]) == ("SetMode", "PERMISSION_DENIED")


def test_concurrent_records_are_whole_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = AuditLog.open(str(path), "coordinator")
    threads = [threading.Thread(target=lambda n=n: [audit.record("Join", detail={"writer": n, "i": i, "pad": "x" * 500})
                                                    for i in range(200)], name=f"audit-writer{n}")
               for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        finished(thread, f"{thread.name} to write its 200 records")
    audit.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((r["detail"]["writer"], r["detail"]["i"]) for r in records) == [
        (n, i) for n in range(4) for i in range(200)]


def test_without_a_path_records_go_to_the_audit_logger(caplog):
    audit = AuditLog.open("", "ps-1")
    with caplog.at_level(logging.DEBUG, logger="paramserver.audit"):
        audit.record("Restore", detail={"checkpoint": None})
        audit.record("Shutdown", "PERMISSION_DENIED", who="worker-0")
    restore, refused = [r for r in caplog.records if r.name == "paramserver.audit"]
    assert json.loads(restore.getMessage())["what"] == "Restore"
    assert (restore.levelno, refused.levelno) == (logging.DEBUG, logging.WARNING)  # refusals stand out at INFO


def test_an_unwritable_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot open audit log"):
        AuditLog.open(str(tmp_path / "missing-dir" / "audit.jsonl"), "ps-0")
