"""Reaching a Ray cluster: importing `ray` (an optional extra) and connecting this process as its driver.

A cluster whose address is on loopback (127.0.0.1, localhost: every node on this host) needs
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set before `ray` is imported: without it Ray replaces a loopback address by
the machine's outside address, which its nodes do not listen on, and the driver retries forever.
Not thread-safe: call from the thread that drives the run.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

from paramserver.base.errors import ConfigError

log = logging.getLogger(__name__)
ADDRESS_ENV = "RAY_ADDRESS"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
INSTALL = "pip install 'paramserver[ray]'"


def import_ray(address: str | None) -> ModuleType:
    """The `ray` module, imported for a cluster at `address`; ConfigError saying what to install without it."""
    if is_loopback(address) and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"the Ray engine needs the ray package ({exc}): {INSTALL}") from None
    return ray


def is_loopback(address: str | None) -> bool:
    """Whether `address` (HOST:PORT; None: RAY_ADDRESS) names a cluster on this host's loopback."""
    address = address or os.environ.get(ADDRESS_ENV, "")
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host in _LOOPBACK_HOSTS


def connect(ray: ModuleType, address: str | None) -> bool:
    """Connect this process to the cluster at `address` (None: RAY_ADDRESS, else the cluster Ray finds on this
    host) unless it is connected already; returns whether it connected (and so must disconnect)."""
    if ray.is_initialized():
        return False
    if not (address or os.environ.get(ADDRESS_ENV)):
        log.info("no --address nor %s: joining the Ray cluster started on this host", ADDRESS_ENV)
    where = address or os.environ.get(ADDRESS_ENV) or "auto"
    try:
        ray.init(address=where, log_to_driver=False)  # the nodes' output comes back on their streams
    except ConnectionError as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {where}: {exc}") from None
    return True
