"""Bad input at the shard: a clear error, and no variable changes."""

import numpy as np
import pytest

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from paramserver.server.shard import Push, Shard

ADAM = {"name": "adam", "hyper": {"lr": 0.1}}


@pytest.fixture
def shard():
    shard = Shard(0)
    shard.register("g", ADAM, {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)})
    return shard


def values(shard):
    return shard.pull(["w", "b"], lambda version, views: (version, [v.copy() for _, v in views]))


def group(shard, name):
    """The dense group `name` (with its optimizer state), as a checkpoint reads it."""
    return shard.snapshot(lambda groups, version, sync_step: groups[name])


@pytest.mark.parametrize("grads, error, fragment", [
    ({"w": np.ones((2, 3), np.float32)}, InvalidArgumentError, "shape"),
    ({"w": np.ones((3, 2), np.float64)}, InvalidArgumentError, "dtype"),
    ({"w": np.full((3, 2), np.nan, np.float32)}, InvalidArgumentError, "NaN"),
    ({"b": np.array([1.0, np.inf], np.float32)}, InvalidArgumentError, "infinite"),
    ({"nope": np.ones(2, np.float32)}, NotFoundError, "nope"),
])
def test_bad_gradients_are_refused_and_nothing_changes(shard, grads, error, fragment):
    before = values(shard)
    # a good gradient in the same push must not be applied either
    with pytest.raises(error, match=fragment):
        shard.push(Push({"b": np.ones(2, np.float32), **grads}))
    after = values(shard)
    assert after[0] == before[0] == 0
    for a, b in zip(after[1], before[1]):
        np.testing.assert_array_equal(a, b)


def test_a_bad_learning_rate_is_refused_and_nothing_changes(shard):
    with pytest.raises(InvalidArgumentError, match="lr"):
        shard.push(Push({"b": np.ones(2, np.float32)}, {"g": float("nan")}))
    assert shard.version == 0


def test_registering_another_shape_or_optimizer_is_refused(shard):
    with pytest.raises(FailedPreconditionError, match="shape"):
        shard.register("g", ADAM, {"w": np.ones((4, 2), np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(FailedPreconditionError, match="optimizer"):
        shard.register("g", {"name": "sgd", "hyper": {"lr": 0.1}},
                       {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(InvalidArgumentError, match="float32 only"):
        shard.register("h", ADAM, {"x": np.ones(2, np.float64)})


def test_a_good_push_bumps_the_version_and_changes_values(shard):
    outcome = shard.push(Push({"w": np.ones((3, 2), np.float32)}))
    assert outcome.applied and shard.version == 1
    assert not np.array_equal(values(shard)[1][0], np.ones((3, 2), np.float32))


@pytest.mark.parametrize("assigned, error, fragment", [
    ({"w": np.ones((2, 3), np.float32)}, InvalidArgumentError, "value of 'w' has shape"),
    ({"w": np.ones((3, 2), np.float64)}, InvalidArgumentError, "dtype"),
    ({"b": np.array([1.0, np.nan], np.float32)}, InvalidArgumentError, "NaN"),
    ({"nope": np.ones(2, np.float32)}, NotFoundError, "nope"),
])
def test_bad_assigned_values_are_refused_and_nothing_changes(shard, assigned, error, fragment):
    before = values(shard)
    with pytest.raises(error, match=fragment):
        shard.assign({"b": np.full(2, 7.0, np.float32), **assigned})  # the good part is not written either
    for a, b in zip(values(shard)[1], before[1]):
        np.testing.assert_array_equal(a, b)


def test_assign_writes_values_and_keeps_version_and_optimizer_state(shard):
    shard.push(Push({"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)}))
    state = {key: array.copy() for key, array in group(shard, "g").state.items()}
    assert shard.assign({"w": np.full((3, 2), 5.0, np.float32)}) == 1
    version, (w, b) = values(shard)
    assert version == 1
    np.testing.assert_array_equal(w, np.full((3, 2), 5.0, np.float32))
    np.testing.assert_allclose(b, np.full(2, -0.1, np.float32), rtol=1e-6)  # Adam: -lr * sign, untouched
    for key, array in group(shard, "g").state.items():
        np.testing.assert_array_equal(array, state[key])
