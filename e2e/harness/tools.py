"""Where the pinned toolchain is: ``TANGRAM_E2E_BIN`` when set, else what
``e2e/build-tools.sh`` builds once into its cache (it prints the bin dir last)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BUILD_TOOLS = Path(__file__).resolve().parents[1] / "build-tools.sh"


class ToolsError(RuntimeError):
    pass


def tools_dir() -> Path:
    """The directory holding etcd, the control plane's binaries, kwok, kubectl and helm
    (a first build takes ~20 minutes; later calls ~1 s)."""
    override = os.environ.get("TANGRAM_E2E_BIN")
    if override:
        return Path(override)
    # stderr (the build's progress) passes through; stdout's last line is the bin dir.
    result = subprocess.run(
        ["bash", str(BUILD_TOOLS)], stdout=subprocess.PIPE, text=True, check=False
    )
    if result.returncode != 0:
        raise ToolsError(f"{BUILD_TOOLS} failed with status {result.returncode}")
    return Path(result.stdout.strip().splitlines()[-1])
