"""`paramserver checkpoint list|inspect|export DIR [NAME]`: look into checkpoints with no cluster.

export writes one file that torch alone loads: ``torch.load(path)`` gives ``{"state_dict":
{parameter name: tensor}, "embeddings": {table: {"ids": int64 tensor, "weight": float tensor}},
"step": n, "checkpoint": name}``. Parameter names are the model's (``model.load_state_dict(
saved["state_dict"], strict=False)`` takes them; embedding placeholders hold no values).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from .restore import RestoreSource
from .store import CheckpointError, CheckpointStore


def list_checkpoints(url: str) -> list[dict]:
    store = CheckpointStore(url)
    rows = []
    for name in store.complete():
        try:
            manifest = store.manifest(name)
            rows.append({"name": name, "step": manifest.get("step"), "shards": manifest.get("num_shards"),
                         "bytes": sum(int(e["bytes"]) for e in manifest.get("shards", [])),
                         "time": manifest.get("time")})
        except CheckpointError as exc:
            rows.append({"name": name, "error": str(exc)})
    return rows


def _source(url: str, name: str | None) -> RestoreSource:
    store = CheckpointStore(url)
    if name is None:
        complete = store.complete()
        if not complete:
            raise CheckpointError(f"no complete checkpoint in {url}")
        name = complete[-1]
    return RestoreSource(store, name)


def inspect(url: str, name: str | None = None) -> dict:
    """Variables (shape, optimizer state, steps) and tables (rows, dim, optimizer) of one checkpoint."""
    source = _source(url, name)
    variables = {var: {"group": group, "shape": list(v.value.shape), "steps": v.steps, "state": sorted(v.state),
                       "bytes": int(v.value.nbytes + sum(a.nbytes for a in v.state.values()))}
                 for group, info in source.groups.items() for var, v in info["vars"].items()}
    tables = {table: {"rows": int(saved.ids.shape[0]), "dim": saved.meta["dim"], "optimizer": saved.meta["spec"],
                      "counters": saved.meta["counters"],
                      "bytes": int(saved.ids.nbytes + sum(a.nbytes for a in saved.arrays.values()))}
              for table, saved in source.tables.items()}
    return {"name": source.name, "step": source.step, "shards": source.manifest.get("num_shards"),
            "mode": source.manifest.get("mode"), "variables": variables, "tables": tables}


def export(url: str, name: str | None, out: str | None) -> str:
    """Write the checkpoint's dense values and embedding tables as a torch file; returns its path."""
    import torch

    source = _source(url, name)
    state_dict = {var.split(".", 1)[1] if "." in var else var: torch.from_numpy(np.array(v.value))
                  for info in source.groups.values() for var, v in info["vars"].items()}
    embeddings = {table: {"ids": torch.from_numpy(np.array(saved.ids)),
                          "weight": torch.from_numpy(np.array(saved.arrays["values"]))}
                  for table, saved in source.tables.items()}
    path = out or f"{source.name}.pt"
    torch.save({"state_dict": state_dict, "embeddings": embeddings, "step": source.step,
                "checkpoint": source.name}, path)
    return path


def run_tool(action: str, url: str, name: str | None, out: str | None) -> int:
    if action == "list":
        for row in list_checkpoints(url):
            print(json.dumps(row))
    elif action == "inspect":
        print(json.dumps(inspect(url, name), indent=1))
    else:
        print(export(url, name, out))
    sys.stdout.flush()
    return 0
