"""Seeded fault injection over every kind of checkpoint file: manifests, shard metadata, table values,
ids, a delta's deleted ids and its chain, an int8 file's scales. Each case flips a byte, truncates a
file or rewrites a count (an integer of a JSON header or manifest) at a random place, and half of the
shard-file cases also rewrite the manifest entry to match the new bytes (so the structural checks,
not the SHA-256, must find what is wrong). Then `checkpoint list`, resume (`RestoreSource.latest`
and a restore onto two shards), export and serving must agree: a checkpoint is refused by every one
of them with a named error (a CheckpointError), or restores exactly what the files hold (read by
safetensors' own reader, the chain applied here by hand); never another exception, never another
value; a resuming PS, which chooses by the headers and checks each chunk as it reads it
(`latest(contents=False)`), restores the same, or refuses the newer checkpoint it chose with a named
error; and retention (`prune`) never deletes the newest checkpoint that passes. Every assertion
prints the seed and the case: PS_FAULT_SEED=<seed> replays one. The fast tier runs the first
FAST_CASES cases; the fault tier (tests/fault/test_checkpoint_fault_sweep.py) all CASES."""

import hashlib
import json
import os
import random
import re
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

import paramserver as ps
from paramserver.base.errors import ParamServerError
from paramserver.base.hashing import shard_of
from paramserver.checkpoint import tools
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.checkpoint.verdict import verdict
from paramserver.server.shard import Push, Shard
from paramserver.tables.table_store import TableStore

SEED = int(os.environ.get("PS_FAULT_SEED", "20261205"))
# The fast tier's cases: the first 100 of the seed's draws, in which each kind of file and fault
# is drawn 5 times or more (as the sweep asserts); tests/fault/test_checkpoint_fault_sweep.py runs
# the first CASES of them in the fault tier.
FAST_CASES = 100
CASES = 200
SGD = {"name": "sgd", "hyper": {"lr": 0.1}}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
POLICY = {"ttl_steps": 3, "evict_every": 2}  # evictions between checkpoints 1 and 2: the delta deletes ids
SHAPES = {"opt0.fc.weight": (2, 3), "opt0.fc.bias": (2,)}
NAMES = [checkpoint_name(step) for step in (1, 2, 3)]  # a base, a delta on it, a whole int8 checkpoint


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.emb = ps.nn.HashEmbedding(4, name="emb")


def build(root: str) -> None:
    """Two shards (fc.weight on one, fc.bias on the other, table emb on both) trained a little, with
    checkpoint 1 whole, 2 a delta on 1 (rows evicted in between), 3 whole in int8."""
    rng = np.random.default_rng(0)
    shards = []
    for index in range(2):
        tables = TableStore(index)
        tables.register("emb", 4, ADAGRAD, INIT, policy=POLICY, num_shards=2)
        shard = Shard(index, tables=tables)
        var = list(SHAPES)[index]
        shard.register("g", SGD, {var: rng.normal(size=SHAPES[var]).astype(np.float32)})
        shards.append(shard)

    def train(steps, universe):
        for _ in range(steps):
            ids = rng.choice(universe, 24, replace=False).astype(np.int64)
            for index, shard in enumerate(shards):
                mine = ids[shard_of(ids, 2) == index]
                shard.tables.lookup("emb", mine)
                grads = rng.normal(size=(mine.shape[0], 4)).astype(np.float32)
                shard.tables.push_checked([shard.tables.check_push("emb", mine, grads)])
                var = list(SHAPES)[index]
                shard.push(Push({var: rng.normal(size=SHAPES[var]).astype(np.float32)}))

    writes = [ShardWrites(root) for _ in shards]
    quantized = [ShardWrites(root, "int8") for _ in shards]
    store = writes[0].store
    for step, name, universe, parent, how in [
        (1, NAMES[0], 80, "", writes),
        (2, NAMES[1], 40, NAMES[0], writes),
        (3, NAMES[2], 80, "", quantized),
    ]:
        train(4, universe)
        entries = [w(name, shard, parent=parent) for w, shard in zip(how, shards)]
        store.commit(name, {"step": step, "num_shards": 2, "shards": entries})


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("template") / "ckpt")
    build(root)
    store = CheckpointStore(root)
    assert [verdict(store, name) for name in NAMES] == [None, None, None]
    with safe_open(os.path.join(root, NAMES[1], "shard-0.safetensors"), "np") as handle:
        assert handle.get_tensor("table/emb/deleted").shape[0] > 0  # the delta deletes ids
    return root


# ---- what the files hold, read without paramserver's readers -------------------------------------
def expected(root: str, name: str) -> tuple[dict[str, np.ndarray], dict[int, bytes]]:
    """(dense values by exported name, {id: row bytes}) of checkpoint `name`: each shard file's chain
    applied by hand (a delta's deleted ids removed, its rows written), int8 rows decoded."""
    manifest = _manifest(root, name)
    dense, rows = {}, {}
    for entry in manifest["shards"]:
        links, at = [], name
        while True:
            found = next(e for e in _manifest(root, at)["shards"] if e["index"] == entry["index"])
            links.append(at)
            if not found.get("parent"):
                break
            at = found["parent"]
        held: dict[int, bytes] = {}
        for k, link in enumerate(reversed(links)):
            path = os.path.join(root, link, entry["file"])
            arrays = load_file(path)
            with safe_open(path, "np") as handle:
                meta = json.loads(handle.metadata()["paramserver"])
            table = meta["tables"]["emb"]
            values = arrays["table/emb/values"]
            if table.get("encoding", "float32") == "int8":
                values = values.astype(np.float32) * arrays["table/emb/values.scale"].astype(np.float32)[:, None]
            if k > 0:
                for gone in arrays["table/emb/deleted"].tolist():
                    held.pop(gone, None)
            for row_id, row in zip(arrays["table/emb/ids"].tolist(), values):
                held[row_id] = row.astype(np.float32).tobytes()
            if link == name:
                for key, value in arrays.items():
                    if key.startswith("dense/g/") and key.count("/") == 2:
                        dense[key[len("dense/g/opt0.") :]] = value
        rows.update(held)
    return dense, rows


def _manifest(root: str, name: str) -> dict:
    with open(os.path.join(root, name, "MANIFEST.json")) as handle:
        return json.load(handle)


# ---- what each reader gives -------------------------------------------------------------------
def resumed(root: str, contents: bool = True) -> tuple[str | None, dict, dict]:
    """(the checkpoint resume chooses, its dense values, {id: row bytes} restored onto two shards).
    `contents=False`: as a resuming PS chooses (headers), checking each chunk as it is read."""
    source = RestoreSource.latest(CheckpointStore(root), contents=contents)
    if source is None:
        return None, {}, {}
    dense = {var[len("opt0.") :]: source.dense_part("g", SGD, var, shape).value for var, shape in SHAPES.items()}
    rows = {}
    for index in range(2):
        tables = TableStore(index, restore=source)
        tables.register("emb", 4, ADAGRAD, INIT, policy=POLICY, num_shards=2)
        table = tables.table("emb")
        ids, values = table.array("ids")[: table.size], table.array("values")[: table.size]
        rows.update({int(i): v.tobytes() for i, v in zip(ids, values)})
    return source.name, dense, rows


def exported(root: str, name: str, out: str) -> tuple[dict, dict]:
    path = tools.export(root, name, out)
    with safe_open(path, "np") as handle:
        dense = {key: handle.get_tensor(key) for key in ("fc.weight", "fc.bias")}
        ids, weight = handle.get_tensor("embeddings/emb/ids"), handle.get_tensor("embeddings/emb/weight")
    return dense, {int(i): w.tobytes() for i, w in zip(ids, weight)}


def served(root: str, name: str, ids: list[int]) -> tuple[dict, dict]:
    model = Model()
    ps.serving.load(model, root, checkpoint=name)
    with torch.no_grad():
        rows = model.emb(torch.tensor(ids, dtype=torch.int64)).numpy() if ids else np.zeros((0, 4), np.float32)
    dense = {"fc.weight": model.fc.weight.detach().numpy(), "fc.bias": model.fc.bias.detach().numpy()}
    return dense, {i: row.tobytes() for i, row in zip(ids, rows)}


# ---- faults -----------------------------------------------------------------------------------
def _header(data: bytes) -> tuple[int, dict]:
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8 : 8 + length])


def _region(data: bytes, kind: str) -> tuple[int, int]:
    """The byte range of a shard file that a fault of `kind` lands in."""
    length, header = _header(data)
    tensor = {
        "values": "table/emb/values",
        "ids": "table/emb/ids",
        "deleted": "table/emb/deleted",
        "scales": "table/emb/values.scale",
    }.get(kind)
    if (
        tensor is not None
        and tensor in header
        and header[tensor]["data_offsets"][1] > header[tensor]["data_offsets"][0]
    ):
        lo, hi = header[tensor]["data_offsets"]
        return 8 + length + lo, 8 + length + hi
    return (8, 8 + length) if kind == "metadata" else (0, len(data))


def _rewrite_count(text: str, rng: random.Random) -> str:
    """`text` (JSON) with one of its integers replaced by another count."""
    numbers = list(re.finditer(r"(?<![\w.\"-])\d+(?![\w.\"])", text))
    if not numbers:
        return text + " "
    match = rng.choice(numbers)
    value = int(match.group())
    other = rng.choice([0, 1, value - 1, value + 1, value * 2 + 1, 2**40, 10**18, value + 8])
    return text[: match.start()] + str(max(other, 0)) + text[match.end() :]


def inject(root: str, rng: random.Random) -> str:
    """One fault somewhere in `root`; returns what it did (printed with the seed)."""
    name = rng.choice(NAMES)
    kinds = ["manifest", "metadata", "values", "ids", "anywhere"]
    kinds += ["deleted", "deleted"] if name == NAMES[1] else []
    kinds += ["scales", "scales"] if name == NAMES[2] else []
    kind, how = rng.choice(kinds), rng.choice(["flip", "truncate", "count"])
    path = os.path.join(root, name, "MANIFEST.json" if kind == "manifest" else f"shard-{rng.randrange(2)}.safetensors")
    with open(path, "rb") as handle:
        data = handle.read()
    if how == "truncate":
        at = rng.randrange(len(data))
        new = data[:at]
        what = f"{path} truncated at {at} of {len(data)}"
    elif how == "count" and kind == "manifest":
        new = _rewrite_count(data.decode(), rng).encode()
        what = f"{path}: a count rewritten"
    elif how == "count":
        length, _ = _header(data)
        text = _rewrite_count(data[8 : 8 + length].decode(), rng).encode()
        new = len(text).to_bytes(8, "little") + text + data[8 + length :]
        what = f"{path}: a count of its header rewritten"
    else:
        lo, hi = (0, len(data)) if kind == "manifest" else _region(data, kind)
        at = rng.randrange(lo, hi)
        new = data[:at] + bytes([data[at] ^ rng.randrange(1, 256)]) + data[at + 1 :]
        what = f"{path}: byte {at} flipped"
    with open(path, "wb") as handle:
        handle.write(new)
    what = f"({kind}) {what}"
    if kind != "manifest" and rng.random() < 0.5:  # the manifest made to agree: the structure must refuse it
        manifest = _manifest(root, name)
        index = int(os.path.basename(path)[len("shard-") : -len(".safetensors")])
        entry = next(e for e in manifest["shards"] if e["index"] == index)
        entry.update(bytes=len(new), sha256=hashlib.sha256(new).hexdigest())
        with open(os.path.join(root, name, "MANIFEST.json"), "w") as handle:
            json.dump(manifest, handle)
        what += ", manifest entry rewritten to match"
    return what


def _refused(read, where: str) -> str:
    """What `read()` raised: a CheckpointError (or another of the project's typed errors) is a refusal;
    any other exception fails the test (a traceback); no exception: ''."""
    try:
        read()
    except (CheckpointError, ParamServerError) as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a traceback: never
        raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
    return ""


def check_case(template: str, root: str, case: int, rng: random.Random) -> tuple[str, bool]:
    """One fault, every reader; (what it did, whether the faulted checkpoint was refused)."""
    shutil.copytree(template, root)
    what = inject(root, rng)
    where = f"seed {SEED} case {case}: {what}"
    listed = {row["name"]: row["status"] for row in tools.list_checkpoints(root)}
    assert set(listed) <= set(NAMES), (where, listed)
    ok = [name for name in NAMES if listed.get(name) == "ok"]
    chosen, dense, rows = resumed(root)
    assert chosen == (ok[-1] if ok else None), (where, chosen, listed)
    if chosen is not None:
        want_dense, want_rows = expected(root, chosen)
        assert rows == want_rows, (where, "resume restored other rows")
        assert all(dense[k].tobytes() == want_dense[k].tobytes() for k in want_dense), (where, "resume: dense")
    # a resuming PS (chunk by chunk): the same checkpoint restored exactly, or a newer one it chose by
    # its headers that the files' chunks then refuse as they are read
    try:
        got, got_dense, got_rows = resumed(root, contents=False)
    except CheckpointError as exc:
        refused = re.search(r"checkpoint (ckpt-\d+): ", str(exc))
        assert refused and refused.group(1) not in ok and refused.group(1) > (chosen or ""), (where, exc)
    else:
        assert (got, got_rows) == (chosen, rows), (where, "a resuming PS restored another checkpoint or rows")
        assert all(got_dense[k].tobytes() == dense[k].tobytes() for k in dense), (where, "a resuming PS: dense")
    for name in NAMES:
        if name not in listed:
            continue
        out = os.path.join(root, f"{name}.export")
        if name not in ok:
            refusals = (
                _refused(partial(tools.export, root, name, out), where),
                _refused(partial(served, root, name, []), where),
            )
            assert all(refusals), (where, name, "export or serving did not refuse", refusals)
            continue
        if name != chosen and name not in what:
            continue  # untouched and not chosen: as the template's
        want_dense, want_rows = expected(root, name)
        got_dense, got_rows = exported(root, name, out)
        assert got_rows == want_rows, (where, name, "export wrote other rows")
        assert all(got_dense[k].tobytes() == want_dense[k].tobytes() for k in want_dense), (where, "export: dense")
        got_dense, got_rows = served(root, name, sorted(want_rows))
        assert got_rows == want_rows, (where, name, "serving serves other rows")
        assert all(got_dense[k].tobytes() == want_dense[k].tobytes() for k in want_dense), (where, "serving: dense")
    store = CheckpointStore(root)
    store.prune(1)
    if ok:
        assert verdict(CheckpointStore(root), ok[-1]) is None, (where, "prune deleted the newest good checkpoint")
    return what, any(name in what and name not in ok for name in NAMES)


def sweep(template: str, directory, cases: int) -> None:
    """`cases` seeded cases, each on a fresh copy of `template` under `directory`; every kind of file
    and fault is drawn at least 5 times, and between a third and all but one of them are refused."""
    rng = random.Random(SEED)
    done = []
    for case in range(cases):
        done.append(check_case(template, str(directory / f"case-{case}"), case, rng))
        shutil.rmtree(directory / f"case-{case}")
    for kind in (
        "(manifest)",
        "(metadata)",
        "(values)",
        "(ids)",
        "(deleted)",
        "(scales)",
        "truncated",
        "count",
        "manifest entry rewritten",
    ):  # every kind of file and fault was drawn
        assert sum(kind in what for what, _ in done) >= 5, (f"seed {SEED}", kind)
    refused = sum(refused for _, refused in done)
    assert cases // 3 <= refused < cases, (f"seed {SEED}", refused)


def test_faults_in_every_kind_of_checkpoint_file_are_refused_by_every_reader_or_restore_exactly(template, tmp_path):
    sweep(template, tmp_path, FAST_CASES)
