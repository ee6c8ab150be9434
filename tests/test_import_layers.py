"""Imports flow one way (pyproject.toml [tool.importlinter]: ops -> kernels -> models -> quant -> runtime -> eval
-> cli) and no two modules import each other, directly or through others."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_lint_imports_layers_contract():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: pip install -e '.[dev]' (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout's ssmq, not an installed one
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout


def _import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(imports)))
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in imports[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(imports):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    grimp = pytest.importorskip("grimp")  # installed with import-linter
    sys.path.insert(0, str(ROOT))
    try:
        graph = grimp.build_graph("ssmq", cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    cycles = _import_cycles({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    assert cycles == [], f"import circles (lazy imports count too): {cycles}"
