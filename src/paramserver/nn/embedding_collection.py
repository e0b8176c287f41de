"""`HashEmbeddingBagCollection`: many PS tables in one module, looked up together.

A CTR model has one table per categorical feature (26 in Criteo's data): the collection takes a
config per table and, in one call, every feature's ids (a torchrec KeyedJaggedTensor or a dict),
returning each feature's pooled embeddings. All its tables travel together: a forward whose rows
no prefetch brought looks every table up in one request per shard (TableClient.lookup_many), the
pipeline prefetches all of them with the step (worker/pipeline.py), and the step pushes all their
gradients in its one request per shard, as for any set of tables.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from paramserver.base.errors import InvalidArgumentError
from paramserver.nn.hash_embedding import PlannedRows, RowSource, as_ids
from paramserver.nn.hash_embedding_bag import HashEmbeddingBag, is_keyed_jagged


@dataclass
class TableConfig:
    """One table of a HashEmbeddingBagCollection (torchrec's EmbeddingBagConfig, with no vocabulary size).

    `features`: the input features looked up in this table (default: the table's own name); the
    other fields are HashEmbeddingBag's (`mode` "sum", "mean" or "max")."""

    name: str
    dim: int
    features: list[str] = field(default_factory=list)
    mode: str = "sum"
    init: str = "normal"
    std: float = 0.01
    scale: float = 0.05
    optimizer: dict | None = None
    policy: dict | None = None
    capacity: int = 0
    dtype: torch.dtype = torch.float32


@dataclass
class _Feature:
    """One feature's bags, checked: ids (1-D jagged, or 2-D fixed), offsets, weights, mask, include_last_offset."""

    ids: torch.Tensor
    offsets: torch.Tensor | None
    weights: torch.Tensor | None
    mask: torch.Tensor | None
    last: bool


class HashEmbeddingBagCollection(nn.Module):
    """Features -> {feature: (batch, dim) pooled embeddings}, one HashEmbeddingBag per table (`tables[name]`).

    Input: a KeyedJaggedTensor of the features (torchrec's, or any object with `keys()`, `values()`,
    `offsets()` and `weights_or_none()`), or a dict by feature of a (batch, bag) tensor, a 1-D
    tensor (one id per example), `(values, offsets)` or `(values, offsets, per_sample_weights)`.
    The output keeps the configs' feature order; `torch.cat(list(out.values()), dim=1)` gives
    torchrec's KeyedTensor values."""

    def __init__(self, tables: list[TableConfig]) -> None:
        super().__init__()
        if not tables:
            raise InvalidArgumentError("HashEmbeddingBagCollection needs at least one TableConfig")
        self.tables = nn.ModuleDict()
        self.feature_tables: dict[str, str] = {}  # feature -> table, in output order
        for config in tables:
            if config.name in self.tables or not config.name or "." in config.name:
                raise InvalidArgumentError(f"table names must be distinct, non-empty, without '.': {config.name!r}")
            bag = HashEmbeddingBag(
                config.dim,
                mode=config.mode,
                init=config.init,
                std=config.std,
                scale=config.scale,
                optimizer=config.optimizer,
                policy=config.policy,
                capacity=config.capacity,
                dtype=config.dtype,
            )
            bag.prefetch_unit = weakref.ref(self)  # the pipeline prefetches the collection's input, not a table's
            self.tables[config.name] = bag
            for feature in config.features or [config.name]:
                if feature in self.feature_tables:
                    raise InvalidArgumentError(f"feature {feature!r} is in two tables")
                self.feature_tables[feature] = config.name

    @property
    def table_name(self) -> str:
        """The PS names of its tables (what the pipeline's log calls the collection)."""
        return ", ".join(str(self._bag(name).table_name) for name in self.tables)

    def forward(self, features: Any) -> dict[str, torch.Tensor]:
        split = self._features(features)
        by_table = {table: [f for f, t in self.feature_tables.items() if t == table] for table in self.tables}
        out: dict[str, torch.Tensor] = {}
        remote = []
        for name in self.tables:
            bag = self._bag(name)
            if bag.served is None:
                remote.append(name)
                continue
            for f in by_table[name]:  # rows held in the module (serving): no lookup to batch
                got = split[f]
                index = bag.served.index(got.ids)
                out[f] = bag.pool(bag.served.weight, index, got.offsets, got.weights, got.mask, got.last)
        plans = {name: self._bag(name).plan_lookup(features, _values(split, by_table[name])) for name in remote}
        rows = self._rows(plans)
        for name in remote:
            bag, plan = self._bag(name), plans[name]
            weight, index, at = bag.rows_of(plan, rows.get(name)), plan.inverse, 0
            for f in by_table[name]:
                got = split[f]
                count = got.ids.numel()
                part = index[at : at + count].view(got.ids.shape)
                out[f] = bag.pool(weight, part, got.offsets, got.weights, got.mask, got.last)
                at += count
        return {f: out[f] for f in self.feature_tables}

    def prefetch(self, features: Any) -> None:
        """Have every table's rows of `features` ride along the next step (HashEmbedding.prefetch)."""
        split = self._features(features)
        for name in self.tables:
            bag = self._bag(name)
            bag.prefetch(features, _values(split, [f for f, t in self.feature_tables.items() if t == name]))

    def _bag(self, name: str) -> HashEmbeddingBag:
        return cast(HashEmbeddingBag, self.tables[name])

    def _rows(self, plans: dict[str, PlannedRows]) -> dict[str, np.ndarray]:
        """The rows of the plans no prefetch filled, every table in one lookup (one request per shard)."""
        missing = [name for name, plan in plans.items() if plan.rows is None]
        if not missing:
            return {}
        sources: dict[int, tuple[RowSource, list[str]]] = {}
        for name in missing:
            source = self._bag(name)._check_attached()
            sources.setdefault(id(source), (source, []))[1].append(name)
        rows: dict[str, np.ndarray] = {}
        for source, names in sources.values():
            got = source.lookup_many([(str(self._bag(n).table_name), plans[n].unique) for n in names])
            rows.update(zip(names, got))
        return rows

    def _features(self, features: Any) -> dict[str, _Feature]:
        """Each feature's bags, checked by its table (InvalidArgumentError before any lookup)."""
        given = _split_jagged(features) if is_keyed_jagged(features) else features
        if not isinstance(given, Mapping):
            raise InvalidArgumentError(
                f"HashEmbeddingBagCollection takes a KeyedJaggedTensor or a dict by feature, "
                f"got {type(features).__name__}"
            )
        unknown = sorted(set(given) - set(self.feature_tables))
        missing = [f for f in self.feature_tables if f not in given]
        if unknown or missing:
            raise InvalidArgumentError(
                f"features: missing {missing}, unknown {unknown} (expected {list(self.feature_tables)})"
            )
        return {f: self._feature(f, given[f]) for f in self.feature_tables}

    def _feature(self, name: str, value: Any) -> _Feature:
        last = False
        if isinstance(value, _Feature):
            value, last = (value.ids, value.offsets, value.weights), value.last
        if isinstance(value, (tuple, list)):
            if not 2 <= len(value) <= 3:
                raise InvalidArgumentError(f"feature {name!r}: give (values, offsets) or (values, offsets, weights)")
            ids, offsets, weights = as_ids(value[0]), value[1], value[2] if len(value) == 3 else None
        else:
            ids, weights = as_ids(value), None
            offsets = torch.arange(ids.shape[0]) if ids.dim() == 1 else None  # one id per example
        bag = self._bag(self.feature_tables[name])
        try:
            ids, offsets, weights, mask = bag._checked(ids, offsets, weights, None, last)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"feature {name!r}: {exc}") from None
        return _Feature(ids, offsets, weights, mask, last)


def _values(split: dict[str, _Feature], features: list[str]) -> torch.Tensor:
    """The ids of a table's features, one after the other (its one lookup)."""
    return torch.cat([split[f].ids.reshape(-1) for f in features])


def _split_jagged(kjt: Any) -> dict[str, _Feature]:
    """A KeyedJaggedTensor's features (key-major values; offsets: batch + 1 per key, shared ends)."""
    keys, values, offsets, weights = list(kjt.keys()), kjt.values(), as_ids(kjt.offsets()), kjt.weights_or_none()
    if not keys or (offsets.shape[0] - 1) % len(keys):
        raise InvalidArgumentError(f"a KeyedJaggedTensor of {len(keys)} keys with {offsets.shape[0]} offsets")
    batch = (offsets.shape[0] - 1) // len(keys)
    split = {}
    for k, key in enumerate(keys):
        own = offsets[k * batch : (k + 1) * batch + 1]
        start, end = int(own[0]), int(own[-1])
        part = None if weights is None else weights[start:end]
        split[key] = _Feature(values[start:end], own - start, part, None, True)
    return split
