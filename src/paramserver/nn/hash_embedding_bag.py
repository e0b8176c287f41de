"""`HashEmbeddingBag`: bags of ids pooled into one embedding each, rows on the PS.

It takes what `torch.nn.EmbeddingBag` takes, and pools with `torch.nn.functional.embedding_bag`
over the bag's distinct rows, so that its results are torch's on the same rows, bit for bit:

- `bag(ids)`: a (batch, bag) tensor, each row one bag of fixed length;
- `bag(ids, mask=mask)`: the same with padding, `mask` (same shape) non-zero at real entries
  (`bag(ids, mask)` too: offsets must be None with 2-D ids, so a second 2-D tensor of the ids'
  shape is a mask);
- `bag(input, offsets)`: jagged ids, a 1-D `input` of every bag's ids one after the other and
  `offsets` where each bag starts (with `include_last_offset=True`, one more: where the last ends);
- `per_sample_weights` (sum mode, as torch) weighs each id of `input`;
- a torchrec `KeyedJaggedTensor` of one feature (any object with `keys()`, `values()`,
  `offsets()` and `weights_or_none()`; torchrec itself is not needed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paramserver.base.errors import InvalidArgumentError
from paramserver.nn.hash_embedding import HashEmbedding, as_ids

MODES = ("sum", "mean", "max")


def is_keyed_jagged(value: Any) -> bool:
    """Whether `value` reads as a torchrec KeyedJaggedTensor (by its methods: torchrec is optional)."""
    return all(callable(getattr(value, name, None)) for name in ("keys", "values", "offsets", "weights_or_none"))


def _check_offsets(offsets: torch.Tensor, count: int) -> None:
    if offsets.shape[0] and (offsets[0] != 0 or bool((offsets[1:] < offsets[:-1]).any())):
        raise InvalidArgumentError("offsets must start at 0 and never decrease")
    if offsets.shape[0] and offsets[-1] > count:
        raise InvalidArgumentError(f"offsets go to {int(offsets[-1])}, past the {count} ids")


class HashEmbeddingBag(HashEmbedding):
    """Bags of ids -> (batch, dim): the sum, mean or max of each bag's embeddings (an empty bag: zeros).

    `mode` and `include_last_offset` as `torch.nn.EmbeddingBag`'s; the other arguments as HashEmbedding's.
    """

    def __init__(self, dim: int, mode: str = "sum", *, include_last_offset: bool = False, **kwargs) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"HashEmbeddingBag mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(dim, **kwargs)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(
        self,
        input: Any,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        last = self.include_last_offset
        if is_keyed_jagged(input):
            if offsets is not None or per_sample_weights is not None or mask is not None:
                raise InvalidArgumentError("a KeyedJaggedTensor carries its own offsets and weights: pass it alone")
            keys = list(input.keys())
            if len(keys) != 1:
                raise InvalidArgumentError(
                    f"HashEmbeddingBag takes a KeyedJaggedTensor of one feature, got {keys}; "
                    f"a HashEmbeddingBagCollection takes several"
                )
            values, offsets, per_sample_weights, last = input.values(), input.offsets(), input.weights_or_none(), True
        else:
            values = input
        index, offsets, per_sample_weights, mask = self._checked(
            as_ids(values), offsets, per_sample_weights, mask, last
        )
        weight, index = self._weight_and_index(input, values, index)
        return self.pool(weight, index, offsets, per_sample_weights, mask, last)

    def _checked(self, ids, offsets, weights, mask, last: bool):
        """The inputs as `F.embedding_bag` takes them, each checked as torch checks it (InvalidArgumentError
        before any lookup: bad input changes nothing)."""
        if ids.dim() == 2:
            if offsets is not None and mask is None and tuple(offsets.shape) == tuple(ids.shape):
                offsets, mask = None, offsets  # bag(ids, mask): the older positional form
            if offsets is not None:
                raise InvalidArgumentError("offsets must be None when ids are 2-D (batch, bag), as in torch")
            if mask is not None and tuple(mask.shape) != tuple(ids.shape):
                raise InvalidArgumentError(f"mask has shape {tuple(mask.shape)}, the ids {tuple(ids.shape)}")
        elif ids.dim() == 1:
            if offsets is None:
                raise InvalidArgumentError("1-D ids need offsets (where each bag starts), as in torch")
            if mask is not None:
                raise InvalidArgumentError("mask goes with (batch, bag) ids; jagged ids need none")
            offsets = as_ids(offsets)
            if offsets.dim() != 1 or (last and offsets.shape[0] < 1):
                raise InvalidArgumentError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            if not torch.compiler.is_compiling():  # values unknown while torch.export traces
                _check_offsets(offsets, ids.shape[0])
        else:
            raise InvalidArgumentError(
                f"HashEmbeddingBag takes ids of shape (batch, bag) or (n,), got {tuple(ids.shape)}"
            )
        if weights is not None:
            if self.mode != "sum":
                raise InvalidArgumentError(
                    f"per_sample_weights need mode 'sum', as in torch (this bag's mode is {self.mode!r})"
                )
            if tuple(weights.shape) != tuple(ids.shape):
                raise InvalidArgumentError(
                    f"per_sample_weights has shape {tuple(weights.shape)}, the ids {tuple(ids.shape)}"
                )
        return ids, offsets, weights, mask

    def _weight_and_index(self, key: Any, values: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, where each id's row is among them): the distinct ids' rows from the PS (or a
        prefetch keyed by the object the forward was given), or the served table's rows."""
        if self.served is not None:
            return self.served.weight, self.served.index(ids)
        plan = self.plan_lookup(key, values)
        return self.rows_of(plan), plan.inverse.view(plan.shape)

    def pool(self, weight, index, offsets, weights, mask, last: bool) -> torch.Tensor:
        """Each bag of `index` (rows of `weight`) pooled by this bag's mode."""
        if mask is not None:  # padded (batch, bag): the real entries as jagged bags
            real = mask.to(torch.bool)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), real.sum(dim=1).cumsum(0)])[:-1]
            index, weights, last = index[real], None if weights is None else weights[real], False
        if weights is not None:
            weights = weights.to(weight.dtype)
        if offsets is not None:
            offsets = offsets.to(index.dtype)
        return F.embedding_bag(
            index, weight, offsets, mode=self.mode, per_sample_weights=weights, include_last_offset=last
        )

    def _values_of(self, ids):
        return ids.values() if is_keyed_jagged(ids) else ids
