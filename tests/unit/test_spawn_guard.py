"""The fast tier starts no process (tests/spawn_guard.py, installed by tests/conftest.py): a test not
marked `cluster` or `fault` that starts one fails, naming the marker it lacks."""

import multiprocessing
import os
import subprocess
import sys

import pytest
from tests.conftest import _GUARD
from tests.spawn_guard import SpawnRefused


@pytest.fixture
def guard(request):
    """This test's own guard: the test clears what it provoked (at its end) so that it passes itself."""
    return request.node.stash[_GUARD]


def test_an_unmarked_test_cannot_start_a_subprocess(guard):
    with pytest.raises(SpawnRefused, match="not marked `cluster`") as refused:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert "test_an_unmarked_test_cannot_start_a_subprocess" in str(refused.value)
    assert "subprocess.Popen" in str(refused.value)
    assert guard.refused and guard.failure() is not None
    guard.refused.clear()


def test_an_unmarked_test_cannot_fork_or_start_a_multiprocessing_process(guard):
    with pytest.raises(SpawnRefused, match="os.fork"):
        os.fork()
    with pytest.raises(SpawnRefused, match="os.system"):
        os.system("true")
    for method in ("fork", "spawn", "forkserver"):
        process = multiprocessing.get_context(method).Process(target=print)
        with pytest.raises(SpawnRefused, match="multiprocessing Process.start"):
            process.start()
    assert len(guard.refused) == 5
    guard.refused.clear()


def test_a_refused_start_fails_the_test_even_when_swallowed(pytester):
    """The whole hook chain on a small suite: a spawn refused at set-up, one in the body, one whose
    exception the test swallowed: each fails its test with the marker's name; a test that starts
    nothing passes."""
    pytester.makeconftest("""
        import subprocess, sys
        import pytest
        from tests.conftest import (pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown,
                                    pytest_runtest_makereport)

        def pytest_configure(config):
            config.addinivalue_line("markers", "cluster: starts processes")

        @pytest.fixture
        def node():
            subprocess.Popen([sys.executable, "-c", "pass"])
    """)
    pytester.makepyfile("""
        import subprocess, sys

        def test_spawns():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_swallows():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass

        def test_fixture_spawns(node):
            pass

        def test_in_process():
            assert sum([1, 2]) == 3
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_swallows started a process (subprocess.Popen:*but is not marked `cluster`*"])
    assert result.stdout.str().count("mark it @pytest.mark.cluster") >= 3
