"""The import layering of docs/architecture.md, checked with import-linter's contracts in
pyproject.toml."""

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
    assert "4 kept, 0 broken" in proc.stdout


ADAPTERS = {
    "docker": {"node-agent/tangram/node_agent/docker_runtime.py"},
    "pynvml": {"node-agent/tangram/node_agent/gpus.py"},
    "torch": {
        "node-agent/tangram/node_agent/gpu_worker.py",
        "node-agent/tangram/node_agent/gpu_bench.py",
    },
    "kubernetes": {
        "scheduler/tangram/kube/__init__.py",
        "scheduler/tangram/service/kube.py",
        "operator/tangram/operator/kube.py",
        "node-agent/tangram/node_agent/kube_pods.py",
    },
    # kopf drives the operator's event loop: only the handlers and the command know of it.
    "kopf": {
        "operator/tangram/operator/handlers.py",
        "scheduler/tangram/cli/operator.py",
    },
}


def test_only_adapter_modules_import_io_libraries() -> None:
    import ast

    for top in ("scheduler", "operator", "node-agent"):
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    lib = name.split(".")[0]
                    if lib in ADAPTERS:
                        assert rel in ADAPTERS[lib], f"{rel} imports {lib}"
