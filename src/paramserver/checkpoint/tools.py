"""`paramserver checkpoint list|inspect|export DIR [NAME]`: look into checkpoints with no cluster.

export writes one file that torch alone loads: ``torch.load(path)`` gives ``{"state_dict":
{parameter name: tensor}, "embeddings": {table: {"ids": int64 tensor, "weight": float tensor}},
"step": n, "checkpoint": name}``. Parameter names are the model's when the optimizer was given
``model.named_parameters()``; ``model.load_state_dict({**model.state_dict(), **saved["state_dict"]})``
loads them, failing on any name or shape the model does not have (embedding placeholders and
buffers keep their values). An optimizer given ``model.parameters()`` saw no names: its variables
are ``param0``, ``param1``, ... in the order it got them, and export says so and how to map them.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import numpy as np

from .restore import RestoreSource
from .store import CheckpointError, CheckpointStore

_POSITIONAL = re.compile(r"^(?:opt\d+\.)?param\d+$")


def list_checkpoints(url: str) -> list[dict]:
    """One row per complete checkpoint (oldest first), each file checked against the manifest:
    ``"status": "ok"``, or ``"damaged: <what is wrong>"`` (a damaged one is never resumed from).
    A directory that does not exist is a CheckpointError naming it."""
    store = CheckpointStore(url)
    store.require()
    rows = []
    for name in store.complete():
        row: dict = {"name": name}
        try:
            manifest = store.manifest(name)
            row.update(
                {
                    "step": manifest.get("step"),
                    "shards": manifest.get("num_shards"),
                    "bytes": sum(int(e["bytes"]) for e in manifest["shards"]),
                    "time": manifest.get("time"),
                }
            )
        except (CheckpointError, KeyError, TypeError, ValueError):
            pass  # verify() says what is wrong with the manifest
        try:
            store.verify(name)
            row["status"] = "ok"
        except CheckpointError as exc:
            row["status"] = "damaged: " + str(exc).removeprefix(f"checkpoint {name}: ")
        rows.append(row)
    return rows


def _source(url: str, name: str | None) -> RestoreSource:
    store = CheckpointStore(url)
    store.require()
    if name is None:
        complete = store.complete()
        if not complete:
            raise CheckpointError(f"no complete checkpoint in {url}")
        name = complete[-1]
    return RestoreSource(store, name)


def inspect(url: str, name: str | None = None) -> dict:
    """Variables (shape, optimizer state, steps) and tables (rows, dim, optimizer) of one checkpoint."""
    source = _source(url, name)
    variables = {
        var: {
            "group": group,
            "shape": list(v.value.shape),
            "steps": v.steps,
            "state": sorted(v.state),
            "bytes": int(v.value.nbytes + sum(a.nbytes for a in v.state.values())),
        }
        for group, info in source.groups.items()
        for var, v in info["vars"].items()
    }
    tables = {
        table: {
            "rows": int(saved.ids.shape[0]),
            "dim": saved.meta["dim"],
            "optimizer": saved.meta["spec"],
            "counters": saved.meta["counters"],
            "bytes": int(saved.ids.nbytes + sum(a.nbytes for a in saved.arrays.values())),
        }
        for table, saved in source.tables.items()
    }
    return {
        "name": source.name,
        "step": source.step,
        "shards": source.manifest.get("num_shards"),
        "mode": source.manifest.get("mode"),
        "variables": variables,
        "tables": tables,
    }


def _natural(name: str) -> list:
    """Sort key that puts param2 before param10 (and opt2 before opt10)."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


def export_names(variables: list[str]) -> dict[str, str]:
    """Each PS variable's name in the exported state dict, in export order: the parameter's name
    without its optimizer's prefix ("opt0.fc.weight" -> "fc.weight"); an optimizer one of whose
    names another optimizer holds too keeps its prefix on all of them. Sorted naturally:
    positional names in the optimizer's order."""
    split = {var: var.split(".", 1) if "." in var else ["", var] for var in variables}
    taken = Counter(short for _, short in split.values())
    clashing = {prefix for prefix, short in split.values() if taken[short] > 1}
    return {var: var if split[var][0] in clashing else split[var][1] for var in sorted(variables, key=_natural)}


def positional_note(names: list[str], path: str) -> str | None:
    """What to tell the user when some exported names are positional (None when there are none)."""
    positional = [name for name in names if _POSITIONAL.match(name)]
    if not positional:
        return None
    shown = ", ".join(positional[:3]) + (f", ... {positional[-1]}" if len(positional) > 3 else "")
    count = f"all {len(names)}" if len(positional) == len(names) else f"{len(positional)} of the {len(names)}"
    lines = [
        f"note: {count} parameter names in {path} are positional ({shown}):",
        "an optimizer was given model.parameters(), which carry no names.",
    ]
    if any("." in name for name in positional):  # two optimizers' names clash: each keeps its prefix
        lines.append(
            "In optK.paramN, optK is the optimizer the script created (K+1)-th and paramN the N-th "
            "parameter it was given."
        )
    else:
        lines += [
            "paramN is the N-th parameter the optimizer was given; to load them into the same model:",
            f"    saved = torch.load({path!r})",
            "    names = [name for name, _ in model.named_parameters()]",
            "    state = {names[int(key.removeprefix('param'))]: value for key, value in saved['state_dict'].items()}",
            "    model.load_state_dict({**model.state_dict(), **state})",
        ]
    return "\n".join(
        [
            *lines,
            "To keep the model's names in checkpoints, give the optimizer the named parameters:",
            "    ps.optim.Adam(model.named_parameters(), ...)",
        ]
    )


def export(url: str, name: str | None, out: str | None, note=None) -> str:
    """Write the checkpoint's dense values and embedding tables as a torch file; returns its path.
    `note(text)` is told when the parameter names are positional (see `positional_note`)."""
    import torch

    source = _source(url, name)
    values = {var: v.value for info in source.groups.values() for var, v in info["vars"].items()}
    names = export_names(list(values))
    state_dict = {exported: torch.from_numpy(np.array(values[var])) for var, exported in names.items()}
    embeddings = {
        table: {
            "ids": torch.from_numpy(np.array(saved.ids)),
            "weight": torch.from_numpy(np.array(saved.arrays["values"])),
        }
        for table, saved in source.tables.items()
    }
    path = out or f"{source.name}.pt"
    torch.save(
        {"state_dict": state_dict, "embeddings": embeddings, "step": source.step, "checkpoint": source.name}, path
    )
    text = positional_note(list(state_dict), path)
    if text is not None and note is not None:
        note(text)
    return path


def run_tool(action: str, url: str, name: str | None, out: str | None) -> int:
    if action == "list":
        for row in list_checkpoints(url):
            print(json.dumps(row))
    elif action == "inspect":
        print(json.dumps(inspect(url, name), indent=1))
    else:  # the path alone on stdout (for scripts); notes on stderr
        print(export(url, name, out, note=lambda text: print(text, file=sys.stderr)))
    sys.stdout.flush()
    return 0
