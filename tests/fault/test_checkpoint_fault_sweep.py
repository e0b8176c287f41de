"""The whole seeded sweep of checkpoint faults (tests/unit/test_checkpoint_fault_injection.py, whose fast
tier test runs only its first FAST_CASES cases): CASES cases, every reader, the same assertions."""

import pytest
from tests.unit import test_checkpoint_fault_injection as faults


@pytest.mark.fault
def test_every_case_of_the_seeded_checkpoint_fault_sweep_is_refused_or_restored_exactly(tmp_path):
    template = tmp_path / "template" / "ckpt"
    faults.build(str(template))
    faults.sweep(str(template), tmp_path, faults.CASES)
