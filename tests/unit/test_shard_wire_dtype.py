"""A shard's bfloat16 / float16 variables: float32 masters, gradients and values in the wire dtype."""

import threading

import numpy as np
import pytest
import torch
from tests.wait import finished

from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.server.shard import Push, Shard, Step
from paramserver.tables.table_store import TableStore
from paramserver.wire.half import bf16_bits_to_float32, float32_to_bf16_bits

ADAM = {"name": "adam", "hyper": {"lr": 0.1}}
MASTER = np.linspace(-2, 2, 6, dtype=np.float32).reshape(3, 2)  # not all bfloat16 values: pulls round


@pytest.fixture
def shard():
    shard = Shard(0)
    shard.register("g", ADAM, {"w": MASTER.copy(), "h": np.ones(4, np.float32), "f": np.zeros(2, np.float32)},
                   wire={"w": "bfloat16", "h": "float16"})
    return shard


def pulled(shard, names=("w", "h", "f")):
    return shard.pull(list(names), lambda version, views: (version, {n: v.copy() for n, v in views}))


def masters(shard):
    return shard.snapshot(lambda groups, version, _: {n: groups["g"].view(n).copy() for n in groups["g"].slots})


def state(shard):
    return shard.snapshot(lambda groups, *_: ({k: v.copy() for k, v in groups["g"].state.items()},
                                              dict(groups["g"].steps)))


def test_pulls_travel_in_the_wire_dtype_rounded_from_the_float32_master(shard):
    version, values = pulled(shard)
    assert version == 0 and (values["w"].dtype, values["h"].dtype, values["f"].dtype) == (
        np.uint16, np.float16, np.float32)
    expected = torch.from_numpy(MASTER).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(values["w"], expected)
    np.testing.assert_array_equal(masters(shard)["w"], MASTER)  # the master keeps every float32 bit


def test_half_gradients_are_upcast_and_applied_to_the_float32_master(shard):
    grad_w = np.full((3, 2), 0.5, np.float32)
    shard.push(Push({"w": float32_to_bf16_bits(grad_w), "h": np.ones(4, np.float16), "f": np.ones(2, np.float32)}))
    master = torch.tensor(MASTER, requires_grad=True)
    torch_adam = torch.optim.Adam([master], lr=0.1)
    master.grad = torch.from_numpy(grad_w)
    torch_adam.step()
    np.testing.assert_allclose(masters(shard)["w"], master.detach().numpy(), rtol=1e-6)
    _, values = pulled(shard)
    np.testing.assert_array_equal(values["w"], float32_to_bf16_bits(masters(shard)["w"]))
    np.testing.assert_array_equal(values["h"], masters(shard)["h"].astype(np.float16))


@pytest.mark.parametrize("grads, fragment", [
    ({"w": np.ones((3, 2), np.float32)}, r"dtype float32, but .* travel as bfloat16 \(as uint16 bits\)"),
    ({"w": np.ones((3, 2), np.float16)}, "dtype float16, but .* bfloat16"),
    ({"h": float32_to_bf16_bits(np.ones(4, np.float32))}, "dtype uint16, but .* float16"),
    ({"f": np.ones(2, np.float16)}, "dtype float16, but .* float32"),
    ({"h": np.array([1, np.inf, 1, 1], np.float16)}, "infinite"),  # a float16 gradient that overflowed
    ({"w": np.full((3, 2), 0x7FC0, np.uint16)}, "NaN"),
    ({"w": np.ones((2, 3), np.uint16)}, "shape"),
])
def test_a_gradient_of_the_wrong_dtype_or_not_finite_is_refused_and_nothing_changes(shard, grads, fragment):
    before, before_masters, before_state = pulled(shard), masters(shard), state(shard)
    with pytest.raises(InvalidArgumentError, match=fragment):  # the good gradient in it is not applied either
        shard.push(Push({"f": np.ones(2, np.float32), **grads}))
    after, after_state = pulled(shard), state(shard)
    assert after[0] == before[0] == 0 and after_state[1] == before_state[1]
    for name in before[1]:
        np.testing.assert_array_equal(after[1][name], before[1][name])
        np.testing.assert_array_equal(masters(shard)[name], before_masters[name])
    for key, array in before_state[0].items():
        np.testing.assert_array_equal(after_state[0][key], array)


def test_registration_checks_the_wire_dtypes_and_a_second_one_must_agree(shard):
    same = {"w": MASTER.copy(), "h": np.ones(4, np.float32), "f": np.zeros(2, np.float32)}
    shard.register("g", ADAM, same, wire={"w": "bfloat16", "h": "float16"})  # agrees: adopts
    with pytest.raises(FailedPreconditionError, match="'w' was registered to travel as bfloat16, not float32"):
        shard.register("g", ADAM, same, wire={"h": "float16"})
    with pytest.raises(InvalidArgumentError, match="wire dtype 'int8'"):
        shard.register("k", ADAM, {"x": np.ones(2, np.float32)}, wire={"x": "int8"})
    with pytest.raises(InvalidArgumentError, match="'y', which it does not register"):
        shard.register("k", ADAM, {"x": np.ones(2, np.float32)}, wire={"y": "bfloat16"})
    with pytest.raises(InvalidArgumentError, match="float32 only"):
        shard.register("k", ADAM, {"x": np.ones(2, np.float16)}, wire={"x": "float16"})
    assert pulled(shard)[0] == 0
    with pytest.raises(Exception, match="no variable 'x'"):
        shard.step(Step({}, ["x"]), lambda *reply: reply)


def test_a_sync_step_averages_the_upcast_half_gradients_in_float32():
    shard = Shard(0)
    spec = ConsistencySpec("sync", workers=2)
    sgd = {"name": "sgd", "hyper": {"lr": 1.0}}
    shard.register("g", sgd, {"w": np.zeros(3, np.float32)}, spec, 0, wire={"w": "bfloat16"})
    shard.register("g", sgd, {"w": np.zeros(3, np.float32)}, spec, 1, wire={"w": "bfloat16"})
    first = float32_to_bf16_bits(np.array([1, 2, 3], np.float32))
    second = float32_to_bf16_bits(np.array([2, 2, 2 ** -10], np.float32))
    waiter = threading.Thread(target=shard.push, args=(Push({"w": first}, worker=0, step=0),))
    waiter.start()
    shard.push(Push({"w": second}, worker=1, step=0))
    finished(waiter, "worker 0's push to return once worker 1's completes the step")
    mean = (bf16_bits_to_float32(first) + bf16_bits_to_float32(second)) / np.float32(2)
    np.testing.assert_array_equal(masters(shard)["w"], -mean)  # 1.5 + 2**-11: no bfloat16 holds it
    assert shard.sync_step == 1


def test_a_half_table_serves_rows_in_its_wire_dtype_and_refuses_row_gradients_in_another():
    tables = TableStore(0)
    tables.register("t", 2, {"name": "sgd", "hyper": {"lr": 1.0}}, {"kind": "normal", "std": 0.5}, wire="bfloat16")
    ids = np.array([3, 8], np.int64)
    float_rows = tables.table("t").read(ids)
    rows = tables.lookup("t", ids)
    assert rows.dtype == np.uint16
    np.testing.assert_array_equal(rows, float32_to_bf16_bits(float_rows))
    for bad, fragment in [(np.ones((2, 2), np.float32), "dtype float32 does not match 2 ids x dim 2 bfloat16"),
                          (np.full((2, 2), 0x7F80, np.uint16), "NaN or infinite")]:
        with pytest.raises(InvalidArgumentError, match=fragment):
            tables.apply_rows([[tables.check_push("t", ids, bad)]])
        np.testing.assert_array_equal(tables.lookup("t", ids), rows)
    tables.apply_rows([[tables.check_push("t", ids, float32_to_bf16_bits(np.full((2, 2), 0.5, np.float32)))]])
    np.testing.assert_array_equal(tables.table("t").read(ids), float_rows - 0.5)
    with pytest.raises(FailedPreconditionError, match="'t' was registered to travel as bfloat16, not float16"):
        tables.register("t", 2, {"name": "sgd", "hyper": {"lr": 1.0}}, {"kind": "normal", "std": 0.5},
                        wire="float16")
