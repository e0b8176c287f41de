"""wire/half.py against torch: float32 -> bfloat16 / float16 bit for bit, and back exactly (with the
C kernels and on numpy)."""

import numpy as np
import pytest
import torch

from paramserver.wire.half import BF16_NAN, bf16_bits_to_float32, float32_to_bf16_bits, from_wire, to_wire

pytestmark = pytest.mark.usefixtures("both_kernel_paths")


def torch_bf16_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def edge_values() -> np.ndarray:
    """Zeros, infinities, the extremes, subnormals, exact ties (odd and even), values that round up
    into the next binade or into infinity."""
    bits = [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x00000001,
        0x807FFFFF,
        0x00008000,
        0x00018000,
        0x3F808000,
        0x3F818000,
        0x3F7FFFFF,
        0x3F7F8000,
        0x7F7F8000,
        0x7F7F7FFF,
        0x3F807FFF,
        0x3F808001,
        0xBF808000,
        0xBF818000,
        0x00800000,
        0x007FFFFF,
    ]
    return np.array(bits, np.uint32).view(np.float32)


def random_values(count: int = 200_000) -> np.ndarray:
    """Every kind of float32: random bit patterns (NaNs left out), and ordinary normal values."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([bits[~np.isnan(bits)], rng.standard_normal(count).astype(np.float32), edge_values()])


def test_float32_to_bfloat16_equals_torch_bit_for_bit():
    values = random_values()
    np.testing.assert_array_equal(float32_to_bf16_bits(values), torch_bf16_bits(values))


def test_every_bfloat16_comes_back_exactly_as_torch_widens_it():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = bf16_bits_to_float32(bits)
    theirs = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])
    assert np.isnan(ours[nan]).all() and nan.sum() == 2 * 127  # both signs' NaN payloads stay NaN
    finite = np.isfinite(ours)  # and a finite bfloat16 goes round the trip unchanged
    np.testing.assert_array_equal(float32_to_bf16_bits(ours[finite]), bits[finite])


def test_nan_stays_nan_whatever_its_payload_and_sign():
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0x7F80FFFF], np.uint32)
    values = nans.view(np.float32)
    ours = float32_to_bf16_bits(values)
    assert (ours == BF16_NAN).all()  # a payload in the low bits alone must not round into an infinity
    assert np.isnan(bf16_bits_to_float32(ours)).all()
    # torch writes 0x7FC0 (scalar) or 0xFFFF (vectorized): NaN too, not bit-equal either way
    assert np.isnan(torch.from_numpy(values).to(torch.bfloat16).float().numpy()).all()


def test_float16_wire_equals_torch_including_overflow_to_infinity():
    values = np.concatenate([random_values(), np.array([65504, 65519.99, 65520, -1e6, 1e-8], np.float32)])
    ours = to_wire(values, "float16")
    theirs = torch.from_numpy(values).half().numpy()
    np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(np.uint16))
    assert np.isinf(ours[-3:-1]).all()
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # and every float16 back
    widened = torch.from_numpy(halves.copy()).float().numpy()
    nan = np.isnan(widened)
    np.testing.assert_array_equal(from_wire(halves, "float16")[~nan], widened[~nan])
    assert np.isnan(from_wire(halves, "float16")[nan]).all()


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
def test_wire_round_trip_of_values_the_dtype_holds_is_exact(wire):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    held = values.to({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[wire])
    master = held.float().numpy()
    sent = to_wire(master, wire)
    np.testing.assert_array_equal(from_wire(sent, wire), master)
    assert from_wire(sent, wire).dtype == np.float32
    assert sent.nbytes == master.nbytes // (1 if wire == "float32" else 2)


def test_conversions_write_into_a_given_buffer():
    values = random_values(1000)
    out = np.empty(values.shape, np.uint16)
    assert float32_to_bf16_bits(values, out) is out
    back = np.empty(values.shape, np.float32)
    assert bf16_bits_to_float32(out, back) is back
    np.testing.assert_array_equal(out, torch_bf16_bits(values))


def test_all_finite_finds_one_nan_or_infinity_anywhere():
    from paramserver.base.kernels import all_finite

    values = np.linspace(-3e38, 3e38, 10_001, dtype=np.float32)
    assert all_finite(values) and all_finite(values[::2]) and all_finite(np.zeros(0, np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 5_000, 10_000):
            broken = values.copy()
            broken[where] = bad
            assert not all_finite(broken), (bad, where)
    assert not all_finite(np.float16([1, np.inf]))  # other dtypes: the numpy path


def test_the_fp16_codec_casts_gradient_sized_values_as_numpy_does_bit_for_bit():
    """Gradients of 1e-5 and less become float16 subnormals, which numpy's cast handles in software
    (14x slower); the codec's cast (the C kernel) must give the same bits, and the same float32 back."""
    from paramserver.base.codecs.fp16 import Float16

    rng = np.random.default_rng(7)
    grad = np.concatenate([rng.standard_normal(50_000) * scale for scale in (1.0, 1e-4, 1e-6, 1e-8)]).astype(np.float32)
    grad[:6] = [np.inf, -np.inf, 70_000.0, 65_519.0, -65_520.0, -1e-30]
    with np.errstate(over="ignore"):
        expected = grad.astype(np.float16)
    payload = Float16().encode(grad).payload
    assert payload.dtype == np.float16 and np.array_equal(payload.view(np.uint16), expected.view(np.uint16))
    back = Float16.decode("g", {"codec": "fp16"}, payload, {})
    assert back.dtype == np.float32 and np.array_equal(back, expected.astype(np.float32))
