"""One verdict on a checkpoint, shared by whatever chooses or reads one: the chief before it commits
a checkpoint (and counts it written), retention, resume, `checkpoint list`, export, the evaluator
and serving. A checkpoint passes when restore would restore it: the verdict is restore's own
check (a RestoreSource opened on it, restore.py), not a copy of it.

What is checked, reading each file once a slice at a time (bounded memory whatever a file says):
the manifest (format, shard entries, step); every shard file a regular file of the size and SHA-256
its manifest names, each chunk of its tensors of the SHA-256 its header records, and the header of
its own (files/chunks.py; absent in older files); its header (every tensor's range inside the file,
before anything is allocated for it) and metadata (schema, shard_meta.py); dense parts tiling their
variables; every table's ids 1-D int64 and distinct, one row of each tensor per id, each tensor of
the dtype and row shape its optimizer, row policy and encoding make (quantize.py: int8 scales in
range for every code, q = -128 too); values finite unless allowed; a delta's deleted ids int64, its
chain's links of the same shard count, dims and optimizers, and the rows current at the delta as
many as its metadata says (counted in bounded memory: chain.py).

A resuming PS does not run the verdict before it restores: it chooses by what the chief checks
(below) and checks each chunk as it reads it (`RestoreSource.latest(contents=False)`, restore.py).

A checkpoint that passed in a process is remembered by its store (by the files its manifest
names), so a chain's links are not read again at every new delta.

Before the chief commits a checkpoint it runs the verdict with `contents=False`: each PS checked
its own file's contents as it wrote it (shard_file.py: every value and scale, row counts, the
header and metadata read back), so the chief checks what no single writer sees: the manifest,
every file's size (a stat) and its header and metadata (a few KB each, parsed as restore parses
them), dense parts tiling their variables across files, tables agreeing across files (dim,
optimizer, the shard count their ids were routed over: the checkpoint's), and the chain's links
(their headers). Its cost is a few reads per file, whatever the files' sizes; the
contents were checked by as many writers as there are PS, at once. What it leaves to restore
(and to every other reader of files from disk): ids distinct (a table's ids come from its hash
index, which holds each once) and a delta's rows counted through its chain.
"""

from __future__ import annotations

import logging
from typing import Any

from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore

log = logging.getLogger(__name__)


def check_checkpoint(
    store: CheckpointStore,
    name: str,
    manifest: dict[str, Any] | None = None,
    allow_non_finite: bool = False,
    contents: bool = True,
) -> None:
    """Raise a CheckpointError naming the first problem of checkpoint `name` unless it restores.
    `manifest`: its manifest in memory, for a checkpoint whose files are written and whose
    MANIFEST.json is not yet (checked as `commit` would write it); None: the one it has.
    `contents=False`: its writers checked every file's contents as they wrote them (the chief's
    check before a commit, see the module docstring): only what the manifest, the files' sizes and
    their headers say is checked, and the files' contents are not read. Readers of files from disk
    (list, resume, export, serving, the evaluator) keep the default."""
    if contents:
        RestoreSource(store, name, allow_non_finite=allow_non_finite, manifest=manifest)
        return
    source = RestoreSource(store, name, verify=(), allow_non_finite=allow_non_finite, manifest=manifest)
    if not allow_non_finite:  # with its writers' checks, it passed every check: retention reads it no more
        store.note_passed(name, source.manifest)


def verdict(store: CheckpointStore, name: str, allow_non_finite: bool = False) -> str | None:
    """None when checkpoint `name` passes, else what is wrong with it (`checkpoint list`'s status)."""
    try:
        check_checkpoint(store, name, allow_non_finite=allow_non_finite)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"checkpoint {name}: ")
    return None


def newest_passing(store: CheckpointStore, allow_non_finite: bool = False) -> RestoreSource | None:
    """The newest complete checkpoint that passes, opened (None: there is none); each newer one
    that does not is logged with why and skipped. Resume, the evaluator and export choose with it."""
    return RestoreSource.latest(store, allow_non_finite)


def newest_passing_name(store: CheckpointStore, allow_non_finite: bool = False) -> str | None:
    """The name of `newest_passing`'s checkpoint (None: there is none)."""
    source = newest_passing(store, allow_non_finite)
    return source.name if source is not None else None
