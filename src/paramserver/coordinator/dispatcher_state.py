"""The dispatcher's checkpoint record, checked as untrusted input (it is read from disk).

A record (`Dispatcher.state()`, JSON-able) is a dict with exactly these keys:
- "version": 1;
- "num_splits", "epochs": the data's description (1 .. MAX_SPLITS, 1 .. MAX_EPOCHS);
- "next_epoch", "next_split": the next new split to hand out ((epochs, 0) once all are handed out);
- "in_flight": [{"worker", "epoch", "split", "position"}], splits workers held (one per worker);
- "taken_back": [{"epoch", "split", "position"}], splits taken back from workers that left;
- "batches_done": the sum of completed splits' batch counts.
A split in flight or taken back must have been handed out (before the next new one), and appear
once. `parse_state` refuses anything else with an InvalidArgumentError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paramserver.base.errors import InvalidArgumentError

MAX_SPLITS = 1 << 20
MAX_EPOCHS = 1 << 20
MAX_WORKER = (1 << 31) - 1
POSITION_LIMIT = (1 << 63) - 1  # positions and batch counts are int64 on the wire
STATE_VERSION = 1
_KEYS = ("version", "num_splits", "epochs", "next_epoch", "next_split", "in_flight", "taken_back", "batches_done")
_IN_FLIGHT_KEYS = ("worker", "epoch", "split", "position")
_TAKEN_BACK_KEYS = ("epoch", "split", "position")


@dataclass(frozen=True)
class ParsedState:
    num_splits: int
    epochs: int
    next_epoch: int
    next_split: int
    taken_back: dict[tuple[int, int], int]  # (epoch, split) -> position: the record's in flight and taken back
    batches_done: int


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """Refuses `value` unless it is an int (not a bool) in [low, high], naming it `name`."""
    if type(value) is not int or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be an integer between {low} and {high}, got {_shown(value)}")


def parse_state(data: Any) -> ParsedState:
    """The record `data`, checked (module docstring); splits in flight become taken back."""
    _check_keys("dispatcher state", data, _KEYS)
    check_int("dispatcher state: version", data["version"], STATE_VERSION, STATE_VERSION)
    num_splits, epochs = data["num_splits"], data["epochs"]
    check_int("dispatcher state: num_splits", num_splits, 1, MAX_SPLITS)
    check_int("dispatcher state: epochs", epochs, 1, MAX_EPOCHS)
    check_int("dispatcher state: next_epoch", data["next_epoch"], 0, epochs)
    last_split = 0 if data["next_epoch"] == epochs else num_splits - 1  # all handed out: (epochs, 0)
    check_int("dispatcher state: next_split", data["next_split"], 0, last_split)
    handed_out = data["next_epoch"] * num_splits + data["next_split"]
    check_int("dispatcher state: batches_done", data["batches_done"], 0, POSITION_LIMIT)
    splits: dict[tuple[int, int], int] = {}
    workers: set[int] = set()
    for field, keys in (("in_flight", _IN_FLIGHT_KEYS), ("taken_back", _TAKEN_BACK_KEYS)):
        entries = data[field]
        if not isinstance(entries, list):
            raise InvalidArgumentError(f"dispatcher state: {field} must be a list, got {type(entries).__name__}")
        if len(entries) + len(splits) > handed_out:  # before looking at each: a huge list costs nothing
            raise InvalidArgumentError(
                f"dispatcher state: {len(entries) + len(splits)} splits in flight or taken back, "
                f"but only {handed_out} were handed out"
            )
        for index, entry in enumerate(entries):
            name = f"dispatcher state: {field}[{index}]"
            key, position = _entry(name, entry, keys, num_splits, epochs, handed_out)
            if key in splits:
                raise InvalidArgumentError(f"{name}: split {key[1]} of epoch {key[0]} appears twice")
            splits[key] = position
            if "worker" in keys:
                if entry["worker"] in workers:
                    raise InvalidArgumentError(f"{name}: worker {entry['worker']} holds two splits")
                workers.add(entry["worker"])
    return ParsedState(num_splits, epochs, data["next_epoch"], data["next_split"], splits, data["batches_done"])


def _entry(
    name: str, entry: Any, keys: tuple[str, ...], num_splits: int, epochs: int, handed_out: int
) -> tuple[tuple[int, int], int]:
    _check_keys(name, entry, keys)
    if "worker" in keys:
        check_int(f"{name}.worker", entry["worker"], 0, MAX_WORKER)
    check_int(f"{name}.epoch", entry["epoch"], 0, epochs - 1)
    check_int(f"{name}.split", entry["split"], 0, num_splits - 1)
    check_int(f"{name}.position", entry["position"], 0, POSITION_LIMIT)
    if entry["epoch"] * num_splits + entry["split"] >= handed_out:
        raise InvalidArgumentError(
            f"{name}: split {entry['split']} of epoch {entry['epoch']} was never handed out "
            "(it is not before next_epoch/next_split)"
        )
    return (entry["epoch"], entry["split"]), entry["position"]


def _check_keys(name: str, data: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{name} must be a JSON object, got {type(data).__name__}")
    missing = [key for key in keys if key not in data]
    unknown = sorted(str(key) for key in data if key not in keys)
    if missing or unknown:
        raise InvalidArgumentError(f"{name}: missing keys {missing}, unknown keys {unknown[:5]}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
