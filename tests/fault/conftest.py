"""Fixtures of the fault tests: `hosts`, a network namespace per node (tests/multihost.py)."""

from __future__ import annotations

import pytest
from tests import multihost


@pytest.fixture
def hosts(procs):
    """A Hosts of this test; skipped where namespaces cannot be made. The nodes' logs are printed at
    teardown (pytest shows them when the test failed), then everything is deleted."""
    reason = multihost.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    multihost.remove_leftovers()
    made = multihost.Hosts(procs)
    try:
        made.setup()
        yield made
    finally:
        print(made.logs())
        made.teardown()
