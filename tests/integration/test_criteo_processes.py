"""The Criteo reader's errors across a loader process, and the synthetic generator's script: the tests that
start a process (the reader itself: tests/unit/test_criteo.py)."""

import pickle
import subprocess
import sys

import numpy as np
import pytest
from tests.conftest import ROOT
from tests.criteo_lines import bad_file, line

from paramserver.data import criteo


@pytest.mark.cluster
def test_the_error_keeps_its_file_and_line_across_a_loader_process(tmp_path):
    error = criteo.CriteoFormatError("f: line 3: field 1 (label): ...", "f", 3, "label")
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.path, again.line, again.field) == (str(error), "f", 3, "label")
    path = bad_file(tmp_path, line(label="2"))
    with pytest.raises(criteo.CriteoFormatError) as caught:
        list(criteo.batches(path, 2, prefetch=2))
    assert (caught.value.path, caught.value.line, caught.value.field) == (str(path), 5, "label")


@pytest.mark.cluster
def test_generator_writes_the_exact_format_with_learnable_labels(tmp_path):
    path = tmp_path / "train.tsv"
    subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", "2000", "--out", str(path)],
                   check=True, timeout=120)
    labels = np.concatenate([b[2].numpy() for b in criteo.batches(str(path), 512)])
    assert labels.shape == (2000,) and 0.05 < labels.mean() < 0.95
