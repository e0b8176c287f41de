"""A run's lineage: its id, and the checkpoint it resumed from with that checkpoint's step.

Every manifest names its run (``"run_id"``): an id made when the run first starts (a random
UUID's hex) and kept across resumes, read back from the manifest of the checkpoint the shards
restored. The restored checkpoint's step is the run's step at the resume, as TensorFlow restores
its global step: checkpoint names go on from it (`step_of`), whatever the model holds (dense
variables, embedding tables or both) and whatever step count the script reaches.

The checkpoint resumed from is the one every PS restored when this worker connected (each Hello
names it). Taken once, when the worker joins: a shard that later restores alone (partial recovery)
changes neither the run's id nor its step.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from paramserver.checkpoint.store import CheckpointError, CheckpointStore, is_checkpoint_name

log = logging.getLogger(__name__)
_RUN_ID = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")  # what a manifest's run_id may be (uuid4 hex here)


def new_run_id() -> str:
    return uuid.uuid4().hex


def is_run_id(text: object) -> bool:
    """Whether `text` can be a run's id (a short string of letters, digits, '_', '.', '-')."""
    return isinstance(text, str) and _RUN_ID.match(text) is not None


@dataclass(frozen=True)
class Lineage:
    """The run's id; the checkpoint it resumed from (None: a fresh start) and that checkpoint's step."""

    run_id: str = field(default_factory=new_run_id)
    resumed_from: str | None = None
    resumed_step: int = 0
    data: Any = None  # the data positions that checkpoint recorded (coordinator/dispatcher.py; unchecked here)

    def step_of(self, step: int, restored_position: int) -> int:
        """The run's step after `step` steps of this worker's optimizer, which started counting at
        `restored_position` (this worker's position in the checkpoint resumed from, as the shards
        said; 0 when none said, e.g. a model of tables only): the resumed step plus the steps
        trained since."""
        return self.resumed_step + step - restored_position

    @classmethod
    def of(cls, store: CheckpointStore, hellos: Iterable[dict[str, Any]]) -> Lineage:
        """The lineage of a worker whose shards answered `hellos`: fresh when no shard restored a
        checkpoint; else the newest checkpoint they restored, its step and run id from its manifest
        (a manifest that cannot be read: the step its name says, and a new run id, logged)."""
        names = {hello.get("restored_from") for hello in hellos}
        restored = sorted(str(name) for name in names if is_checkpoint_name(name))
        if not restored:
            return cls()
        name = restored[-1]
        if len(names) > 1:
            log.warning(
                "the shards restored different checkpoints (%s): the run goes on from %s",
                sorted(str(n) for n in names),
                name,
            )
        try:
            manifest = store.manifest(name)
        except CheckpointError as exc:
            log.warning("resumed from %s, whose manifest cannot be read now (%s): its step from its name", name, exc)
            manifest = {}
        return cls(_run_id(name, manifest), name, _step(name, manifest), manifest.get("data"))


def _step(name: str, manifest: dict[str, Any]) -> int:
    step = manifest.get("step")
    if type(step) is int and step >= 0:
        return step
    return int(name.rpartition("-")[2])  # a checkpoint's name is its step (checkpoint_name)


def _run_id(name: str, manifest: dict[str, Any]) -> str:
    run_id = manifest.get("run_id")
    if is_run_id(run_id):
        return str(run_id)
    made = new_run_id()
    log.info("checkpoint %s names no run (written before run ids): the run goes on as run %s", name, made)
    return made
