"""`--log-format json` on real processes: a PS node and a whole `paramserver run` write JSON lines
only, each naming its node and role; the long operations carry event and duration_s."""

import json
import signal
import subprocess
import sys

import pytest
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster  # real processes

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


def json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line: a JSON object, or this fails


def ps_log(procs, argv: list[str], **env: str) -> str:
    """A PS node's stderr from its start to its stop (SIGTERM)."""
    proc = procs.start([sys.executable, "-m", "paramserver", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, env=procs.env(**env))
    assert proc.stdout.readline().startswith("PARAMSERVER_READY")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


@pytest.mark.parametrize("how", ["flag", "options"])
def test_a_ps_node_writes_json_lines_with_its_events(procs, how):
    flags = ["--log-format", "json"] if how == "flag" else []
    env = {"PARAMSERVER_OPTIONS": json.dumps({"log_format": "json"})} if how == "options" else {}
    records = json_lines(ps_log(procs, ["node", *flags, "--role", "ps", "--index", "1", "--bind", "127.0.0.1:0"],
                                **env))
    assert records and all((r["node"], r["role"]) == ("ps-1", "ps") for r in records)
    events = {r.get("event"): r for r in records}
    assert "ps_started" in events and "ps_stopped" in events
    assert events["ps_stopped"]["duration_s"] >= 0


def test_text_lines_stay_the_default(procs):
    err = ps_log(procs, ["node", "--role", "ps", "--bind", "127.0.0.1:0"])
    lines = err.splitlines()
    assert lines and not any(line.startswith("{") for line in lines)
    assert any(" INFO paramserver.node.ps_node: ps 0 serving on" in line for line in lines)


def test_a_run_writes_json_lines_from_every_node(procs, tmp_path):
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--log-format",
                        "json", "--progress-every", "0.5", "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
                        "10", SMALL, "--", "--steps", "20"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    records = json_lines(out)
    summary = records.pop()  # the closing line: the run's figures
    assert summary["steps"] == 40
    nodes = {(r["node"], r["role"]) for r in records}
    assert {("launcher", "launcher"), ("ps-0", "ps"), ("worker-0", "worker"), ("worker-1", "worker")} <= nodes
    assert any(r["message"].startswith("worker 1/2 done") for r in records if r["node"] == "worker-1")  # a print
    assert any(r.get("event") == "ps_started" for r in records if r["node"] == "ps-0")
    saved = [r for r in records if r.get("event") == "checkpoint_saved"]
    assert saved and all(r["node"] == "worker-0" and r["duration_s"] >= 0 for r in saved)
    assert 20 in {r["step"] for r in saved}  # the final checkpoint
    assert procs.leftovers() == []
