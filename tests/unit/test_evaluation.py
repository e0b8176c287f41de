import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from paramserver.evaluation import roc_auc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_equals_scikit_learn_including_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 1000)
    scores = np.round(rng.random(1000) + 0.3 * labels, 1)  # many ties
    assert roc_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_auc_needs_both_classes():
    with pytest.raises(ValueError, match="both"):
        roc_auc(np.ones(3), np.arange(3))
