"""A run's secret: how a node proves that it belongs to the `paramserver run` that started it.

The launcher makes one secret per run and hands it to each node as a file (Options.run_secret_file,
read once when the node starts). `paramserver status` and `shutdown`, before they send a token (or a
Shutdown) to a node of a local run, send it a random nonce over the `Prove` RPC, which needs no
token; the node answers HMAC-SHA256(secret, node name + nonce). Only a node holding the secret can
answer, and naming the node ("ps-1", "coordinator") in the MAC keeps one node's answer from passing
for another's (a listener on a dead node's port relaying the nonce to a live node of the run).
docs/security.md, "Run files".
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from pathlib import Path

from paramserver.base.errors import ConfigError

SECRET_BYTES = 32
NONCE_BYTES = 32
_HEX = re.compile(r"[0-9a-f]+")
_CONTEXT = b"paramserver run proof v1\0"
COORDINATOR_NODE = "coordinator"  # the name the coordinator proves itself under


def ps_node(index: int) -> str:
    """The name PS `index` proves itself under."""
    return f"ps-{index}"


def new_secret() -> str:
    """A fresh run secret, as the hex text its file holds."""
    return secrets.token_hex(SECRET_BYTES)


def new_nonce() -> str:
    """A fresh challenge."""
    return secrets.token_hex(NONCE_BYTES)


class RunSecret:
    """The secret of one run; answers and checks challenges. Never printed."""

    def __init__(self, text: str) -> None:
        if len(text) != 2 * SECRET_BYTES or not _HEX.fullmatch(text):
            raise ConfigError(f"a run secret is {2 * SECRET_BYTES} lower-case hex digits")
        self._key = bytes.fromhex(text)

    @classmethod
    def read(cls, path: str | Path) -> RunSecret:
        """The secret in file `path` (ConfigError naming the file when it cannot be read or is not one)."""
        try:
            text = Path(path).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the run secret file {path}: {exc}") from None
        try:
            return cls(text)
        except ConfigError as exc:
            raise ConfigError(f"run secret file {path}: {exc}") from None

    @classmethod
    def from_options(cls, options) -> RunSecret | None:
        """The node's run secret (Options.run_secret_file, read now, once), or None without one."""
        return cls.read(options.run_secret_file) if options.run_secret_file else None

    def prove(self, node: str, nonce: str) -> str:
        """The answer of node `node` to challenge `nonce`, hex."""
        return hmac.new(self._key, _CONTEXT + node.encode() + b"\0" + nonce.encode(), hashlib.sha256).hexdigest()

    def verify(self, node: str, nonce: str, proof: str) -> bool:
        """Whether `proof` is node `node`'s answer to `nonce` (in constant time)."""
        return hmac.compare_digest(self.prove(node, nonce), proof)

    def __repr__(self) -> str:
        return "RunSecret(...)"
