"""How importing paramserver sets gRPC's fork handlers, each checked in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

from paramserver.base.grpc_fork import GRPC_FORK_SUPPORT_ENV


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
