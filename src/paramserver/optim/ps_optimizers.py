"""PS-backed optimizers: drop-in replacements for torch.optim.SGD, Adagrad, Adam and AdamW.

Creating one registers the parameters on the PS (the first worker's initial values win and
every worker adopts them); `step()` pushes this worker's gradients and writes the PS's new
values into the parameters, in one round trip per shard. The math runs on the PS
(paramserver.server.optimizers) and matches torch.optim's; the arguments and their defaults are
those of base/optimizer_specs.py, checked here before anything is registered.

With `overlap=True`, `step()` returns as soon as the gradients are sent, and the PS's reply
is loaded at the start of the next `step()` (or by `pull()` / `synchronize()`): the next
forward and backward run while the PS applies the update, at the price of computing each
gradient on parameters one update older (staleness 1, like one more async worker).

Parameters may be float32, bfloat16 or float16: the PS keeps float32 master values and optimizer
state, and a half-precision parameter's gradients and values travel in its own dtype (half the
bytes); the PS's values are rounded to it as they are pulled (docs/performance.md, "Mixed precision").

With `dense_sync` "allreduce" (optim/dense_sync.py) the dense parameters are registered on the PS
as above but trained among the workers: `step()` all-reduces their gradients and applies a local
torch.optim optimizer of the same kind; only the embedding tables' rows ride the PushPull.

Not thread-safe: use an optimizer from one training thread, as with torch.optim.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from paramserver.base.compression_spec import NONE, Codec
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.optimizer_specs import DENSE, check_implementation
from paramserver.client.ps_client import PushPullHandle
from paramserver.nn.hash_embedding import sparse_counterpart
from paramserver.nn.wire_dtype import WIRE_OF, wire_array, write_wire
from paramserver.worker.context import Context
from paramserver.worker.current import current_context


def plain_hyper(key: str, value: Any) -> Any:
    """A hyper-parameter as the PS takes it: one-element tensors (`lr=torch.tensor(0.01)`, tensor
    betas, as torch accepts on CPU) become floats; a larger tensor is refused as torch refuses it."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidArgumentError(f"Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, (tuple, list)):
        return type(value)(plain_hyper(key, v) for v in value)
    return value


log = logging.getLogger(__name__)


class PSOptimizer(torch.optim.Optimizer):
    """Base of the PS-backed optimizers. Subclasses set `kind` (a server optimizer name)."""

    kind: ClassVar[str]

    # torch wraps these two in `torch._disable_dynamo`, whose first call imports torch._dynamo
    # (about 70 MB); nothing here is ever compiled, so the plain functions do. (torch's annotations
    # of the decorated methods do not show the `__wrapped__` that functools.wraps keeps.)
    add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__  # type: ignore[attr-defined]
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__  # type: ignore[attr-defined]

    def __init__(
        self, params: Iterable, defaults: dict[str, Any], overlap: bool = False, context: Context | None = None
    ) -> None:
        super().__init__(params, defaults)
        self.overlap = overlap
        self.steps = 0
        self.context = context or current_context()
        self._pending: tuple[PushPullHandle, Any, list, int] | None = None  # overlap: a step whose reply is unread
        # work done while a step waits for its reply (a pipeline reads the next batch); set by RowPipeline
        self.while_waiting: Callable[[], None] | None = None
        self._embeddings: list = []
        self._vars: list[tuple[str, torch.Tensor]] = []
        self._sent_lr: dict[str, float] = {}
        plans: list[tuple[dict, list, list]] = []  # every group is checked before anything is registered
        for group in self.param_groups:
            plans.append(self._plan_group(group, sum(len(plan[1]) for plan in plans)))
        self._codecs = self._plan_codecs(self.context.next_optimizer_name(), plans)
        self.name = self.context.add_optimizer(self)
        started = time.monotonic()
        for i, plan in enumerate(plans):  # one at a time: a reply may view the stream's buffer
            self._write(self._register_group(i, *plan).wait(self.context.options.rpc_timeout_s)[1])
        log.info(
            "%s: %d parameters registered on %d PS in %.2fs",
            self.name,
            len(self._vars),
            self.context.num_ps,
            time.monotonic() - started,
        )
        self._dense = None  # worker.dense_sync.DenseSync with dense_sync "allreduce"
        if self.context.options.dense_sync == "allreduce":
            from paramserver.optim.dense_sync import DenseSync

            self._dense = DenseSync(self, self._vars)
        self.steps = self.context.resume_step  # step counts (checkpoints, schedules) go on from a restore
        if self.steps:
            log.info("%s: resuming at step %d", self.name, self.steps)
        if self.context.rejoined and self.context.pauses_at(self.steps):
            self.context.pause(self.steps)  # the others may wait at the barrier this worker died at

    @property
    def variables(self) -> list[str]:
        """The PS variable of each dense parameter, in registration order (what the client's
        push_pull and the PS's replies name)."""
        return [var for var, _ in self._vars]

    def _group_name(self, index: int) -> str:
        return f"{self.name}.group{index}"

    def _plan_group(self, group: dict[str, Any], dense_before: int) -> tuple[dict, list, list]:
        """Check a param group without registering anything: (PS optimizer spec, [(name, dense
        parameter)], [(name, embedding module, its table's spec)]); raises InvalidArgumentError.
        Unnamed parameters are numbered after the `dense_before` of earlier groups."""
        check_implementation(self.kind, group)
        hyper = {k: plain_hyper(k, v) for k, v in group.items() if k in DENSE[self.kind].defaults}
        spec = {"name": self.kind, "hyper": hyper}
        DENSE[self.kind].arguments(hyper)  # refused here as the PS would refuse it
        names = group.get("param_names") or [f"param{dense_before + j}" for j in range(len(group["params"]))]
        dense, tables = [], []
        for name, param in zip(names, group["params"]):
            module = getattr(param, "_ps_embedding", None)
            if module is not None:
                tables.append((name, module, module.optimizer_spec or sparse_counterpart(self.kind, hyper, name)))
            elif param.dtype not in WIRE_OF:
                raise InvalidArgumentError(
                    f"parameter {name!r} is {param.dtype}; PS variables are float32, bfloat16 or float16"
                )
            else:
                dense.append((name, param))
        return spec, dense, tables

    def _plan_codecs(self, name: str, plans: list) -> dict[str, Codec]:
        """The compression codec of each dense parameter (by its name in the model) and table (by table
        name), from the `compression` option (a table skips topk rules: CompressionSpec.codec_for_table)."""
        spec = self.context.options.compression_spec
        codecs = {}
        for _, dense, tables in plans:
            # a bfloat16 / float16 parameter or table already travels at half width, in its own dtype
            for param_name, param in dense:
                codecs[param_name] = spec.codec_for(param_name) if param.dtype == torch.float32 else NONE
            for param_name, module, _ in tables:
                table = _table_name(name, param_name, module)
                codecs[table] = spec.codec_for_table(table) if module.dtype == torch.float32 else NONE
        return codecs

    def _register_group(self, index: int, spec: dict, dense: list, tables: list):
        for param_name, module, table_spec in tables:
            name = _table_name(self.name, param_name, module)
            self.context.tables.register(
                name,
                module.dim,
                table_spec,
                module.init,
                module.policy,
                module.capacity,
                WIRE_OF[module.dtype],
                self._codecs[name],
            )
            module.attach(self.context.tables, name)
            self._embeddings.append(module)
        values, wire, codecs = {}, {}, {}
        for name, param in dense:
            var = f"{self.name}.{name}"
            values[var] = param.detach().cpu().float().numpy()  # exact: the PS's float32 master
            wire[var] = WIRE_OF[param.dtype]
            codecs[var] = self._codecs[name]
            self._vars.append((var, param))
        self._sent_lr[self._group_name(index)] = spec["hyper"]["lr"]
        return self.context.client.register(self._group_name(index), spec, values, wire, codecs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Push the gradients of parameters that have one, then load the PS's current values."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._dense is None:
            grads, pull = self._dense_grads(), [var for var, _ in self._vars]
        else:  # trained among the workers; the shards still hear of every step (positions, sync steps)
            self._dense.step()
            grads, pull = {}, []
        riders, prefetches = self._embedding_riders()
        if riders is None and self._dense is not None:
            riders = self.context.tables.riders()
        bases = dict(self.context.client.record.base_versions)  # the values these gradients came from
        self.synchronize()
        # in overlap mode other calls (lookups, the next pushes) go out before this reply is read
        handle = self.context.client.push_pull(
            grads, pull, self._changed_lrs() if self._dense is None else {}, bases, owned=self.overlap, riders=riders
        )
        if self.overlap:
            handle.wait_sent(self.context.options.rpc_timeout_s)  # the gradients may now be freed
            self._pending = (handle, riders, prefetches, self.steps + 1)
        else:
            if self.while_waiting is not None:
                self.while_waiting()
            self._settle(handle, riders, prefetches, self.steps + 1)
        self.steps += 1
        if self.context.summaries is not None:
            self.context.summaries.on_step(self.steps, self._vars)
        if self.context.pauses_at(self.steps):
            self.synchronize()  # the workers are about to meet: nothing of this worker may be in flight
        self.context.on_step(self.steps)
        return loss

    def _dense_grads(self) -> dict:
        grads = {}
        for var, param in self._vars:
            if param.grad is not None:
                if param.grad.is_sparse:
                    raise InvalidArgumentError(f"{var}: sparse gradients are not supported for dense variables")
                grads[var] = wire_array(param.grad)
        return grads

    def _embedding_riders(self):
        """(the embedding tables' row gradients and prefetched lookups to send with this step,
        [(prefetch, lookup index)]); (None, []) without embedding tables."""
        if not self._embeddings:
            return None, []
        riders, prefetches = self.context.tables.riders(), []
        for module in self._embeddings:
            touched = module.take_gradients()
            if touched is not None:
                riders.push(module.table_name, *touched)
                if self.context.summaries is not None:
                    self.context.summaries.note_rows(module.table_name, len(touched[0]))
            waiting = module.ride_lookup()
            if waiting is not None:
                prefetches.append((waiting, riders.lookup(module.table_name, waiting.unique), module.table_name))
        return riders, prefetches

    @torch.no_grad()
    def synchronize(self) -> None:
        """Load the reply of a step still in flight (overlap mode); a no-op otherwise."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._settle(*pending)

    def _settle(self, handle: PushPullHandle, riders, prefetches: list, step: int) -> None:
        """Load a step's reply (`step`: its number): the PS's values, and the prefetched rows that rode
        along. A shard lost meanwhile (partial recovery) is waited for and its values loaded again; the
        rows it was to look up are looked up again."""
        self._write(handle.wait(self.context.options.rpc_timeout_s)[1])
        for shard, cause in sorted(handle.failed.items()):
            self.context.partial.recover(shard, step, cause)
        if handle.failed:
            for prefetch, _, table in prefetches:
                prefetch.deliver(self.context.tables.lookup(table, prefetch.unique))
        elif prefetches:
            rows = riders.rows(handle.riders)
            for prefetch, index, _ in prefetches:
                prefetch.deliver(rows[index])

    @torch.no_grad()
    def pull(self) -> None:
        """Load the PS's current values into the local parameters (before evaluating or saving).
        With dense_sync "allreduce" the workers hold the current dense values: nothing to load."""
        self.synchronize()
        if self._dense is not None:
            return
        handle = self.context.client.push_pull({}, [var for var, _ in self._vars])
        self._write(handle.wait(self.context.options.rpc_timeout_s)[1])
        for shard, cause in sorted(handle.failed.items()):
            self.context.partial.recover(shard, self.steps, cause)

    def _changed_lrs(self) -> dict[str, float]:
        """Learning rates changed locally (e.g. by an LR scheduler) since they were last sent."""
        changed = {}
        for index, group in enumerate(self.param_groups):
            name = self._group_name(index)
            lr = plain_hyper("lr", group["lr"])
            if lr != self._sent_lr[name]:
                changed[name] = self._sent_lr[name] = lr
        return changed

    def load_parts(self, values) -> None:
        """Write the values of this optimizer's parts among `values` ([(part, array)]) into its parameters."""
        params = dict(self._vars)
        self._write([(part, array) for part, array in values if part.var in params])

    def _write(self, values) -> None:
        params = dict(self._vars)
        for part, array in values:
            param = params[part.var]
            write_wire(part.name, param.data if part.whole else param.data[part.lo : part.hi], array)


# each optimizer's defaults, as the PS applies them (one source: base/optimizer_specs.py)
_SGD, _ADAGRAD, _ADAM, _ADAMW = (DENSE[kind].defaults for kind in ("sgd", "adagrad", "adam", "adamw"))


def _table_name(optimizer: str, param_name: str, module) -> str:
    """An embedding module's table: its own name, or one made of the optimizer's and the parameter's."""
    return module.table_name or f"{optimizer}.{param_name.removesuffix('.placeholder')}"


def _implementation(foreach, fused, capturable=False, differentiable=False) -> dict[str, Any]:
    """torch's implementation switches, kept in each param group as torch keeps them (checked at
    registration: see base.optimizer_specs.check_implementation)."""
    return dict(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable)


class SGD(PSOptimizer):
    """torch.optim.SGD's arguments and math, applied on the PS."""

    kind = "sgd"

    def __init__(
        self,
        params,
        lr: float = _SGD["lr"],
        momentum: float = _SGD["momentum"],
        dampening: float = _SGD["dampening"],
        weight_decay: float = _SGD["weight_decay"],
        nesterov: bool = _SGD["nesterov"],
        *,
        maximize: bool = _SGD["maximize"],
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        overlap: bool = False,
        context: Context | None = None,
    ) -> None:
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                maximize=maximize,
                **_implementation(foreach, fused, differentiable=differentiable),
            ),
            overlap,
            context,
        )


class Adagrad(PSOptimizer):
    """torch.optim.Adagrad's arguments and math, applied on the PS."""

    kind = "adagrad"

    def __init__(
        self,
        params,
        lr: float = _ADAGRAD["lr"],
        lr_decay: float = _ADAGRAD["lr_decay"],
        weight_decay: float = _ADAGRAD["weight_decay"],
        initial_accumulator_value: float = _ADAGRAD["initial_accumulator_value"],
        eps: float = _ADAGRAD["eps"],
        foreach: bool | None = None,
        *,
        maximize: bool = _ADAGRAD["maximize"],
        differentiable: bool = False,
        fused: bool | None = None,
        overlap: bool = False,
        context: Context | None = None,
    ) -> None:
        super().__init__(
            params,
            dict(
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                eps=eps,
                initial_accumulator_value=initial_accumulator_value,
                maximize=maximize,
                **_implementation(foreach, fused, differentiable=differentiable),
            ),
            overlap,
            context,
        )


class Adam(PSOptimizer):
    """torch.optim.Adam's arguments and math, applied on the PS."""

    kind = "adam"

    def __init__(
        self,
        params,
        lr: float = _ADAM["lr"],
        betas: tuple[float, float] = _ADAM["betas"],
        eps: float = _ADAM["eps"],
        weight_decay: float = _ADAM["weight_decay"],
        amsgrad: bool = _ADAM["amsgrad"],
        *,
        foreach: bool | None = None,
        maximize: bool = _ADAM["maximize"],
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = _ADAM["decoupled_weight_decay"],
        overlap: bool = False,
        context: Context | None = None,
    ) -> None:
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                amsgrad=amsgrad,
                maximize=maximize,
                decoupled_weight_decay=decoupled_weight_decay,
                **_implementation(foreach, fused, capturable, differentiable),
            ),
            overlap,
            context,
        )


class AdamW(PSOptimizer):
    """torch.optim.AdamW's arguments and math, applied on the PS."""

    kind = "adamw"

    def __init__(
        self,
        params,
        lr: float = _ADAMW["lr"],
        betas: tuple[float, float] = _ADAMW["betas"],
        eps: float = _ADAMW["eps"],
        weight_decay: float = _ADAMW["weight_decay"],
        amsgrad: bool = _ADAMW["amsgrad"],
        *,
        maximize: bool = _ADAMW["maximize"],
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        overlap: bool = False,
        context: Context | None = None,
    ) -> None:
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                amsgrad=amsgrad,
                maximize=maximize,
                **_implementation(foreach, fused, capturable, differentiable),
            ),
            overlap,
            context,
        )
