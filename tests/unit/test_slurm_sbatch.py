"""`paramserver slurm`: the sbatch script's text (launch/slurm/sbatch.py) and the refusals of bad
arguments. The script running on a real Slurm cluster: tests/engines/test_slurm.py."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError
from paramserver.launch import cli
from paramserver.launch.slurm.sbatch import BatchJob, render

CKPT = {"checkpoint_dir": "/shared/run1"}


def _directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def _assigned(text: str, name: str) -> dict:
    """The JSON a shell line `NAME='...'` of the script assigns, as the shell reads it."""
    (line,) = [line for line in text.splitlines() if line.startswith(f"{name}=")]
    return json.loads(shlex.split(line.split("=", 1)[1])[0])


def test_a_homogeneous_job_runs_every_node_in_one_step_with_slurm_ps():
    text = render(BatchJob("train.py", ("--epochs", "3"), ps=2, workers=3, nodes=2, time="01:30:00", options=CKPT))
    assert _directives(text) == [
        "--job-name=paramserver",
        "--output=paramserver-%j.out",
        "--open-mode=append",
        "--requeue",
        "--signal=B:TERM@120",
        "--time=01:30:00",
        "--ntasks=5",
        "--nodes=2",
    ]
    assert "hetjob" not in text
    assert 'srun --kill-on-bad-exit=0 "$PYTHON" -m paramserver node train.py --epochs 3 &' in text
    assert _assigned(text, "OPTIONS") == {"checkpoint_dir": "/shared/run1", "slurm_ps": 2, "stop_ps_at_end": True}
    assert _assigned(text, "RESUMING") == {**_assigned(text, "OPTIONS"), "resume": True}
    Options.from_dict(_assigned(text, "RESUMING"))  # what every node reads back


def test_a_heterogeneous_job_gives_the_ps_memory_and_each_worker_a_gpu_node():
    text = render(BatchJob("train.py", ps=2, workers=4, het=True, gpus_per_worker=2, ps_mem="8G", options=CKPT))
    directives = _directives(text)
    het = directives.index("hetjob")
    assert directives[het - 3 : het] == ["--ntasks=2", "--nodes=1", "--mem=8G"]
    assert directives[het + 1 :] == ["--ntasks=4", "--nodes=4", "--ntasks-per-node=1", "--gres=gpu:2"]
    # job-wide directives come before the first component ends: after `hetjob` they would be component 1's
    assert directives.index("--requeue") < het and directives.index("--signal=B:TERM@120") < het
    assert "srun --het-group=0,1 --kill-on-bad-exit=0" in text
    assert "slurm_ps" not in _assigned(text, "OPTIONS")  # component 0 is the PS


def test_slurms_warning_reaches_every_task_and_a_preempted_step_is_requeued():
    text = render(BatchJob("train.py", ps=3, workers=2, grace=300, options={**CKPT, "preempt_grace_s": 60}))
    assert "#SBATCH --signal=B:TERM@300" in text  # the batch shell, which passes it on
    trap = text[text.index("preempt() {") : text.index("trap preempt TERM")]
    assert 'scancel --signal=TERM "$SLURM_JOB_ID.0"' in trap  # every task of the nodes' step, the PS too
    # warned, or the step's tasks stopped by a TERM (scancel --signal=TERM JOBID): requeued
    assert 'if [ "$preempted" = 1 ] || [ "$code" = 143 ]; then' in text
    assert 'scontrol requeue "$SLURM_JOB_ID" && exit 0' in text
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then OPTIONS=$RESUMING; fi' in text
    assert text.index("OPTIONS=$RESUMING") < text.index("export PARAMSERVER_OPTIONS=$OPTIONS")


def test_script_arguments_flags_and_paths_are_quoted_for_the_shell():
    text = render(
        BatchJob(
            "/data/my run/train.py",
            ("--name", "a b", "$HOME"),
            python="/opt/venv/bin/python",
            port=31000,
            partition="gpu",
            name="ctr",
            output="/logs/ctr-%j.out",
            options={**CKPT, "mode": "sync"},
        )
    )
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert shlex.split(srun)[-6:-1] == ["node", "/data/my run/train.py", "--name", "a b", "$HOME"]
    assert "PYTHON=/opt/venv/bin/python" in text
    assert {"#SBATCH --partition=gpu", "#SBATCH --job-name=ctr", "#SBATCH --output=/logs/ctr-%j.out"} <= set(
        text.splitlines()
    )
    assert _assigned(text, "OPTIONS")["slurm_port"] == 31000
    assert _assigned(text, "OPTIONS")["mode"] == "sync"


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"ps": 0}, "--ps and --workers must be at least 1"),
        ({"workers": 0}, "--ps and --workers must be at least 1"),
        ({"options": {}}, "--checkpoint-dir is needed"),
        ({"options": {"checkpoint_dir": "runs/1"}}, "must be an absolute path"),
        ({"gpus_per_worker": 1}, "give --het too"),
        ({"ps_mem": "8G"}, "give --het too"),
        ({"het": True, "ps_mem": "lots"}, "--ps-mem 'lots'"),
        ({"het": True, "nodes": 2}, "--nodes spreads a homogeneous job"),
        ({"nodes": 9}, "--nodes 9 is more than the 2 tasks"),
        ({"time": "1h"}, "--time '1h'"),
        ({"grace": 20}, "--grace 20 must be more than --preempt-grace 20"),
        ({"name": "my job"}, "--name 'my job'"),
        ({"partition": "a;b"}, "--partition 'a;b'"),
        ({"port": 70000}, "--port must be from 1 to 65000"),
        ({"python": "python3 -u"}, "--python 'python3 -u'"),
        ({"script": ""}, "the training SCRIPT is missing"),
        ({"options": {**CKPT, "mode": "bogus"}}, "mode"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(kwargs, says):
    given = {"script": "train.py", "options": CKPT, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(says)):
        BatchJob(**given)


def test_every_problem_is_named_in_one_error():
    with pytest.raises(ConfigError) as caught:
        BatchJob("train.py", ps=0, time="soon", options={})
    assert all(part in str(caught.value) for part in ("--ps and --workers", "--time 'soon'", "--checkpoint-dir"))


@pytest.mark.parametrize("time", ["30", "30:00", "01:30:00", "2-00:00:00", "2-12"])
def test_slurms_time_forms_are_taken(time):
    assert f"#SBATCH --time={time}" in render(BatchJob("train.py", time=time, options=CKPT))


def test_the_command_line_builds_the_job_from_its_flags(tmp_path, capsys):
    args = cli.parse_args(
        [
            "slurm",
            "--ps",
            "2",
            "--workers",
            "3",
            "--het",
            "--gpus-per-worker",
            "1",
            "--ps-mem",
            "4G",
            "--time",
            "02:00:00",
            "--grace",
            "90",
            "--partition",
            "gpu",
            "--python",
            "/venv/bin/python",
            "train.py",
            "--",
            "--epochs",
            "2",
        ]
    )
    assert (args.ps, args.workers, args.het, args.gpus_per_worker, args.ps_mem) == (2, 3, True, 1, "4G")
    assert (args.time, args.grace, args.partition, args.python, args.script) == (
        "02:00:00",
        90,
        "gpu",
        "/venv/bin/python",
        "train.py",
    )
    assert cli.commands.strip_dashes(args.args) == ["--epochs", "2"]


def test_the_command_refuses_a_job_without_a_checkpoint_dir_naming_it(capsys):
    from paramserver.launch.cli.entry import main

    assert main(["slurm", "--ps", "1", "--workers", "2", "train.py"]) == 2
    assert "paramserver: error: --checkpoint-dir is needed" in capsys.readouterr().err
