"""`HashEmbedding`: an embedding module whose rows live on the PS (`HashEmbeddingBag`,
nn/hash_embedding_bag.py, pools bags of them).

Rows are keyed by any int64 id (no vocabulary size) and created on first touch. A forward
pulls only the batch's distinct ids; the backward leaves one gradient row per distinct id,
which the PS-backed optimizer pushes at `step()`. Each module holds a zero-size placeholder
parameter so that `paramserver.optim.X(model.parameters())` finds its table; the optimizer
then creates the table with the row-wise counterpart of its own algorithm (SGD, Adagrad,
Adam as torch.optim.SparseAdam), or with the module's `optimizer` spec (e.g. FTRL).

Not thread-safe: use from the training thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch
from torch import nn

from paramserver.base import names
from paramserver.base.errors import InvalidArgumentError, NotInitializedError
from paramserver.base.hashing import distinct
from paramserver.nn.distinct_ids import SpreadRows, sum_rows
from paramserver.nn.served_rows import ServedRows
from paramserver.nn.wire_dtype import WIRE_OF, wire_array

_INT64_MAX = np.iinfo(np.int64).max


class RowSource(Protocol):
    """Where a HashEmbedding's rows come from: the PS's tables (client.table_client.TableClient), or a
    checkpoint's saved rows (worker.checkpoint_model.SavedRows)."""

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows (len(ids) x dim) of distinct int64 `ids`, in their order."""
        ...

    def lookup_many(self, lookups: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """`lookup` of several (table, ids) at once (the PS's: one request per shard for all of them)."""
        ...


def as_ids(ids) -> torch.Tensor:
    """Ids as a CPU int64 tensor; anything that is not an integer id is an InvalidArgumentError."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidArgumentError(f"embedding ids must be integers, got a {ids.dtype} tensor")
        return ids.detach().to("cpu", torch.int64)
    try:
        array = np.asarray(ids)
    except OverflowError:
        raise InvalidArgumentError("embedding ids overflow int64") from None
    if array.dtype == object and all(isinstance(v, int) for v in array.flat):
        raise InvalidArgumentError("embedding ids overflow int64")  # Python ints too large for int64
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"embedding ids must be integers, got {array.dtype}")
    if array.dtype == np.uint64 and array.size and array.max() > _INT64_MAX:
        raise InvalidArgumentError("embedding ids overflow int64")
    return torch.from_numpy(array.astype(np.int64))


class HashEmbedding(nn.Module):
    """`ids` of any shape -> `ids.shape + (dim,)` embeddings, from a PS table.

    init: "normal" (std), "uniform" (scale, values in [-scale, scale]) or "zeros".
    name: the table's name on the PS (default: given by the optimizer, from the parameter name); a
    name as docs/protocol.md "Names" says (1-256 characters, no control characters, no '/').
    optimizer: a row-wise optimizer spec for this table, e.g. {"name": "ftrl", "hyper": {"lr": 0.05}};
    by default the counterpart of the PS optimizer that owns the module's parameters.
    policy: admission and eviction, e.g. {"admit_after": 3, "ttl_steps": 100000, "evict_every": 1000}
    (see paramserver.tables.embedding_table.RowPolicy).
    capacity: rows the table is expected to hold (all shards together), reserved up front so the
    table does not re-grow (copying its arrays) while training; it grows past it if needed.
    Reserved rows cost memory only once used, except the id index (32 bytes per reserved row).
    dtype: the embeddings' dtype, torch.float32, bfloat16 or float16 (`model.to(dtype)` before the
    optimizer is created sets it too): rows and their gradients travel in it (half the bytes for the
    half dtypes); the PS keeps float32 rows and optimizer state.
    """

    def __init__(
        self,
        dim: int,
        *,
        init: str = "normal",
        std: float = 0.01,
        scale: float = 0.05,
        optimizer: dict | None = None,
        name: str | None = None,
        policy: dict | None = None,
        capacity: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if dtype not in WIRE_OF:
            raise InvalidArgumentError(f"embedding dtype must be torch.float32, bfloat16 or float16, got {dtype}")
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"embedding dim must be a positive integer, got {dim!r}")
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"embedding capacity must be a non-negative integer, got {capacity!r}")
        self.dim, self.capacity = dim, capacity
        self.init: dict[str, str | float] = {"kind": init}
        if init == "normal":
            self.init["std"] = std
        elif init == "uniform":
            self.init["scale"] = scale
        self.optimizer_spec = optimizer
        self.policy = policy or {}
        self.table_name = name if name is None else names.check_name(name, "embedding name")
        self.placeholder = nn.Parameter(torch.empty(0, dtype=dtype))  # its dtype is the module's
        self._wire = dtype  # the dtype the table was registered to travel in (set by `attach`)
        # how the PS optimizer recognizes this table (tensors take attributes; torch's stubs declare none)
        self.placeholder._ps_embedding = self  # type: ignore[attr-defined]
        self._tables: RowSource | None = None
        # rows held in the module itself, with no PS (nn/served_rows.py; `paramserver.serving.load`)
        self.served: ServedRows | None = None
        # the module whose input the pipeline prefetches for this table (a collection's), if not this one
        self.prefetch_unit: Callable[[], nn.Module | None] | None = None
        # (distinct ids, their rows) of each training forward since the last step; the ids array is the one
        # the lookup was placed with, so the push reuses its placement (client/table_client.py)
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []
        self._prefetches: list[PlannedRows] = []  # oldest first: rows delivered or in flight, then waiting

    @property
    def dtype(self) -> torch.dtype:
        return self.placeholder.dtype

    def attach(self, tables: RowSource, table_name: str) -> None:
        """Called by the optimizer once the table exists on the PS (registered in this module's dtype)."""
        self._tables, self.table_name, self._wire = tables, table_name, self.dtype

    def prefetch(self, ids, values=None) -> None:
        """Have the rows of `ids` come back with the optimizer's next `step()` (one request per
        shard carries the gradients and the lookup); the forward given that same ids object uses
        them, with no request of its own. `values`: the ids themselves, when `ids` is only the
        object a forward will be given (a KeyedJaggedTensor, a collection's input).

        The shard reads the rows after that step's update. A step's reply is read by the step
        itself, so call this with the next batch's ids; with an optimizer created with
        `overlap=True` it is read at the following step, so pass the ids of the batch after next
        (the rows miss one update, the one of the step in between). A forward whose rows have not
        come back yet looks them up at once.
        """
        self._check_attached()
        shape, unique, inverse = self._distinct(self._values_of(ids) if values is None else values)
        # at most one earlier prefetch can still be used: the one riding the step in flight; one
        # still waiting for a step is replaced (asked twice before a step: the later ids win)
        riding = [p for p in self._prefetches if p.sent][-1:]
        self._prefetches = riding + [PlannedRows(ids, shape, unique, inverse)]

    def ride_lookup(self) -> PlannedRows | None:
        """The prefetch waiting to ride along a step, marked as sent; None if there is none.
        Called by the optimizer, which hands it its rows (`deliver`) when it reads the step's reply."""
        waiting = self._prefetches[-1] if self._prefetches else None
        if waiting is None or waiting.sent:
            return None
        waiting.sent = True
        return waiting

    def lookup(self, ids) -> torch.Tensor:
        """`ids` of any shape -> `ids.shape + (dim,)`: each id's row."""
        if self.served is not None:
            return self.served(as_ids(ids))
        plan = self.plan_lookup(ids)
        rows = self.rows_of(plan)
        return SpreadRows.apply(rows, plan.inverse).view(*plan.shape, self.dim)

    def plan_lookup(self, ids, values=None) -> PlannedRows:
        """What a forward given `ids` needs: its distinct ids, where each id is among them, and their
        rows if a prefetch brought them (`values`: the ids, when `ids` is only the prefetch's key)."""
        self._check_attached()
        prefetched = next((p for p in self._prefetches if p.ids is ids), None)
        # rows that came back for other ids are dropped; those still on their way are kept
        self._prefetches = [p for p in self._prefetches if p is not prefetched and p.rows is None]
        if prefetched is not None:
            return prefetched
        return PlannedRows(ids, *self._distinct(self._values_of(ids) if values is None else values))

    def rows_of(self, plan: PlannedRows, rows: np.ndarray | None = None) -> torch.Tensor:
        """The rows of a plan's distinct ids as a tensor, whose gradient the next step pushes: `rows`
        as given (a collection's lookup of all its tables), the prefetched ones, or looked up now."""
        if rows is None:
            rows = plan.rows
        if rows is None:  # not prefetched, or its step's reply not read yet
            rows = self._check_attached().lookup(cast(str, self.table_name), plan.unique)
        tensor = self._tensor(rows)
        if torch.is_grad_enabled() and self.training:
            tensor.requires_grad_(True)
            self._pending.append((plan.unique, tensor))
        return tensor

    def _values_of(self, ids):
        """The ids of what a forward is given (a HashEmbeddingBag takes jagged inputs too)."""
        return ids

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        """Rows as they came (the table's wire dtype; float32 from a checkpoint) as a tensor of this dtype."""
        if rows.dtype == np.uint16:  # bfloat16 bits
            return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).to(self.dtype)
        return torch.from_numpy(rows).to(self.dtype)

    def _check_attached(self) -> RowSource:
        """The tables `attach` gave; NotInitializedError before it."""
        if self._tables is None:
            raise NotInitializedError(
                "create the paramserver optimizer over this module's parameters before its first forward"
            )
        return self._tables

    @staticmethod
    def _distinct(ids) -> tuple[torch.Size, np.ndarray, torch.Tensor]:
        """(shape of ids, their distinct values, where each id is among them)."""
        ids = as_ids(ids)
        unique, inverse = distinct(ids.numpy().reshape(-1))
        unique = unique if unique.base is None else unique.copy()  # owns its ids: nothing else can change them
        unique.flags.writeable = False  # placed on the shards once, at the lookup; the push reuses it
        return ids.shape, unique, torch.from_numpy(inverse)

    def forward(self, ids) -> torch.Tensor:
        return self.lookup(ids)

    def take_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct ids touched since the last step and their summed gradient rows; clears them."""
        pending, self._pending = self._pending, []
        used = [(ids, rows.grad) for ids, rows in pending if rows.grad is not None]
        if not used:
            return None
        if len(used) == 1:  # one lookup this step: its ids are distinct already
            return used[0][0], wire_array(used[0][1].to(self._wire))
        unique, inverse = distinct(np.concatenate([i for i, _ in used]))  # several lookups: placed anew
        summed = sum_rows(torch.cat([g for _, g in used]), torch.from_numpy(inverse), unique.shape[0])
        return unique, wire_array(summed.to(self._wire))


@dataclass
class PlannedRows:
    """A forward's lookup, planned: its distinct ids, where each id of the input is among them, and
    their rows once known. A prefetch is one that rides along a step: its rows arrive when the
    optimizer reads that step's reply."""

    ids: object  # the ids object as given: only a forward given this same object uses prefetched rows
    shape: torch.Size
    unique: np.ndarray
    inverse: torch.Tensor
    sent: bool = False  # riding along a step
    rows: np.ndarray | None = None  # set by deliver(), once that step's reply is read

    def deliver(self, rows: np.ndarray) -> None:
        self.rows = rows


# Options of a dense optimizer that its row-wise counterpart cannot apply, with torch's reason.
_NOT_ROW_WISE = {
    "sgd": {
        "momentum": "momentum on a sparse gradient moves every row of the table at every step",
        "weight_decay": "weight decay on a sparse gradient decays every row of the table at every step",
    },
    "adagrad": {"weight_decay": "weight_decay option is not compatible with sparse gradients (as torch.optim.Adagrad)"},
    "adam": {
        "weight_decay": "torch.optim.SparseAdam, the row-wise Adam, has no weight decay",
        "amsgrad": "torch.optim.SparseAdam, the row-wise Adam, has no amsgrad",
    },
}
_NOT_ROW_WISE["adamw"] = _NOT_ROW_WISE["adam"]
_ROW_WISE_HYPER = {
    "sgd": ("lr",),
    "adagrad": ("lr", "lr_decay", "initial_accumulator_value", "eps"),
    "adam": ("lr", "betas", "eps"),
    "adamw": ("lr", "betas", "eps"),
}


def sparse_counterpart(kind: str, hyper: dict, table: str = "table") -> dict:
    """The row-wise optimizer a table gets from a dense optimizer's kind and (plain) hyper-parameters:
    SGD, Adagrad, or Adam as torch.optim.SparseAdam. Options torch refuses for sparse gradients
    (or that would move every row) raise InvalidArgumentError naming the option."""
    for option, why in _NOT_ROW_WISE[kind].items():
        if hyper.get(option):
            raise InvalidArgumentError(
                f"embedding table {table!r}: {kind} with {option}={hyper[option]!r} cannot update a table row by "
                f"row: {why}. Put the embedding modules in a param group with {option}=0 (or False), or give the "
                f"HashEmbedding its own optimizer spec"
            )
    name = "adam" if kind == "adamw" else kind
    spec_hyper = {k: list(hyper[k]) if k == "betas" else hyper[k] for k in _ROW_WISE_HYPER[kind]}
    if hyper.get("maximize"):  # only when set: a spec equal to older ones restores their checkpoints
        spec_hyper["maximize"] = True
    return {"name": name, "hyper": spec_hyper}
