"""Worker processes that fork or spawn (a torch DataLoader's): gRPC's fork handlers are turned off
when paramserver is imported (checked in fresh interpreters: tests/integration/test_fork_safety_imports.py),
and init() refuses to run in a spawned re-import of the script. The DataLoader runs themselves are in
tests/integration/test_dataloader_workers.py."""

import runpy

import pytest

from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.errors import ConfigError
from paramserver.worker import current


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
