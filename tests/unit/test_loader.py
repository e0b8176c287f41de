"""What a loader may run, refused before any process starts (the loader process itself:
tests/integration/test_loader_process.py)."""

import pytest

from paramserver.base.errors import InvalidArgumentError
from paramserver.data import criteo
from paramserver.data.loader import BatchLoader


def _local_batches():
    yield 1


def test_only_importable_functions_can_run_in_a_loader():
    with pytest.raises(InvalidArgumentError, match="module-level"):
        BatchLoader(lambda: iter([1]))
    with pytest.raises(InvalidArgumentError, match="depth"):
        BatchLoader(criteo.array_batches, "x", 1, depth=0)
