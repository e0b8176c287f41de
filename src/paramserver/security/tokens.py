"""Tokens for a cluster's nodes: one secret token file per node and the store servers check them
against (security/auth.py, docs/security.md).

Node names are those of the cluster spec's tasks: ps-<i>, chief-0, worker-<i>, and admin (or
admin-<name>) for an operator. A chief-0 is worker 0 (its workers then count from 1); without
one, worker-0 is the chief.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import replace
from pathlib import Path

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError
from paramserver.security.auth import STORE_FORMAT, STORE_VERSION, token_hash

STORE_FILE = "tokens.json"
_NAME = re.compile(r"(ps|chief|worker)-(\d+)|admin(-[A-Za-z0-9_.-]+)?")


def write_tokens(directory: Path, nodes: list[str]) -> None:
    """Write DIR/<node>.token (0600, a fresh random token each) for every node, and DIR/tokens.json,
    the store of their hashes, names, roles and worker indexes. Every name is checked first: a bad
    one writes nothing. Files already there are replaced."""
    entries = _entries(nodes)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = []
    for name, role, worker in entries:
        token = secrets.token_urlsafe(32)
        _write_private(directory / f"{name}.token", token + "\n")
        store.append({"name": name, "role": role, "worker": worker, "sha256": token_hash(token)})
    text = json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION, "tokens": store}, indent=1)
    _write_private(directory / STORE_FILE, text + "\n")


def local_nodes(num_ps: int, num_workers: int) -> list[str]:
    """The node names of a `paramserver run` cluster (worker-0 is its chief), and admin."""
    return [f"ps-{i}" for i in range(num_ps)] + [f"worker-{i}" for i in range(num_workers)] + ["admin"]


def with_node_token(options: Options, directory: str | Path | None, node: str) -> Options:
    """`options` of `node` in a cluster run with the tokens in `directory` (None: as they are): its
    own token file, and the store (a PS and the coordinator's host check calls against it)."""
    if not directory:
        return options
    return replace(
        options, token_file=str(Path(directory) / f"{node}.token"), auth_tokens=str(Path(directory) / STORE_FILE)
    )


def _entries(nodes: list[str]) -> list[tuple[str, str, int | None]]:
    """(name, role, worker index) per node, after checking every name."""
    if not nodes:
        raise ConfigError("tokens need at least one node name")
    bad = [node for node in nodes if not _NAME.fullmatch(node)]
    if bad:
        raise ConfigError(f"node names must be ps-<i>, chief-0, worker-<i> or admin[-<name>], got {bad}")
    twice = sorted({node for node in nodes if nodes.count(node) > 1})
    if twice:
        raise ConfigError(f"node names given more than once: {twice}")
    chiefs = [node for node in nodes if node.startswith("chief-")]
    if chiefs not in ([], ["chief-0"]):
        raise ConfigError(f"a cluster has at most one chief, chief-0; got {chiefs}")
    first_worker = 1 if chiefs else 0  # a chief is worker 0
    entries: list[tuple[str, str, int | None]] = []
    for node in nodes:
        kind, _, index = node.partition("-")
        if kind == "ps":
            entries.append((node, "ps", None))
        elif kind == "chief":
            entries.append((node, "chief", 0))
        elif kind == "worker":
            worker = first_worker + int(index)
            entries.append((node, "chief" if worker == 0 else "worker", worker))
        else:
            entries.append((node, "admin", None))
    return entries


def _write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only (also when it existed with wider permissions)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
