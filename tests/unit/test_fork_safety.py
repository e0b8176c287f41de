"""Worker processes that fork or spawn (a torch DataLoader's): gRPC's fork handlers are turned off
when paramserver is imported, and init() refuses to run in a spawned re-import of the script.
The DataLoader runs themselves are in tests/integration/test_dataloader_workers.py."""

import os
import runpy
import subprocess
import sys

import pytest

from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.errors import ConfigError
from paramserver.base.grpc_fork import GRPC_FORK_SUPPORT_ENV
from paramserver.worker import current


def imported(code: str, value: str | None) -> str:
    """What `code` prints in a fresh interpreter whose environment has GRPC_ENABLE_FORK_SUPPORT=value."""
    env = {k: v for k, v in os.environ.items() if k != GRPC_FORK_SUPPORT_ENV}
    if value is not None:
        env[GRPC_FORK_SUPPORT_ENV] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


REPORT = "import os, paramserver.base.grpc_fork as f; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'], f.grpc_fork_handlers_on)"


@pytest.mark.cluster
@pytest.mark.parametrize("value, expected", [(None, "0"), ("", "0"), ("1", "1"), ("false", "false")])
def test_importing_paramserver_turns_grpc_fork_handlers_off_unless_the_user_chose(value, expected):
    assert imported(REPORT, value) == f"{expected} False"


@pytest.mark.cluster
def test_grpc_imported_first_is_flagged_for_a_warning():
    assert imported("import grpc; " + REPORT, None) == "0 True"
    assert imported("import grpc; " + REPORT, "0") == "0 False"  # the user turned them off in time


def test_init_in_a_spawned_reimport_of_the_script_is_refused_before_it_joins(tmp_path, fresh_context):
    """spawn runs the main script again as __mp_main__ (runpy.run_path, as below): an unguarded
    init() there would join the cluster a second time. Nothing listens at these addresses: a
    connection attempt would wait connect_timeout_s, the refusal comes first."""
    config = NodeConfig(ClusterSpec(ps=("127.0.0.1:9",), worker=("127.0.0.1:9",)), Task("worker", 0),
                        Options(connect_timeout_s=30))
    script = tmp_path / "train.py"
    script.write_text("import paramserver as ps\nps.init(CONFIG)\n")
    with pytest.raises(ConfigError, match=r'Put the training under `if __name__ == "__main__":`'):
        runpy.run_path(str(script), init_globals={"CONFIG": config}, run_name="__mp_main__")
    assert current.existing() is None
