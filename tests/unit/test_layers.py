"""The layers of docs/ARCHITECTURE.md hold: import-linter checks the contracts in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # runs lint-imports as a process

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_a_layer_above_its_own():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
