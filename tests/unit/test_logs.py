"""launch/logs.py: JSON lines carry node, role and the record's step / event / duration_s; human lines
stay the default; the launcher turns its children's output into JSON lines too."""

import io
import json
import logging

import pytest

from paramserver.launch import logs
from paramserver.launch.local.processes import LineWriter


@pytest.fixture
def root_logging():
    """Leaves the root logger as the test found it."""
    root = logging.getLogger()
    handlers, level, ours = list(root.handlers), root.level, logs._handler
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._handler = ours
    logs.name_node("", "")


def test_json_lines_carry_node_role_and_the_records_extras(root_logging):
    out = io.StringIO()
    logs.configure_logging("INFO", "json", node="ps-0", role="ps", stream=out, force=True)
    log = logging.getLogger("paramserver.test")
    log.info("checkpoint %s written", "ckpt-1", extra={"event": "checkpoint_saved", "duration_s": 0.25, "step": 7})
    log.debug("not at INFO")
    logs.name_node("worker-1", "worker")
    log.warning("plain")
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["message"] == "checkpoint ckpt-1 written" and first["level"] == "INFO"
    assert first["logger"] == "paramserver.test" and first["time"].endswith("+00:00")
    assert (first["node"], first["role"]) == ("ps-0", "ps")
    assert (first["event"], first["duration_s"], first["step"]) == ("checkpoint_saved", 0.25, 7)
    assert (second["node"], second["role"], second["level"]) == ("worker-1", "worker", "WARNING")
    assert "event" not in second and "duration_s" not in second and "step" not in second


def test_text_lines_are_the_default_and_a_second_call_replaces_the_first(root_logging):
    first, second = io.StringIO(), io.StringIO()
    logs.configure_logging("INFO", "json", stream=first, force=True)
    logs.configure_logging("INFO", stream=second, force=True)
    logging.getLogger("paramserver.test").info("hello", extra={"event": "x"})
    assert first.getvalue() == ""
    line = second.getvalue().strip()
    assert line.endswith(" INFO paramserver.test: hello") and not line.startswith("{")


def test_logging_set_up_by_others_stays_unless_forced(root_logging):
    theirs, ours = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(theirs)]
    logs.configure_logging("INFO", "json", stream=ours)
    logging.getLogger("paramserver.test").warning("kept")
    assert "kept" in theirs.getvalue() and ours.getvalue() == ""


@pytest.mark.parametrize("level, log_format, word", [("LOUD", "json", "level"), ("INFO", "xml", "format")])
def test_a_bad_level_or_format_is_refused_and_changes_nothing(root_logging, level, log_format, word):
    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out, force=True)
    with pytest.raises(ValueError, match=word):
        logs.configure_logging(level, log_format, stream=io.StringIO(), force=True)
    logging.getLogger("paramserver.test").info("still here")
    assert json.loads(out.getvalue())["message"] == "still here"


def test_the_launchers_lines_become_json_lines_naming_their_node():
    out = io.StringIO()
    writer = LineWriter(out, json_lines=True)
    own = json.dumps({"message": "from the node", "node": "ps-0"})
    writer.write("ps0", own)
    writer.write("worker1", "a print of the script")
    writer.write("run", "cluster restarted in 1.00s", event="rollback_done", duration_s=1.0)
    lines = out.getvalue().splitlines()
    assert lines[0] == own
    printed, restarted = json.loads(lines[1]), json.loads(lines[2])
    assert (printed["node"], printed["role"], printed["message"]) == ("worker-1", "worker", "a print of the script")
    assert (restarted["node"], restarted["event"], restarted["duration_s"]) == ("launcher", "rollback_done", 1.0)


def test_the_launchers_lines_stay_prefixed_text_by_default():
    out = io.StringIO()
    LineWriter(out).write("ps0", '{"a": 1}')
    assert out.getvalue() == '[ps0] {"a": 1}\n'
