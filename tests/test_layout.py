"""Project layout rules: import direction, cheap package import, file sizes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["deepinfer", "tilekernels", "codegen", "backends"]  # imports only point rightwards


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_point_one_way():
    for rank, package in enumerate(ORDER):
        for path in (ROOT / package).rglob("*.py"):
            higher = imported_packages(path) & set(ORDER[:rank])
            assert not higher, f"{path.relative_to(ROOT)} imports {sorted(higher)}, a layer above {package}"


def test_import_deepinfer_loads_no_torch_or_tilelang():
    code = "import sys, deepinfer, deepinfer.cli; print(sorted(m for m in ('torch', 'tilelang') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_no_source_file_is_huge():
    sizes = {p: len(p.read_text().splitlines()) for pkg in ORDER for p in (ROOT / pkg).rglob("*.py")}
    largest = max(sizes.items(), key=lambda kv: kv[1], default=(None, 0))
    assert largest[1] <= 400, f"{largest[0]} has {largest[1]} lines"
