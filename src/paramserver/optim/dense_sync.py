"""Dense variables trained by all-reduce among the workers (`dense_sync` "allreduce"); embedding
tables stay on the PS. docs/performance.md, "Hybrid: all-reduce for dense, PS for embeddings".

- Rendezvous: the worker hosting the coordinator (worker 0) serves a torch.distributed TCPStore on a
  free port and publishes its address through the coordinator (`published["dense_sync"]`); the
  others read it there. One gloo process group per worker process (rank = worker index, world =
  the number of workers), private to paramserver: a script may still use torch.distributed itself.
- A step: each PS optimizer packs its dense gradients into one flat float32 buffer, all-reduced in
  a few buckets (SUM). The buffer starts with a header: the number of workers contributing, and
  per variable the number of workers that had a gradient for it; each variable's sum is divided
  by its own count, as a sync step on the PS averages (server/consistency.py). Every worker then
  applies the same averaged gradient with a local torch.optim optimizer of the PS optimizer's kind
  and hyper-parameters, so the workers' dense values stay equal.
- Uneven ends (like torch DDP's Join): a worker that waits (`ctx.barrier`, or the end of the
  script after it trained or finished its data since it last did) first steps out: its deferred
  `finish_training` takes effect (it leaves the shards' quorums; a loop reading a batch ahead ends
  its data before its last step), then it answers the others' all-reduces with zeros and a count of
  0, applying the averaged updates too, until an all-reduce comes back with a count of 0: every
  worker stepped out, and all stop at that same call. Workers meeting at a barrier in the middle of
  training step out together and train on in step. Every worker steps its optimizers in the same
  order.
- Failures: every gloo call has the `rpc_timeout_s` deadline. A worker that dies fails the others'
  current all-reduce (at once when its connections close, else after the deadline); they flag a
  roll-back and stop with RollbackError, so `paramserver node` exits with RESTART_EXIT_CODE and the
  cluster starts again from its latest checkpoint (a group cannot take a worker back alone; a
  worker restarted alone asks for the roll-back itself).
- Checkpoints: the dense variables are registered on the PS as in "ps" mode (their first values,
  a restore, the checkpoint files, the evaluator all work as before) but not trained there; before
  the shards write a checkpoint the chief writes its current dense values to them (Assign). The
  local optimizer's state (momentum, Adam moments) is not in checkpoints: a resumed run starts it
  afresh.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

from paramserver.base.errors import InvalidArgumentError, RollbackError, UnavailableError

log = logging.getLogger(__name__)
PUBLISHED_KEY = "dense_sync"
BUCKET_ELEMENTS = 4 << 20  # 16 MB of float32 per all-reduce call; a few calls in flight at once


def _without_dynamo(cls: type[torch.optim.Optimizer]) -> type:
    """torch.optim's `cls` without the wrappers whose first call imports torch._dynamo (3-4 s and about
    70 MB; nothing here is compiled), as PSOptimizer does; its `step` must run under torch.no_grad."""
    base = torch.optim.Optimizer
    # torch's annotations of its decorated methods do not show the `__wrapped__` functools.wraps keeps
    return type(
        cls.__name__,
        (cls,),
        {
            "add_param_group": base.add_param_group.__wrapped__,  # type: ignore[attr-defined]
            "zero_grad": base.zero_grad.__wrapped__,  # type: ignore[attr-defined]
            "step": cls.step.__wrapped__,  # type: ignore[attr-defined]
        },
    )


LOCAL_OPTIMIZERS = {
    kind: _without_dynamo(cls)
    for kind, cls in (
        ("sgd", torch.optim.SGD),
        ("adagrad", torch.optim.Adagrad),
        ("adam", torch.optim.Adam),
        ("adamw", torch.optim.AdamW),
    )
}


class AllReduceGroup:
    """This worker's gloo process group and the DenseSyncs that use it (in creation order)."""

    def __init__(self, context) -> None:
        self.context = context
        self.rank, self.world = context.worker_index, context.num_workers
        self.timeout = datetime.timedelta(seconds=context.options.rpc_timeout_s)  # of every collective
        self.members: list[DenseSync] = []
        # it trained, or finished its data, since it last stepped out: it does before the script ends
        self.join_due = False
        self.data_ended = False  # finish_training ran since it last stepped out
        self._store: Any = None
        self._pg: Any = None
        if self.world > 1:
            self._connect()

    def _connect(self) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        options, coordinator = self.context.options, self.context.coordinator
        # the rendezvous waits for late workers as long as joining the cluster does
        joining = datetime.timedelta(seconds=options.connect_timeout_s)
        try:
            if self.rank == 0:
                host = self.context.coordinator_host.address.rsplit(":", 1)[0]
                self._store = TCPStore(host, 0, self.world, True, timeout=joining, wait_for_workers=False)
                coordinator_state = self.context.coordinator_host.coordinator
                coordinator_state.publish(PUBLISHED_KEY, f"{host}:{self._store.port}")
            else:
                host, port = coordinator.published(PUBLISHED_KEY, options.connect_timeout_s).rsplit(":", 1)
                self._store = TCPStore(host, int(port), self.world, False, timeout=joining)
            # torch's stub calls it `Options`; at runtime that name is Backend.Options, Gloo's own is `_Options`
            gloo = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo._timeout = self.timeout
            own_host = (self.context.address or "").rsplit(":", 1)[0]
            gloo._devices = [
                ProcessGroupGloo.create_device(hostname=own_host)
                if own_host not in ("", "0.0.0.0")
                else ProcessGroupGloo.create_default_device()
            ]
            # keys under the coordinator's incarnation: a cluster rolled back meets afresh
            store = PrefixStore(f"paramserver/{coordinator.incarnation}", self._store)
            self._pg = ProcessGroupGloo(store, self.rank, self.world, gloo)
        except RuntimeError as exc:
            fail(self.context, f"dense all-reduce: worker {self.rank} could not join the gloo group: {exc}")
        log.info("dense all-reduce: worker %d of %d joined the gloo group", self.rank, self.world)

    def all_reduce(self, buckets: list[torch.Tensor]) -> None:
        """Sum `buckets` over the workers, in place, all in flight at once; within `rpc_timeout_s`."""
        if self._pg is None:
            return
        try:
            works = [self._pg.allreduce([bucket]) for bucket in buckets]
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            fail(
                self.context,
                f"dense all-reduce failed: a worker died, or did not answer within "
                f"{self.timeout.total_seconds():.0f}s: {exc}",
            )

    def broadcast(self, flat: torch.Tensor) -> None:
        """Worker 0's `flat` on every worker, in place."""
        if self._pg is None:
            return
        try:
            self._pg.broadcast(flat, 0).wait(self.timeout)
        except RuntimeError as exc:
            fail(self.context, f"dense all-reduce: the broadcast of the initial values failed: {exc}")

    def join(self) -> None:
        """Step out: answer the others' all-reduces (zeros, count 0, applying their averaged updates)
        until every worker stepped out (its data done, or at a barrier), all at the same call."""
        self.join_due = False
        if not self.members or self._pg is None:
            return
        rounds = 0
        while all(member.answer() for member in self.members):
            rounds += 1
        log.info("dense all-reduce: every worker stepped out (this one answered %d steps of the others)", rounds)


def fail(context, reason: str) -> None:
    """A peer is gone or the group is unusable: the cluster rolls back (RollbackError); without a
    cluster to roll back (in-process), UnavailableError."""
    if context.rollback is None:
        raise UnavailableError(reason)
    context.rollback.flag(reason)
    raise RollbackError(reason)


def group_of(context) -> AllReduceGroup:
    """The process's AllReduceGroup, made (and joined) by its first allreduce optimizer."""
    if context.dense_group is None:
        context.dense_group = AllReduceGroup(context)
    return context.dense_group


class DenseSync:
    """One PS optimizer's dense parameters, trained by all-reduce and a local torch optimizer."""

    def __init__(self, optimizer, params: list[tuple[str, torch.Tensor]]) -> None:
        context = optimizer.context
        self.ps_optimizer = optimizer
        self.params = params
        if context.rejoined:  # the others' group has no place for a worker restarted alone
            fail(
                context,
                f"dense all-reduce: worker {context.worker_index} restarted alone, and the workers' "
                "gloo group cannot take it back: the cluster rolls back",
            )
        self.group = group_of(context)
        self.local = self._local_optimizer(optimizer)
        sizes = [param.numel() for _, param in params]
        self._header = 1 + len(params)
        self._offsets = [self._header + sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.buffer = torch.zeros(self._offsets[-1], dtype=torch.float32)
        self.buckets = list(self.buffer.split(BUCKET_ELEMENTS))
        self._broadcast_values()
        self.group.members.append(self)
        if context.is_chief and context.checkpointer is not None:
            context.checkpointer.before_save.append(self.write_to_ps)

    @staticmethod
    def _local_optimizer(optimizer) -> torch.optim.Optimizer | None:
        dense = {id(param) for _, param in optimizer._vars}
        groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if id(p) in dense]
            if params:
                groups.append(
                    {**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": params}
                )
        return LOCAL_OPTIMIZERS[optimizer.kind](groups) if groups else None

    @torch.no_grad()
    def _broadcast_values(self) -> None:
        values = self.buffer[self._header :]
        for (_, param), lo, hi in zip(self.params, self._offsets, self._offsets[1:]):
            self.buffer[lo:hi].copy_(param.detach().reshape(-1))
        self.group.broadcast(values)
        self._unpack(lambda param, flat: param.copy_(flat.view_as(param)))

    def _unpack(self, use) -> None:
        for (_, param), lo, hi in zip(self.params, self._offsets, self._offsets[1:]):
            use(param.data, self.buffer[lo:hi])

    @torch.no_grad()
    def step(self) -> None:
        """All-reduce this worker's dense gradients and apply the average locally (a training step)."""
        self.buffer.zero_()
        self.buffer[0] = 1.0
        for i, ((name, param), lo, hi) in enumerate(zip(self.params, self._offsets, self._offsets[1:])):
            if param.grad is not None:
                if param.grad.is_sparse:
                    raise InvalidArgumentError(f"{name}: sparse gradients are not supported for dense variables")
                self.buffer[1 + i] = 1.0
                self.buffer[lo:hi].copy_(param.grad.detach().reshape(-1))
        self.group.join_due = True
        self._reduce_and_apply()

    @torch.no_grad()
    def answer(self) -> bool:
        """Take part in the others' all-reduce with nothing of this worker's (its data is done);
        False once no worker contributed: every one is done."""
        self.buffer.zero_()
        return self._reduce_and_apply()

    def _reduce_and_apply(self) -> bool:
        self.group.all_reduce(self.buckets)
        if self.buffer[0].item() == 0:
            return False
        for i, ((_, param), lo, hi) in enumerate(zip(self.params, self._offsets, self._offsets[1:])):
            count = self.buffer[1 + i].item()
            if count == 0:  # no worker had a gradient: torch.optim skips the parameter
                param.grad = None
                continue
            average = self.buffer[lo:hi].div_(count).view_as(param)
            if param.grad is None:
                param.grad = average.to(param.device, copy=True)
            else:
                param.grad.copy_(average)
        if self.local is not None:
            for local, group in zip(self.local.param_groups, self._dense_groups()):
                local["lr"] = group["lr"]  # an LR scheduler changes the PS optimizer's groups
            self.local.step()
        return True

    def _dense_groups(self) -> list[dict]:
        dense = {id(param) for _, param in self.params}
        return [g for g in self.ps_optimizer.param_groups if any(id(p) in dense for p in g["params"])]

    @torch.no_grad()
    def write_to_ps(self, timeout: float) -> None:
        """Write this worker's dense values to the PS (the chief, before the shards write a checkpoint)."""
        values = {var: param.detach().cpu().float().numpy() for var, param in self.params}  # the PS's masters
        self.ps_optimizer.context.client.assign(values, timeout)
