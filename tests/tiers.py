"""The test folders mirror the tiers: tests/unit holds the fast tier only (no tier marker), tests/integration,
tests/fault and tests/engines only tests marked with a tier (cluster, parity, fault; pyproject.toml; engines:
real schedulers, registered in tests/conftest.py). tests/conftest.py
checks every collected test against this when its TIER_FOLDERS_CHECKED is on."""

from __future__ import annotations

from pathlib import Path

TIER_MARKERS = frozenset({"cluster", "parity", "fault", "engines", "net"})
FAST_FOLDERS = frozenset({"unit"})
SLOW_FOLDERS = frozenset({"integration", "fault", "engines", "net"})


def misplaced(folder: str, markers: set[str]) -> str | None:
    """Why a test in tests/<folder> with these markers is in the wrong folder, or None if it is not."""
    tiers = sorted(markers & TIER_MARKERS)
    if folder in FAST_FOLDERS and tiers:
        home = "tests/fault" if "fault" in tiers else "tests/engines" if "engines" in tiers else "tests/integration"
        return f"marked {', '.join(tiers)} but in tests/{folder}, the fast tier's folder: move it to {home}"
    if folder in SLOW_FOLDERS and not tiers:
        return (
            f"in tests/{folder} but not marked cluster, parity, fault or engines: it runs in the fast tier, so it "
            f"belongs in tests/unit (or mark it with its tier)"
        )
    return None


def misplaced_tests(items, tests_root: Path) -> list[str]:
    """'<node id>: <why>' for each collected pytest item in a folder that is not its tier's."""
    found = []
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(tests_root).parts[0]
        except (ValueError, IndexError):
            continue  # outside tests/ (pytester's runs, a path given by hand)
        why = misplaced(folder, {mark.name for mark in item.iter_markers()})
        if why is not None:
            found.append(f"{item.nodeid}: {why}")
    return found
