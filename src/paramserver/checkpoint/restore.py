"""One checkpoint, read a piece at a time, for a cluster of any size (restore onto more or fewer PS).

Opening a checkpoint reads its manifest and each shard file's header (a few KB): every shard file
is checked against the manifest's size, and the files named in `verify` (default: all) against
its SHA-256 too, a chunk at a time. Any other file is checked as it is read: each chunk it reads
against the chunk's SHA-256 in the file's header (files/chunks.py, itself checked against the
header's own digest), or, for a file written without chunk hashes, whole on its first read.
Nothing is kept: a new shard asks for its dense parts (`dense_part`: only the rows it holds, read
from the files that hold them) and its table rows (`fill_table`: streamed into the table a slice
at a time; with the shard count the checkpoint was written with, a shard reads its own file only,
otherwise every file's ids and the rows that hash to it: ``mix64(id) % num_shards``).

Dense variables are reassembled from their parts (a part named ``var[lo:hi]`` holds rows lo..hi
of axis 0). Nothing read is trusted: a file that is not a regular file in the checkpoint's
directory, a malformed header, metadata that fails its schema (shard_meta.py), parts that do not
tile their variable, shapes that do not fit, an id twice and non-finite values (unless
`allow_non_finite`) are CheckpointErrors naming the file. Every check that needs no model runs
when the source is opened, so a damaged checkpoint is skipped for the one before it (`latest`).

An incremental checkpoint is read with its chain (chain.py): every checkpoint its files are
deltas on is opened and checked as it is; dense variables, counters and positions come from the
checkpoint itself, table rows from its chain (`fill_table` applies base then deltas; the other
readers stream the rows current at the checkpoint). A damaged link makes the checkpoint damaged,
so `latest` falls back to the newest good point of the chain (links opened once, by name).

Thread-safety: any method may be called from several threads (each read opens its own handle).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramserver.base.errors import InvalidArgumentError
from paramserver.checkpoint import chain
from paramserver.checkpoint.chain import Link, SavedFile
from paramserver.checkpoint.files import quantize
from paramserver.checkpoint.files.tensor_file import TensorReader, TensorSpec
from paramserver.checkpoint.store import CheckpointError, CheckpointStore
from paramserver.tables.table import Table

log = logging.getLogger(__name__)
_SPLIT = re.compile(r"^(.*)\[(\d+):(\d+)\]$")
SLICE_BYTES = chain.SLICE_BYTES  # bytes of rows read at a time


def part_rows(part: str) -> tuple[str, int | None, int | None]:
    """(variable, lo, hi) of a part name; lo and hi are None for a whole variable."""
    match = _SPLIT.match(part)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else (part, None, None)


@dataclass
class DenseVariable:
    value: np.ndarray
    state: dict[str, np.ndarray]
    steps: int


@dataclass
class SavedTable:
    meta: dict
    ids: np.ndarray
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # values, each state, row_step/last_seen/seen


@dataclass(frozen=True)
class _Piece:
    """One saved part of a dense variable: in file `index`, rows lo.. of the variable."""

    index: int
    part: str
    lo: int
    rows: int
    steps: int


class RestoreSource:
    """A checkpoint to restore from (see the module docstring). `verify`: the shard files hashed
    now (None: all); the others are hashed on first read."""

    def __init__(
        self,
        store: CheckpointStore,
        name: str,
        verify: Iterable[int] | None = None,
        allow_non_finite: bool = False,
        links: dict[str, Link | CheckpointError] | None = None,
        manifest: dict[str, Any] | None = None,
        by_chunk: bool = False,
    ) -> None:
        """`links`: checkpoints opened before (or the error that opening one raised), by name:
        shared by the tries of `latest`, so that no file of a chain is checked twice.
        `manifest`: checkpoint `name`'s manifest in memory, before it is written (its files are).
        `by_chunk`: a file without chunk hashes (an older one) is checked whole when opened, as
        if `verify` named it (what `latest(contents=False)` asks)."""
        self.store, self.name, self.allow_non_finite = store, name, allow_non_finite
        self._verify = None if verify is None else set(verify)
        self._by_chunk = by_chunk
        self._links = links if links is not None else {}
        if manifest is not None:
            self._links[name] = Link(store, name, self._verify, allow_non_finite, manifest, by_chunk)
        newest = self._link(name)
        self.manifest, self.step, self.num_shards = newest.manifest, newest.step, newest.num_shards
        self._files: dict[int, SavedFile] = newest.files
        self._chains = {index: chain.file_chain(newest, index, self._link) for index in self._files}
        self.links = sorted({saved.link.name for files in self._chains.values() for saved in files})
        self.positions: dict[int, int] = {}  # each worker's steps at the checkpoint
        for saved in self._files.values():
            for worker, position in saved.meta["positions"].items():
                self.positions[int(worker)] = max(self.positions.get(int(worker), 0), position)
        self._groups, self._pieces = self._dense_index()
        self.tables = self._table_index()  # table -> meta (counters summed, steps the most)
        if self._verify is None:  # every row a chain makes current, counted against what it says
            for _, files in sorted(self._chains.items()):
                for table in files[-1].meta["tables"]:
                    chain.check_rows(files, table)
            if not allow_non_finite:  # what passed every check is not read again by this store
                for link in {saved.link for files in self._chains.values() for saved in files}:
                    store.note_passed(link.name, link.manifest)

    @classmethod
    def latest(
        cls, store: CheckpointStore, allow_non_finite: bool = False, contents: bool = True
    ) -> RestoreSource | None:
        """The newest checkpoint whose every file reads back whole and well-formed (hashed and
        checked a chunk at a time: every PS of a cluster must choose the same one, so each checks
        them all); a damaged one is skipped, and logged with what is wrong.

        `contents=False` (a resuming PS): the newest whose manifest, every file's size, header
        and metadata (with its chunk hashes' record) and what lies across files pass, which every
        PS finds alike from a few KB per file; the contents are checked as they are read, each
        chunk against its SHA-256, so a PS reads what it restores and no more (a file without
        chunk hashes, written by older code, is checked whole while choosing, as before). Damage
        found then is a CheckpointError naming the file, tensor and chunk, raised by the restore
        that read it (which changes nothing)."""
        links: dict[str, Link | CheckpointError] = {}
        for name in reversed(store.complete()):
            try:
                verify = None if contents else ()
                source = cls(
                    store, name, verify=verify, allow_non_finite=allow_non_finite, links=links, by_chunk=not contents
                )
            except CheckpointError as exc:
                log.warning("cannot resume from %s, trying the one before: %s", name, exc)
                continue
            if len(source.links) > 1:
                log.info("checkpoint %s: a chain of %s", name, " + ".join(source.links))
            return source
        return None

    def _link(self, name: str) -> Link:
        """Checkpoint `name` opened and checked (once: see `links`)."""
        found = self._links.get(name)
        if found is None:
            try:
                found = Link(self.store, name, self._verify, self.allow_non_finite, by_chunk=self._by_chunk)
            except CheckpointError as exc:
                found = exc
            self._links[name] = found
        if isinstance(found, CheckpointError):
            raise found
        return found

    def position(self, worker: int | None) -> int:
        """Steps `worker` had trained at this checkpoint; `None`: the checkpoint's step.

        A worker the checkpoint does not name pushed nothing that it holds (every shard file
        names each worker whose pushes it counted): it starts at 0. Taking the checkpoint's step
        instead skipped batches that no PS had: a worker still restarting when a roll-back's
        first checkpoint was written resumed past batches it trained only before the roll-back."""
        return self.positions.get(worker, 0) if worker is not None else self.step

    # ---- reading files ------------------------------------------------------------------------
    def _where(self, index: int) -> str:
        return self._files[index].where

    @contextlib.contextmanager
    def reader(self, index: int) -> Iterator[TensorReader]:
        """A reader of this checkpoint's shard file `index`, checked first if it was not yet."""
        with self._files[index].reader() as reader:
            yield reader

    # ---- dense variables ------------------------------------------------------------------------
    def _dense_index(self) -> tuple[dict[str, dict], dict[tuple[str, str], list[_Piece]]]:
        groups: dict[str, dict] = {}
        pieces: dict[tuple[str, str], list[_Piece]] = {}
        for index, saved in sorted(self._files.items()):
            for group, info in saved.meta["groups"].items():
                if groups.setdefault(group, {"spec": info["spec"]})["spec"] != info["spec"]:
                    raise CheckpointError(f"{saved.where}: group {group!r} has another optimizer there")
                for part, steps in info["steps"].items():
                    var, lo, _ = part_rows(part)
                    spec = saved.tensors[f"dense/{group}/{part}"]
                    rows = spec.shape[0] if spec.shape else 1
                    pieces.setdefault((group, var), []).append(_Piece(index, part, lo or 0, rows, steps))
        for (group, var), var_pieces in pieces.items():
            var_pieces.sort(key=lambda piece: piece.lo)
            self._check_tiling(group, var, var_pieces)
        return groups, pieces

    def _check_tiling(self, group: str, var: str, pieces: list[_Piece]) -> None:
        """The parts of a variable cover it once: rows 0.. in order, no gap, no overlap, one row
        shape and one set of optimizer states (a whole variable is one part)."""
        first = self._files[pieces[0].index].tensors
        prefix = f"dense/{group}/{pieces[0].part}"
        shape, states = first[prefix].shape[1:], _state_names(first, prefix)
        at = 0
        for piece in pieces:
            name = f"dense/{group}/{piece.part}"
            tensors = self._files[piece.index].tensors
            whole = part_rows(piece.part)[1] is None
            if piece.lo != at or (whole and len(pieces) > 1):
                raise CheckpointError(
                    f"checkpoint {self.name}: the parts of variable {var!r} of group {group!r} do not tile it "
                    f"({piece.part!r} in {self._files[piece.index].entry.file} starts at row {piece.lo}, not {at})"
                )
            if tensors[name].shape[1:] != shape or _state_names(tensors, name) != states:
                raise CheckpointError(
                    f"checkpoint {self.name}: part {piece.part!r} of group {group!r} differs in shape or "
                    f"optimizer state from the variable's other parts"
                )
            at += piece.rows

    def dense_part(self, group: str, spec: dict, part: str, shape: tuple[int, ...]) -> DenseVariable:
        """Values, optimizer state and step count of one part under the new placement."""
        saved = self._groups.get(group)
        if saved is None:
            raise CheckpointError(
                f"checkpoint {self.name} has no variable group {group!r} (a checkpoint of "
                f"another model? it holds {sorted(self._groups)})"
            )
        if saved["spec"] != spec:
            raise CheckpointError(
                f"checkpoint {self.name}: group {group!r} was trained with optimizer {saved['spec']}, not {spec}"
            )
        var, lo, hi = part_rows(part)
        pieces = self._pieces.get((group, var))
        if pieces is None:
            raise CheckpointError(f"checkpoint {self.name}: group {group!r} has no variable {var!r}")
        whole = self._shape(group, pieces)
        lo, hi = (0, whole[0] if whole else 1) if lo is None else (lo, min(hi or 0, whole[0]))
        found = (max(hi - lo, 0), *whole[1:]) if whole else ()
        if tuple(found) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.name}: variable {part!r} has shape {tuple(found)} there, not {tuple(shape)}"
            )
        return self._read_rows(group, pieces, lo, hi, whole)

    def _shape(self, group: str, pieces: list[_Piece]) -> tuple[int, ...]:
        first = self._files[pieces[0].index].tensors[f"dense/{group}/{pieces[0].part}"]
        if not first.shape:
            return ()
        return (sum(piece.rows for piece in pieces), *first.shape[1:])

    def _read_rows(self, group: str, pieces: list[_Piece], lo: int, hi: int, whole: tuple) -> DenseVariable:
        values: list[np.ndarray] = []
        state: dict[str, list[np.ndarray]] = {}
        for piece in pieces:
            start, stop = max(lo, piece.lo), min(hi, piece.lo + piece.rows) if whole else 1
            if whole and start >= stop:
                continue
            name = f"dense/{group}/{piece.part}"
            with self.reader(piece.index) as reader:
                values.append(reader.read(name, start - piece.lo, stop - piece.lo) if whole else reader.read(name))
                for key in sorted(k for k in reader.tensors if k.startswith(name + "/")):
                    part = reader.read(key, start - piece.lo, stop - piece.lo) if whole else reader.read(key)
                    state.setdefault(key[len(name) + 1 :], []).append(part)
        steps = max(piece.steps for piece in pieces)
        join = np.concatenate if whole else (lambda arrays: arrays[0])
        return DenseVariable(join(values), {key: join(arrays) for key, arrays in state.items()}, steps)

    def dense_variables(self) -> dict[str, dict[str, Any]]:
        """Every dense variable whole: {group: {"spec": ..., "vars": {var: DenseVariable}}}."""
        out: dict[str, dict[str, Any]] = {
            group: {"spec": info["spec"], "vars": {}} for group, info in self._groups.items()
        }
        for (group, var), pieces in self._pieces.items():
            whole = self._shape(group, pieces)
            out[group]["vars"][var] = self._read_rows(group, pieces, 0, whole[0] if whole else 1, whole)
        return out

    def dense_shapes(self) -> dict[str, tuple[str, tuple[int, ...], int, list[str]]]:
        """Each dense variable's (group, shape, steps, state names), from the headers alone."""
        shapes = {}
        for (group, var), pieces in self._pieces.items():
            states = _state_names(self._files[pieces[0].index].tensors, f"dense/{group}/{pieces[0].part}")
            shapes[var] = (group, self._shape(group, pieces), max(p.steps for p in pieces), states)
        return shapes

    # ---- tables ---------------------------------------------------------------------------------
    def _table_index(self) -> dict[str, dict]:
        tables: dict[str, dict] = {}
        for saved in self._files.values():
            for table, info in saved.meta["tables"].items():
                merged = tables.setdefault(table, {**info, "counters": {}, "steps": 0, "rows": 0})
                if (merged["dim"], merged["spec"]) != (info["dim"], info["spec"]):
                    raise CheckpointError(
                        f"{saved.where}: table {table!r} has another dim or optimizer than in another file"
                    )
                if info.get("shards") not in (None, self.num_shards):
                    raise CheckpointError(
                        f"{saved.where}: table {table!r} was written routed over {info['shards']} shards, "
                        f"the checkpoint has {self.num_shards}"
                    )
                merged["steps"] = max(merged["steps"], info["steps"])
                for key, count in info["counters"].items():
                    merged["counters"][key] = merged["counters"].get(key, 0) + count
                rows = info.get("rows")  # a delta's file holds the changed rows only; its metadata says how many
                merged["rows"] += rows if rows is not None else saved.tensors[f"table/{table}/ids"].shape[0]
        return tables

    def tensor_bytes(self, prefix: str) -> int:
        """Bytes of every tensor whose name starts with `prefix` in this checkpoint's own files
        (a delta's: what it wrote), from the headers."""
        return sum(
            spec.nbytes
            for saved in self._files.values()
            for key, spec in saved.tensors.items()
            if key.startswith(prefix)
        )

    def table_files(self, table: str) -> list[int]:
        """The shard files that hold rows of `table`."""
        return [index for index, saved in sorted(self._files.items()) if table in saved.meta["tables"]]

    def table_slices(
        self, table: str, index: int, names: Iterable[str], shard: int = 0, num_shards: int = 1
    ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(ids, {array name: rows}) of the rows of `table` in shard file `index` (with its chain:
        the rows current at this checkpoint) that belong to `shard` of `num_shards`, a slice at a
        time (every file checked whole first)."""
        yield from chain.current_slices(self._chains[index], table, list(names), shard, num_shards)

    def shard_file(self, index: int) -> SavedFile:
        """This checkpoint's own shard file `index` (its header: `meta`, `tensors`), as checked when
        the source was opened."""
        return self._files[index]

    def chain_from(self, index: int, name: str) -> list[SavedFile] | None:
        """Shard file `index`'s chain from checkpoint `name`'s link on (that link first), or None
        when `name` is not a link of it."""
        files = self._chains[index]
        at = next((k for k, saved in enumerate(files) if saved.link.name == name), None)
        return None if at is None else files[at:]

    def fill_table(self, table: Table, shard: int, num_shards: int) -> bool:
        """Load the saved rows of `table` that belong to `shard` of `num_shards` into it (an empty
        table with `layout`/`load_rows`/`restore_meta`; with `delete_ids` too, a chain is applied
        link by link, else its current rows are loaded); False if the checkpoint has no such table."""
        meta = self.tables.get(table.name)
        if meta is None:
            return False
        if meta["dim"] != table.dim or meta["spec"] != table.spec:
            raise CheckpointError(
                f"checkpoint {self.name}: table {table.name!r} has dim {meta['dim']} and "
                f"optimizer {meta['spec']}, not dim {table.dim} and {table.spec}"
            )
        files = self.table_files(table.name)
        if num_shards == self.num_shards:  # the same placement: this shard's rows are in its own file
            files = [index for index in files if index == shard]
        layout = table.layout()
        for index in files:
            saved = self._files[index].tensors
            names = [n for n in layout if n != "ids" and f"table/{table.name}/{n}" in saved]
            for link in self._chains[index]:
                self._check_layout(link, table.name, names, layout)
            if self._verify is not None:  # not counted when opened: the chain's rows, before any is loaded
                chain.check_rows(self._chains[index], table.name)
            try:
                if hasattr(table, "delete_ids"):
                    chain.apply_chain(self._chains[index], table, names, shard, num_shards)
                else:
                    for ids, arrays in self.table_slices(table.name, index, names, shard, num_shards):
                        table.load_rows(ids, arrays)
            except InvalidArgumentError as exc:
                raise CheckpointError(f"{self._where(index)}: {exc}") from None
        table.restore_meta(meta["counters"], meta["steps"])
        return True

    @staticmethod
    def _check_layout(saved: SavedFile, table: str, names: list[str], layout: dict) -> None:
        if table not in saved.meta["tables"]:
            return
        if "values" not in names:
            raise CheckpointError(f"{saved.where}: table {table!r} has no values")
        encoding = saved.meta["tables"][table].get("encoding", "float32")
        for name in names:
            spec = saved.tensors.get(f"table/{table}/{name}")
            dtype, row_shape = layout[name]
            if name == "values":  # stored in its encoding (checked with the file), read as float32
                dtype = quantize.stored_dtype(encoding)
            if spec is None or spec.dtype != dtype or tuple(spec.shape[1:]) != tuple(row_shape):
                found = f"{spec.dtype} rows of {spec.shape[1:]}" if spec is not None else "missing"
                raise CheckpointError(
                    f"{saved.where}: table {table!r} {name} is {found}, not {np.dtype(dtype)} rows of {row_shape}"
                )


def _state_names(tensors: dict[str, TensorSpec], part: str) -> list[str]:
    return sorted(key[len(part) + 1 :] for key in tensors if key.startswith(part + "/"))
