"""Every request and reply meta of the wire, as typed messages (frozen dataclasses).

A frame (wire/codec.py) is a JSON meta plus named tensors; the classes here are the metas,
one per request and per reply of each method of the shard service (``paramserver.Shard``) and
of the coordinator (``paramserver.Coordinator``). Tensors stay in the frame's tensor part; a
class names the ones its frame carries. Clients build requests with these classes
(``codec.encode_parts(request.to_meta(), tensors)``), services parse them with ``from_meta``
and build their replies with them.

``to_meta()`` leaves out optional fields at their default. ``from_meta(meta)`` checks every
field's type and raises MalformedFrameError naming the message and the field; keys it does not
know are accepted and ignored, so that a peer of a newer minor version may add optional keys.

docs/protocol.md's message tables are generated from here: ``python -m paramserver.wire.messages``
prints them, ``--write docs/protocol.md`` replaces them in place (tests check the two agree).
"""

from typing import Any, NamedTuple

from paramserver.base import names
from paramserver.wire.message_fields import Message, doc_field, message, part_tensors

_NON_EMPTY = lambda value: None if value else "must not be empty"
_name = names.name_problem  # a group or table name: what a checkpoint can hold (base/names.py)
_strings = names.strings_problem  # strings inside a spec that the checkpoint's metadata holds
_checkpoint = names.checkpoint_name_problem
_worker = names.worker_problem  # a worker index a checkpoint's positions can name


def _nonce(value: str) -> str | None:
    """A challenge is the client's to choose; the node only bounds what it puts through its MAC."""
    return None if 0 < len(value) <= 256 else "must be 1 to 256 characters"


class RowPush(NamedTuple):
    """A row push of a step: the table and the names of its two tensors (ids, gradients)."""

    table: str
    ids: str
    grads: str


class RowLookup(NamedTuple):
    """A lookup of a step: the table, the name of its ids tensor, the name its rows come back under."""

    table: str
    ids: str
    rows: str


# ---- shard service (paramserver.Shard) -------------------------------------------------------
@message("Hello request")
class HelloRequest(Message):
    """Discovery: the shard's index, protocol version, stream port and counters."""

    process: bool = doc_field("also say the serving process's resident memory (`paramserver status`)", default=False)


@message("Hello reply")
class HelloReply(Message):
    shard: int = doc_field("the shard's index")
    protocol: list[int] = doc_field("[major, minor] protocol version")
    version: int = doc_field("updates applied (any mode)")
    sync_step: int = doc_field("sync steps applied")
    mode: str = doc_field("consistency mode: async, sync (with N backup workers), ssp:K")
    pushes: int = doc_field("pushes received")
    dropped_late: int = doc_field("late sync pushes dropped")
    waiting: int = doc_field("pushes blocked in a sync step or an ssp bound now")
    staleness_max: int = doc_field("largest staleness of a push")
    staleness_mean: float = doc_field("mean staleness of the pushes")
    tables: dict[str, dict[str, Any]] = doc_field("by table: rows, dim, updates, admission counters, bytes")
    stream_port: int | None = doc_field("the tensor stream's TCP port (a PS node)", default=None)
    host_id: str | None = doc_field(
        "digest of hostname, boot id, PID and network namespace: equal where shm works", default=None
    )
    incarnation: str | None = doc_field("random id of this PS process: a new one after every restart", default=None)
    groups: int = doc_field(
        "dense groups registered (0 for a PS that no worker registered with since it started)", default=0
    )
    restored_from: str | None = doc_field(
        "the checkpoint this PS process restored its shard from (null: it started empty)", default=None
    )
    rss_bytes: int | None = doc_field(
        "the serving process's resident memory, in bytes (asked with `process`; not told to a caller "
        "without a token from another host)",
        default=None,
    )


@message(
    "Register request",
    tensors="the group's initial values (float32), by part name (a name; `var[lo:hi]`: hi - lo rows)",
    check_tensors=part_tensors,
)
class RegisterRequest(Message):
    """Register a group of variables; the first registration wins, later ones adopt its values."""

    group: str = doc_field(
        "the optimizer param group's name (a name: 1-256 characters, no control characters, no `/`)", check=_name
    )
    optimizer: dict[str, Any] = doc_field('{"name", "hyper"}: the optimizer and its hyper-parameters', check=_strings)
    consistency: dict[str, Any] | None = doc_field(
        '{"mode", "workers", "backups", "staleness"}: a mode other than the shard\'s is refused', default=None
    )
    worker: int | None = doc_field("the registering worker's index", default=None, check=_worker)
    dtypes: dict[str, str] = doc_field(
        "wire dtype by part name, for parts whose gradients and values travel as `bfloat16` (uint16 bits) or "
        "`float16`; absent: float32. The PS keeps float32 values either way",
        default={},
    )


@message("Register reply", tensors="the stored values of the registered parts, in their wire dtypes")
class RegisterReply(Message):
    version: int = doc_field("the shard's version")
    position: int = doc_field("batches this worker trained, as the shard counted them (resumable data)")
    restored: int = doc_field("this worker's step in the checkpoint the shard started from (0: none)")


@message(
    "PushPull request",
    tensors="the row pushes' ids and gradients and the lookups' ids, under the names its fields give; every other "
    "tensor is a gradient, by part name (in its wire dtype)",
)
class PushPullRequest(Message):
    """One training step of one worker on this shard: push gradients, push embedding rows, look rows up
    and pull values, in one round trip. Every part is checked before any is applied."""

    pull: list[str] | None = doc_field("part names to pull (absent: the pushed names)", default=None)
    worker: int | None = doc_field("the pusher's index", default=None, check=_worker)
    step: int | None = doc_field("the sync step it pushes for", default=None)
    rows: list[RowPush] = doc_field("row pushes: [table, ids tensor, gradients tensor]", default=[])
    lookups: list[RowLookup] = doc_field(
        "row lookups, read after the pushes: [table, ids tensor, name of the rows in the reply]", default=[]
    )
    resumed: str | None = doc_field("barrier that opened: every worker that waited there is back", default=None)
    marker: bool = doc_field("count as the worker's step with nothing to push", default=False)
    base: int | None = doc_field("the shard version the gradients were computed from", default=None)
    lr: dict[str, float] = doc_field("learning rate by group, when it changed", default={})
    codecs: dict[str, dict[str, Any]] = doc_field(
        "by gradient tensor name (a part or a row push's grads): its compressed encoding, decoded to float32 "
        'before any check (see "Compressed gradients")',
        default={},
    )
    pull_as: str | None = doc_field(
        "`bfloat16` or `float16`: the pulled float32 variables' values come back in that dtype (half the bytes; "
        "the PS keeps float32 masters). Absent: each in its wire dtype",
        default=None,
        check=lambda dtype: None if dtype in (None, "bfloat16", "float16") else "must be bfloat16 or float16",
    )


@message(
    "PushPull reply",
    tensors="values of the pulled names (in their wire dtypes), plus the looked-up rows (under their `rows` names)",
)
class PushPullReply(Message):
    version: int = doc_field("the shard's version after the push")
    step: int = doc_field("the shard's sync step")
    staleness: int = doc_field("versions the gradients were behind")
    applied: bool = doc_field("false for a push dropped as late")


@message("SetMode request")
class SetModeRequest(Message):
    """Switch the shard's consistency mode now."""

    consistency: dict[str, Any] = doc_field('{"mode", "workers", "backups", "staleness"}')


@message("SetMode reply")
class SetModeReply(Message):
    version: int = doc_field("the shard's version")
    step: int = doc_field("the shard's sync step")


@message("Leave request")
class LeaveRequest(Message):
    """Take a worker out of every sync/ssp quorum until its next push."""

    worker: int = doc_field("the worker's index")
    barrier: str | None = doc_field("the barrier it waits at", default=None)
    gone: str | None = doc_field(
        "why it is gone for good (from the coordinator's host): waits fail at once", default=None
    )


@message("Leave reply")
class LeaveReply(SetModeReply):
    pass


@message("RegisterTable request")
class RegisterTableRequest(Message):
    """Create an embedding table's part on this shard."""

    table: str = doc_field("the table's name (a name: 1-256 characters, no control characters, no `/`)", check=_name)
    dim: int = doc_field("values per row")
    optimizer: dict[str, Any] = doc_field('{"name", "hyper"}: the row-wise optimizer', check=_strings)
    init: dict[str, Any] = doc_field('{"kind", ...}: the rows\' initializer', check=_strings)
    policy: dict[str, Any] = doc_field("row admission and eviction (RowPolicy)", default={}, check=_strings)
    capacity: int = doc_field("rows this shard reserves up front (at most 2^30)", default=0)
    num_shards: int = doc_field("the shards the table spreads over", default=1)
    consistency: dict[str, Any] | None = doc_field("the mode, for a shard that holds no dense variable", default=None)
    worker: int | None = doc_field("the registering worker's index", default=None, check=_worker)
    dtype: str = doc_field(
        "wire dtype of the rows and row gradients: `float32`, `bfloat16` (uint16 bits) or "
        "`float16`; the PS keeps float32 rows either way",
        default="float32",
    )


@message("RegisterTable reply")
class RegisterTableReply(Message):
    """The worker's data position, as a Register reply gives it: a model of tables only resumes there too."""

    position: int = doc_field(
        "batches this worker trained, as the shard counted them (resumable data; absent: 0, before 2.1)", default=0
    )
    restored: int = doc_field(
        "this worker's step in the checkpoint the shard started from (0: none; absent: 0, before 2.1)", default=0
    )


@message("Lookup request", tensors="`ids` (int64, 1-D, distinct)")
class LookupRequest(Message):
    """Read rows; missing ones are created."""

    table: str = doc_field("the table's name")


@message("Lookup reply", tensors="`rows` (len(ids) x dim, in the table's wire dtype)")
class LookupReply(Message):
    pass


PROBE_MAX_BYTES = 16 << 20  # the most a Probe carries either way: enough to time a 25 Gbit/s link


@message("Probe request", tensors="`payload` (uint8, 1-D, at most 16 MiB): bytes sent to time the link up")
class ProbeRequest(Message):
    """Time the link to this shard (`compression` `auto`, client/link.py): the reply carries `reply_bytes`
    zero bytes back. Changes nothing on the shard."""

    reply_bytes: int = doc_field(
        "bytes the reply carries back (0 to 16 MiB)",
        default=0,
        check=lambda n: None if 0 <= n <= PROBE_MAX_BYTES else f"must be 0 to {PROBE_MAX_BYTES}",
    )


@message("Probe reply", tensors="`payload` (uint8, `reply_bytes` of them)")
class ProbeReply(Message):
    pass


@message("Checkpoint request")
class CheckpointRequest(Message):
    """Write this shard's file of a checkpoint, under the PS's own checkpoint directory (`--checkpoint-dir`):
    no path comes from the wire. A name that holds a committed checkpoint is refused (ALREADY_EXISTS).
    In two calls when `background` is set: the first takes the cut (the shard's state at this instant)
    and replies at once while the file is written in the background; calls with `collect` then wait for
    the file (a PS before 2.2 ignores both and writes the file within the first call: its reply is the entry)."""

    name: str = doc_field("the checkpoint's name (ckpt-<9 digits>)", check=_checkpoint)
    parent: str = doc_field(
        "write a delta on this earlier checkpoint: only the rows changed since this PS's file of it "
        "(a PS without one writes a whole file)",
        default="",
        check=lambda parent: _checkpoint(parent) if parent else None,
    )
    background: bool = doc_field(
        "take the cut and reply at once (`pending`); the file is written in the background", default=False
    )
    collect: bool = doc_field(
        "wait up to `wait_s` for the background write of `name` begun earlier: its entry, or `pending` while "
        "it still writes, or the error that ended it",
        default=False,
    )
    wait_s: float = doc_field(
        "how long a `collect` waits before it answers `pending` (0 to 60)",
        default=0.0,
        check=lambda wait: None if 0.0 <= wait <= 60.0 else "must be 0 to 60",
    )


@message("Checkpoint reply")
class CheckpointReply(Message):
    """The shard file's manifest entry, once the file is written (`pending` false)."""

    index: int = doc_field("the shard's index")
    file: str = doc_field("the file's name in the checkpoint", default="")
    bytes: int = doc_field("its size", default=0)
    sha256: str = doc_field("its SHA-256, hex", default="")
    parent: str = doc_field("the checkpoint the file is a delta on (absent: a whole file)", default="")
    pending: bool = doc_field("the file is still being written (the other fields are empty)", default=False)
    written: int = doc_field("(a pending reply) the bytes of the file written so far", default=0)
    holds_changes: bool = doc_field(
        "(a begun write) the shard's tables take no change until the file is written (tiered tables): the "
        "workers stay paused until it is",
        default=False,
    )


@message("Assign request", tensors="the new values, one per part, as in Register")
class AssignRequest(Message):
    """Overwrite registered variables' values (the chief, before a checkpoint, when dense variables are
    trained by all-reduce among the workers: `dense_sync` "allreduce"). Every part is checked (known,
    same shape, float32, finite) before any is written; optimizer state, step counts and the version
    stay as they are."""

    worker: int | None = doc_field("the writing worker's index", default=None, check=_worker)


@message("Assign reply")
class AssignReply(Message):
    version: int = doc_field("the shard's version (unchanged by an Assign)")


@message("Shutdown request")
class ShutdownRequest(Message):
    """Drain and stop this PS: health goes NOT_SERVING, calls in flight finish within `drain_grace_s`,
    and the process exits 0, as on SIGTERM. With a token store (`auth_tokens`) an admin call (and the
    chief's, with `restart` or `end`); without one, anyone who reaches the PS may call it (docs/security.md)."""

    reason: str = doc_field("why, for the log and the audit trail", default="")
    restart: bool = doc_field(
        "exit with code 75 instead of 0, for the node's restart loop to start it again from "
        "the latest checkpoint (a roll-back; the chief may ask this)",
        default=False,
    )
    end: bool = doc_field(
        "the run completed: exit 0 for good (the chief asks this with `stop_ps_at_end`, so that a PS "
        "ends with its job)",
        default=False,
    )


@message("Shutdown reply")
class ShutdownReply(Message):
    """Sent before the drain starts."""

    version: int = doc_field("the shard's version when the drain was asked for")


@message("Prove request")
class ProveRequest(Message):
    """A challenge: prove that this node belongs to the `paramserver run` that started it (it holds the
    run's secret, docs/security.md "Run files"). Needs no token: `paramserver status` and `shutdown` ask it
    before they send one. A node that holds no run secret refuses it (FAILED_PRECONDITION)."""

    nonce: str = doc_field("a random challenge (1-256 characters; `status` sends 64 hex digits)", check=_nonce)


@message("Prove reply")
class ProveReply(Message):
    proof: str = doc_field(
        "HMAC-SHA256 of the node's name (`ps-<i>` or `coordinator`) and the nonce, keyed with the run's secret, hex"
    )


SHARD_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Hello": (HelloRequest, HelloReply),
    "Register": (RegisterRequest, RegisterReply),
    "PushPull": (PushPullRequest, PushPullReply),
    "SetMode": (SetModeRequest, SetModeReply),
    "Leave": (LeaveRequest, LeaveReply),
    "RegisterTable": (RegisterTableRequest, RegisterTableReply),
    "Lookup": (LookupRequest, LookupReply),
    "Checkpoint": (CheckpointRequest, CheckpointReply),
    "Assign": (AssignRequest, AssignReply),
    "Shutdown": (ShutdownRequest, ShutdownReply),
    "Prove": (ProveRequest, ProveReply),
    "Probe": (ProbeRequest, ProbeReply),
}


# ---- coordinator (paramserver.Coordinator) ---------------------------------------------------
class MembershipEvent(NamedTuple):
    """A worker joined or left an elastic run: seconds since the coordinator started, the worker, what."""

    t: float
    worker: int
    event: str  # joined, rejoined, left or died


class DataPosition(NamedTuple):
    """Where a worker is in the data the coordinator hands out: an epoch's split, and the batches of it trained."""

    epoch: int
    split: int
    position: int


@message("coordinator reply")
class CoordinatorReply(Message):
    """The membership as the coordinator sees it (every method's reply)."""

    global_step: int = doc_field("sum of the members' reported steps")
    live: list[int] = doc_field("workers training or finished")
    workers: int = doc_field("workers in the cluster")
    states: dict[str, str] = doc_field("by worker: joining, training, finished, exited, dead or absent")
    checkpoints_requested: int = doc_field(
        "checkpoints announced so far: every worker meets at barrier checkpoint#<this> after the step at "
        "which it learns of a new one"
    )
    steps: dict[str, int] | None = doc_field("by worker: its step, as its latest heartbeat said", default=None)
    open: bool | None = doc_field("Barrier only: whether it opened", default=None)
    waiting: list[int] | None = doc_field("Barrier only, not open: the workers it waits for", default=None)
    incarnation: str | None = doc_field(
        "random id of this coordinator: a new one when the chief restarted", default=None
    )
    published: dict[str, str] | None = doc_field(
        "what the hosting worker published for the others, by key "
        "(e.g. `dense_sync`: the all-reduce rendezvous address)",
        default=None,
    )
    elastic: bool | None = doc_field("Hello only: whether workers join and leave the run (max_workers)", default=None)
    events: list[MembershipEvent] | None = doc_field(
        "Hello only, elastic runs: the joins and leaves so far, [seconds since start, worker, what]", default=None
    )
    split: DataPosition | None = doc_field(
        "Split only: the split this worker trains next, from `position` on (none: see `data_done`)", default=None
    )
    data_done: bool | None = doc_field(
        "Split only, no split given: true when every split of every epoch is done; false: others hold the "
        "last ones (ask again)",
        default=None,
    )
    split_lost: bool | None = doc_field(
        "Heartbeat and Barrier: the split this worker reported on was taken back (it was found dead): it stops "
        "training it and asks for another",
        default=None,
    )


@message("coordinator Hello request")
class CoordinatorHelloRequest(Message):
    """The current view."""


@message("coordinator Join request")
class JoinRequest(Message):
    """A worker starts (or starts again, or trains again after Finish)."""

    worker: int = doc_field("the worker's index")


@message("coordinator Heartbeat request")
class HeartbeatRequest(JoinRequest):
    """A worker is alive. With `wait`, a long poll: the reply comes when a checkpoint after `checkpoints` is
    announced, or after `wait` seconds (so a worker hears of a checkpoint at once, not a heartbeat later)."""

    step: int = doc_field("the worker's own step count")
    wait: float = doc_field("seconds to hold the reply at most (0 to 60; 0: at once)", default=0.0)
    checkpoints: int = doc_field(
        "the checkpoints announced that this worker knows of: one more ends the wait", default=0
    )
    position: DataPosition | None = doc_field(
        "the split this worker trains and the batches of it trained (a dispatched run)", default=None
    )


@message("coordinator Finish request")
class FinishRequest(JoinRequest):
    """A worker's data is done: out of every quorum, still met at barriers."""


@message("coordinator Barrier request")
class BarrierRequest(JoinRequest):
    """A long poll: UNAVAILABLE, naming a dead worker it needs."""

    name: str = doc_field("the barrier's name", check=_NON_EMPTY)
    wait: float = doc_field("seconds to wait at most (0 to 60)")
    training_only: bool = doc_field("skip finished workers (checkpoint and mode-switch pauses)", default=False)
    position: DataPosition | None = doc_field(
        "as Heartbeat's: at a checkpoint's barrier the positions are exact, and the checkpoint records them",
        default=None,
    )


@message("coordinator Leave request")
class CoordinatorLeaveRequest(JoinRequest):
    """A worker's script ended, or it leaves an elastic run: the split it held goes back at `position`."""

    position: DataPosition | None = doc_field("as Heartbeat's: its last position", default=None)


@message("coordinator Split request")
class SplitRequest(JoinRequest):
    """The next split of the data for this worker (a long poll while others hold the last ones). The
    first call describes the data; later ones must describe it the same way."""

    splits: int = doc_field("the data's splits (1 to 2^20)")
    epochs: int = doc_field("the epochs to train (1 to 2^20)")
    done: DataPosition | None = doc_field("the split this worker finished, with its batch count", default=None)
    wait: float = doc_field("seconds to wait at most for a split taken back (0 to 60)", default=0.0)


@message("coordinator RequestCheckpoint request")
class RequestCheckpointRequest(JoinRequest):
    """The chief asks for a checkpoint: one is announced, unless the last one is not written yet."""


COORDINATOR_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "Hello": (CoordinatorHelloRequest, CoordinatorReply),
    "Join": (JoinRequest, CoordinatorReply),
    "Heartbeat": (HeartbeatRequest, CoordinatorReply),
    "Finish": (FinishRequest, CoordinatorReply),
    "Barrier": (BarrierRequest, CoordinatorReply),
    "Leave": (CoordinatorLeaveRequest, CoordinatorReply),
    "RequestCheckpoint": (RequestCheckpointRequest, CoordinatorReply),
    "Split": (SplitRequest, CoordinatorReply),
    "Prove": (ProveRequest, ProveReply),
}

SERVICES = {"paramserver.Shard": SHARD_METHODS, "paramserver.Coordinator": COORDINATOR_METHODS}


if __name__ == "__main__":
    from paramserver.wire.message_fields import main

    main(SERVICES)
