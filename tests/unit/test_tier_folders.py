"""The rule tests/conftest.py applies when TIER_FOLDERS_CHECKED is on (tests/tiers.py)."""

import pytest
from tests import tiers


@pytest.mark.parametrize(
    "folder, markers, home",
    [
        ("unit", {"cluster"}, "tests/integration"),
        ("unit", {"parity", "parametrize"}, "tests/integration"),
        ("unit", {"fault"}, "tests/fault"),
    ],
)
def test_a_tier_marked_test_under_unit_is_sent_to_its_tiers_folder(folder, markers, home):
    why = tiers.misplaced(folder, markers)
    assert why is not None and f"move it to {home}" in why


@pytest.mark.parametrize("folder", ["integration", "fault"])
def test_an_unmarked_test_under_a_slow_folder_is_named_as_fast_tier(folder):
    why = tiers.misplaced(folder, {"parametrize", "timeout"})
    assert why is not None and "tests/unit" in why


@pytest.mark.parametrize(
    "folder, markers",
    [
        ("unit", set()),
        ("unit", {"parametrize"}),
        ("integration", {"cluster"}),
        ("integration", {"parity"}),
        ("fault", {"fault"}),
        ("fault", {"cluster"}),
    ],
)
def test_a_test_in_its_tiers_folder_passes(folder, markers):
    assert tiers.misplaced(folder, markers) is None
