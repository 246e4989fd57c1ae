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


def _target_words() -> set[str]:
    import backends

    return set(backends.TARGET_NAMES) | set(backends.ALIASES) | {"cpu", "cuda", "npu"}


def _names_compared(node: ast.Compare) -> set[str]:
    """String constants on either side of ==, !=, in, not in (tuples, lists and sets of them included)."""
    if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
        return set()
    found = set()
    for side in [node.left, *node.comparators]:
        items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        found.update(i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str))
    return found


def test_no_branch_on_a_target_name_outside_backends():
    """What differs between targets is data on `backends.Target`; nothing above `backends/` compares a target,
    backend or device-type name."""
    words, hits = _target_words(), []
    for package in ORDER[:-1]:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and _names_compared(node) & words:
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not hits, f"target-name branches outside backends/: {hits}"
