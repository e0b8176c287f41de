"""A parameter's gradients and values as they travel (nn/wire_dtype.py), and the dtypes an optimizer takes."""

import numpy as np
import pytest
import torch

import paramserver as ps
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.nn.wire_dtype import wire_array, write_wire
from paramserver.wire.half import float32_to_bf16_bits


def test_a_bfloat16_gradient_travels_as_a_view_of_its_bits():
    grad = torch.randn(3, 4).to(torch.bfloat16)
    array = wire_array(grad)
    assert array.dtype == np.uint16 and array.shape == (3, 4)
    np.testing.assert_array_equal(array, float32_to_bf16_bits(grad.float().numpy()))
    grad[0, 0] = 7  # a view: no copy was made
    assert array[0, 0] == float32_to_bf16_bits(np.float32([7]))[0]
    assert wire_array(torch.ones(2, dtype=torch.float16)).dtype == np.float16


def test_pulled_values_are_written_into_a_row_range_of_a_half_parameter():
    param = torch.zeros(4, 2, dtype=torch.bfloat16)
    values = np.array([[1.5, -2], [3, 0.25]], np.float32)
    write_wire("w.1", param[1:3], float32_to_bf16_bits(values))
    assert param.float()[1:3].tolist() == values.tolist() and param[0].abs().sum() == param[3].abs().sum() == 0
    half = torch.zeros(2, dtype=torch.float16)
    write_wire("b", half, np.array([0.5, 4], np.float16))
    assert half.tolist() == [0.5, 4]
    with pytest.raises(FailedPreconditionError, match="values of 'w' came back as float32, not as bfloat16"):
        write_wire("w", param, np.zeros((4, 2), np.float32))


def test_an_optimizer_takes_float32_bfloat16_and_float16_parameters_and_refuses_others(fresh_context):
    ps.init()
    mixed = [torch.nn.Parameter(torch.ones(2, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16,
                                                                          torch.float16)]
    opt = ps.optim.SGD(mixed, lr=0.5)
    for param in mixed:
        param.grad = torch.ones_like(param)
    opt.step()
    assert [p.tolist() for p in mixed] == [[0.5, 0.5]] * 3 and [p.dtype for p in mixed][1] == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match="float64; PS variables are float32, bfloat16 or float16"):
        ps.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))], lr=0.5)


def test_model_to_bfloat16_makes_its_embedding_tables_bfloat16_and_it_learns(fresh_context):
    ps.init(num_ps=2)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = ps.nn.HashEmbeddingBag(8, mode="mean"), torch.nn.Linear(8, 2)

        def forward(self, ids):
            return self.fc(self.emb(ids))

    model = Model().to(torch.bfloat16)
    opt = ps.optim.Adam(model.named_parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (64, 3), generator=torch.Generator().manual_seed(0))  # ids repeat within a batch
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids).float(), ids[:, 0] % 2)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert model.emb.dtype == model(ids).dtype == torch.bfloat16
    assert losses[-1] < 0.7 * losses[0]
    with pytest.raises(InvalidArgumentError, match="embedding dtype must be"):
        ps.nn.HashEmbedding(4, dtype=torch.float64)
