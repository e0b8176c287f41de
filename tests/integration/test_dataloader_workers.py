"""A torch DataLoader with worker processes inside a paramserver worker: fork (torch's default on
Linux) and spawn, in every consistency mode, under `paramserver run` and `paramserver node`.

gRPC's fork handlers, left on, restart gRPC's threads inside every forked child on state copied
from the parent's busy threads, and the DataLoader's workers crashed (segfault) or hung; the
package turns them off when it is imported (paramserver/__init__.py). The children here get an
environment without GRPC_ENABLE_FORK_SUPPORT (this pytest process has it, from that import), so
what is tested is what the library does by itself.

Verdicts come from what the runs report (exit codes, every sample index each worker consumed,
the loader processes that made each epoch's batches), never from timing; the timeouts below
only stop a run that hangs, as the fork handlers made DataLoader workers do.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.conftest import ROOT
from tests.ports import free_port

from paramserver.base.grpc_fork import GRPC_FORK_SUPPORT_ENV

pytestmark = pytest.mark.cluster  # 9 whole clusters: about a minute for this file on 2 idle cores

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
TRAIN = str(SCRIPTS / "train_dataloader.py")
FORK_PROBE = str(SCRIPTS / "fork_with_grpc.py")
MODES = {"async": [], "sync": ["--mode", "sync"], "sync+backup": ["--mode", "sync", "--backup-workers", "1"],
         "ssp": ["--mode", "ssp:1"]}
SAMPLES, BATCH = 32, 4
HANG_S = 180  # only a hung run gets near this


def clean_env(procs) -> dict[str, str]:
    env = procs.env()
    env.pop(GRPC_FORK_SUPPORT_ENV, None)
    return env


def problems(code: int, out: str, out_dir, workers: int, epochs: int, start_method: str,
             loader_workers: int) -> list[str]:
    """What went wrong in one run (empty: every worker consumed every sample exactly `epochs` times,
    each epoch from `loader_workers` processes of its own started with `start_method`)."""
    found = []
    if code != 0:
        found.append(f"exit code {code}")
    for crash in ("Segmentation fault", "Fatal Python error", "exited unexpectedly"):
        if crash in out:
            found.append(f"output says {crash!r}")
    for worker in range(workers):
        path = out_dir / f"worker{worker}.json"
        if not path.exists():
            found.append(f"worker {worker} wrote no record")
            continue
        record = json.loads(path.read_text())
        if record["seen"] != {str(i): epochs for i in range(SAMPLES)}:
            counts = sorted(set(record["seen"].values()))
            found.append(f"worker {worker} consumed {len(record['seen'])} distinct samples, counts {counts}")
        if record["steps"] != epochs * SAMPLES // BATCH:
            found.append(f"worker {worker} took {record['steps']} steps")
        if record["start_method"] != start_method:
            found.append(f"worker {worker}'s loader started its processes with {record['start_method']}")
        per_epoch = record["loader_pids"]
        if len(per_epoch) != epochs or any(len(pids) != loader_workers or record["pid"] in pids
                                           for pids in per_epoch):
            found.append(f"worker {worker}'s batches came from processes {per_epoch} (worker pid {record['pid']})")
    return found


def launch(procs, tmp_path, name: str, mode: str, context: str, epochs: int,
           loader_workers: int) -> tuple[list[str], str]:
    """One `paramserver run` of 1 PS and 2 workers; (its problems, its output)."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    argv = [sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--progress-every", "0",
            *MODES[mode], TRAIN, "--", "--out-dir", str(out_dir), "--samples", str(SAMPLES), "--batch", str(BATCH),
            "--epochs", str(epochs), "--loader-workers", str(loader_workers), "--context", context]
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(procs))
    try:
        out, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return [f"still running after {HANG_S}s (hung)"], out
    found = problems(proc.returncode, out, out_dir, 2, epochs, context, loader_workers)
    if not found:
        summary = json.loads(out.strip().splitlines()[-1])
        if summary["steps"] != 2 * epochs * SAMPLES // BATCH:
            found.append(f"the launcher counted {summary['steps']} steps")
    return found, out


def test_a_forked_child_of_a_busy_grpc_process_starts_no_grpc_thread(procs):
    """The mechanism itself, in a second: gRPC serving and calling on three threads, 10 forks."""
    proc = procs.start([sys.executable, FORK_PROBE, "--forks", "10"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=clean_env(procs))
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1]) == {"child_threads": [1] * 10}, out


def run_all(procs, tmp_path, runs: list[tuple[str, str, str, int, int]]) -> dict[str, list[str]]:
    """Launch (name, mode, context, epochs, loader processes) runs, two at a time (this file's time on 2 cores: their
    start-up is CPU work, the rest is waiting); returns the problems of each failed run."""
    def one(run):
        name, mode, context, epochs, loader_workers = run
        found, out = launch(procs, tmp_path, name, mode, context, epochs, loader_workers)
        if found:
            print(f"{name} ({mode}) failed: {found}\n{out[-3000:]}")
        return f"{name} ({mode})", found

    with ThreadPoolExecutor(2) as pool:
        return {name: found for name, found in pool.map(one, runs) if found}


def test_forked_dataloader_workers_deliver_every_sample_in_every_mode(procs, tmp_path):
    """4 runs, one per mode, each 2 workers x 4 epochs x 3 loader processes: 96 forks of a worker
    whose gRPC threads are busy, 24 per mode. Every run must end cleanly with every sample seen 4 times.
    (Each fork is a trial of its own, made while the worker's threads run, whatever the run: more forks
    per run and fewer runs is the same 96 trials for a third of the cluster start-ups, this test's cost.)"""
    runs = [(f"fork-{mode}", mode, "fork", 4, 3) for mode in MODES]
    failed = run_all(procs, tmp_path, runs)
    assert not failed, f"{len(failed)} of {len(runs)} runs failed: {failed}"
    assert procs.leftovers() == []


def test_spawned_dataloader_workers_reimport_the_script_and_deliver_every_sample_in_every_mode(procs, tmp_path):
    """spawn: each loader process is a fresh interpreter that imports the user's script again
    (as __mp_main__, from the runpy-run __main__ of `paramserver node`); its guard keeps it out.
    One run per mode, 1 epoch, 1 loader process per worker: a spawned process costs a torch import,
    seconds of CPU (the node test below spawns 2 at once)."""
    failed = run_all(procs, tmp_path, [(f"spawn-{mode}", mode, "spawn", 1, 1) for mode in MODES])
    assert not failed, f"{len(failed)} of {len(MODES)} runs failed: {failed}"
    assert procs.leftovers() == []


def test_dataloader_workers_under_paramserver_node(procs, tmp_path):
    """`paramserver node` from TF_CONFIG (as on several hosts), with spawn: the script the loader
    processes import again is the one the node ran (fork there is what every test above runs:
    `paramserver run`'s workers are `paramserver node` processes)."""
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}"]}

    def node(role: str, *args: str) -> subprocess.Popen:
        env = clean_env(procs)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": role, "index": 0}})
        return procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    ps_node = node("ps")
    worker = node("worker", TRAIN, "--out-dir", str(tmp_path), "--samples", str(SAMPLES), "--batch", str(BATCH),
                  "--epochs", "1", "--loader-workers", "2", "--context", "spawn")
    out, _ = worker.communicate(timeout=HANG_S)
    found = problems(worker.returncode, out, tmp_path, 1, 1, "spawn", 2)
    assert not found, f"{found}\n{out}"
    ps_node.terminate()
    assert ps_node.wait(30) == 0
