"""The import layering of DESIGN.md §4, checked with import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    paths = os.pathsep.join(str(ROOT / d) for d in ("scheduler", "operator", "node-agent"))
    env = {**os.environ, "PYTHONPATH": paths}
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout
