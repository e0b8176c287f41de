"""Where a run's nodes go on a Ray cluster: each node's resource request, and the placement group that
spreads them over the cluster's machines (one node per machine when the cluster has enough: STRICT_SPREAD;
else as spread as it can: SPREAD). Pure functions but `spread_group`, which waits on the cluster."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from paramserver.base.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)
ROLES = ("ps", "worker")
DEFAULT_REQUEST = {"CPU": 1.0}
_STRICT_TRY_S = 10.0  # how long STRICT_SPREAD may wait for room before the group settles for SPREAD


def requests(resources: Mapping[str, Any] | None) -> dict[str, dict[str, float]]:
    """Each role's Ray resource request from `resources`: one mapping for every node ({"CPU": 2, "memory": 2**30,
    "GPU": 1, or a custom resource}), or one per role ({"ps": {...}, "worker": {...}}). Default: 1 CPU each."""
    if resources is None:
        return {role: dict(DEFAULT_REQUEST) for role in ROLES}
    if not isinstance(resources, Mapping):
        raise ConfigError(f"resources must be a mapping of resource -> amount, or of role -> one; got {resources!r}")
    if resources and all(isinstance(value, Mapping) for value in resources.values()):
        unknown = sorted(set(resources) - set(ROLES))
        if unknown:
            raise ConfigError(f"resources by role take 'ps' and 'worker'; unknown {unknown}")
        return {role: _request(resources.get(role, DEFAULT_REQUEST), role) for role in ROLES}
    return {role: _request(resources, role) for role in ROLES}


def _request(amounts: Mapping[str, Any], role: str) -> dict[str, float]:
    request = {}
    for name, amount in amounts.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise ConfigError(f"{role} resource {name!r}: the amount must be a number >= 0, got {amount!r}")
        if amount:
            request[name] = float(amount)
    return request


def actor_options(request: Mapping[str, float]) -> dict[str, Any]:
    """`ActorClass.options(...)` asking for `request` (CPU, GPU and memory by their own names, the rest as custom)."""
    custom = {name: amount for name, amount in request.items() if name not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {"num_cpus": request.get("CPU", 0.0), "num_gpus": request.get("GPU", 0.0)}
    if "memory" in request:
        options["memory"] = request["memory"]
    if custom:
        options["resources"] = custom
    return options


def spread_group(ray: ModuleType, bundles: list[dict[str, float]], timeout: float) -> Any:
    """A ready placement group of `bundles`: STRICT_SPREAD when the cluster has a live node per bundle and room
    on them, else SPREAD. UnavailableError when not even SPREAD finds room within `timeout` seconds."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [bundle or {"CPU": 0.01} for bundle in bundles]  # an empty bundle is refused
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    if alive >= len(bundles):
        group = placement_group(bundles, strategy="STRICT_SPREAD")
        if _ready(ray, group, min(timeout, _STRICT_TRY_S)):
            return group
        remove_placement_group(group)
        log.info(
            "no room for one node per machine (STRICT_SPREAD) within %.0fs: spreading as the room allows", _STRICT_TRY_S
        )
    group = placement_group(bundles, strategy="SPREAD")
    if _ready(ray, group, timeout):
        return group
    remove_placement_group(group)
    raise UnavailableError(f"the Ray cluster ({alive} live nodes) has no room for {bundles} within {timeout:.0f}s")


def _ready(ray: ModuleType, group: Any, timeout: float) -> bool:
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    return bool(ready)
