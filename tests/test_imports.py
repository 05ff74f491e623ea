"""The import graph of titanext: no cycles, and a light config.

The graph holds the imports that run when a module is imported: module level and class bodies,
including ``try``/``if`` blocks, but not ``if TYPE_CHECKING:`` blocks and not imports inside
functions (those run later, when every module is already loaded). Importing ``a.b.c`` also runs
the packages ``a`` and ``a.b``, so those count as edges too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titanext"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_nodes(body: list[ast.stmt]):
    """Import statements that run at import time (recursing into if/try/with/class bodies)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_nodes(node.body)
            yield from _import_time_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_time_nodes(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _import_time_nodes(node.body)


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """titanext modules that ``node`` imports (with the packages that importing them runs)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix]
        # `from pkg import mod` imports the submodule pkg.mod when there is one
        names += [f"{prefix}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            candidate = ".".join(parts[:i])
            if candidate in known and candidate != module:
                found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _import_time_nodes(tree.body):
            edges |= _targets(node, module, is_package, known)
        # a package's own parents run before it, but they are not its imports
        graph[module] = {m for m in edges if not module.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_titanext_has_no_import_cycle():
    graph = import_graph()
    assert "titanext.config.rules" in graph and "titanext.distributed.parallel_dims" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    # The check itself: a planted cycle is reported with its path.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_reads_relative_type_checking_and_function_level_imports(tmp_path):
    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from titanext.errors import ConfigError
        if TYPE_CHECKING:
            from titanext.distributed.parallel_dims import ParallelDims
        def f():
            from titanext.train import main
    """)
    tree = ast.parse(src)
    known = {"titanext", "titanext.errors", "titanext.distributed.parallel_dims", "titanext.train"}
    edges = set()
    for node in _import_time_nodes(tree.body):
        edges |= _targets(node, "titanext.x", False, known)
    assert edges == {"titanext", "titanext.errors"}


def test_config_import_load_and_help_stay_off_torch():
    # `import torch` itself imports torch.distributed, so the config must not import torch at
    # all: --help, --print-config and the launcher's validation run without the training stack.
    code = textwrap.dedent("""
        import sys
        import titanext.config
        from titanext.config import config_help, load_config, to_toml
        cfg = load_config("train_configs/debug_model.toml", ["--training.steps=3"], world_size=4)
        load_config("train_configs/debug_moe.toml", world_size=2)
        config_help(); to_toml(cfg)
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(heavy[:5])
        assert "torch.distributed" not in sys.modules, heavy[:5]
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "[]"
