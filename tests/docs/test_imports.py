"""The import graph of titanext: no cycle of any kind, layers that hold; a top level without shims,
and commands that resolve.

The graph holds every import of a titanext module, wherever it is written: module level, class
bodies, ``try``/``if`` blocks and inside functions (an import deferred into a function still
ties the two modules together; it only hides the cycle from Python). Only ``if TYPE_CHECKING:``
blocks are left out, since they never run. Importing ``a.b.c`` also runs the packages ``a``
and ``a.b``, so those count as edges too.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "titanext"

#: The most entries titanext/ may hold at its top level (``__pycache__`` aside): the packages,
#: the two training entry modules (train, trainer), errors and the private leaves. The old flat
#: import paths are gone (CHANGELOG.md names each one's home); nothing is re-exported there.
MAX_TOP_LEVEL = 22

#: The console scripts of pyproject.toml's [project.scripts] -> the ``python -m`` form of each.
COMMANDS = {
    "titanext-run": "titanext.launch",
    "titanext-plan": "titanext.planning",
    "titanext-convert": "titanext.launch.convert",
    "titanext-data": "titanext.launch.data",
    "titanext-support-matrix": "titanext.config.support_matrix",
    "titanext-config-docs": "titanext.config.docs",
    "titanext-zoo": "titanext.hf.zoo",
}

#: titanext's packages and top-level modules from the bottom up, one entry each. A module imports
#: its own package and what is listed before it, never what comes after; so no import runs back
#: up, and no two packages import each other. ``hf`` (HF weights in and out, the transformers
#: adapters that drive the plugins and the pipeline split) sits above ``distributed``; what the
#: layers below read of HF lives with them (``models.hf_configs``, ``models.hf_names``,
#: ``data.hf_tokenizer``, ``config.hf_rules``). The commands that read a job config
#: (titanext-convert, titanext-data) sit in ``launch``.
LAYERS = (
    "titanext", "titanext.errors", "titanext._text", "titanext._compat",
    "titanext._profiler_ranges", "titanext._safe_load", "titanext._fake_backend",
    "titanext.models", "titanext.plugins", "titanext.schedules", "titanext.data",
    "titanext.config", "titanext.components", "titanext.distributed", "titanext.hf",
    "titanext.planning", "titanext.trainer", "titanext.launch", "titanext.parity",
    "titanext.gpucheck", "titanext.train",
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the most specific entry that holds ``module`` (a module
    listed itself, else its top-level package or module)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS.index(".".join(parts[:n]))
    return LAYERS.index(module)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST):
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from import_nodes(node)


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
    return {k: set(v) for k, v in _import_graph(ROOT, PACKAGE).items()}


@functools.lru_cache(maxsize=4)
def _import_graph(root: Path, package: Path) -> dict[str, frozenset[str]]:
    files = {_module_name(p): p for p in package.rglob("*.py")}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in import_nodes(tree):
            edges |= _targets(node, module, is_package, known)
        # a package's own parents run before it, but they are not its imports
        graph[module] = frozenset(m for m in edges if not module.startswith(m + "."))
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


def test_titanext_has_no_import_cycle_counting_function_level_imports():
    graph = import_graph()
    assert "titanext.config.rules" in graph and "titanext.distributed.parallel_dims" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    # The check itself: a planted cycle is reported with its path.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_reads_function_level_and_skips_only_type_checking_imports():
    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from titanext.errors import ConfigError
        if TYPE_CHECKING:
            from titanext.distributed.parallel_dims import ParallelDims
        else:
            from titanext import models
        def f():
            from titanext.train import main
        class C:
            def g(self):
                import titanext.trainer
    """)
    known = {"titanext", "titanext.errors", "titanext.distributed.parallel_dims", "titanext.train",
             "titanext.trainer", "titanext.models"}
    edges = set()
    for node in import_nodes(ast.parse(src)):
        edges |= _targets(node, "titanext.x", False, known)
    assert edges == {"titanext", "titanext.errors", "titanext.models", "titanext.train",
                     "titanext.trainer"}


def test_a_lazy_import_that_closes_a_cycle_is_reported(tmp_path, monkeypatch):
    # The restructure removed cycles that were closed inside functions; the graph sees them.
    pkg = tmp_path / "titanext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from titanext.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from titanext.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert find_cycle(import_graph()) == ["titanext.a", "titanext.b", "titanext.a"]


def test_every_module_has_a_layer():
    unplaced = sorted({".".join(m.split(".")[:2]) for m in import_graph()} - set(LAYERS))
    assert not unplaced, f"place these in LAYERS (tests/docs/test_imports.py): {unplaced}"


def test_imports_only_point_down():
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if layer_of(t) > layer_of(m))
    assert not upward, ("imports that run back up the layers (LAYERS in "
                        f"tests/docs/test_imports.py, bottom first): {upward}")


def test_top_level_holds_no_shims():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_LEVEL, (
        f"titanext/ holds {len(entries)} entries (at most {MAX_TOP_LEVEL}): {entries}; a new "
        "module belongs in a package")


def _scripts() -> dict[str, str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_each_console_script_resolves_and_has_a_python_m_form():
    scripts = _scripts()
    assert sorted(scripts) == sorted(COMMANDS)
    for script, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script
        form = COMMANDS[script]  # python -m <form>: a package's __main__ or the module itself
        spec = importlib.util.find_spec(form)
        assert spec is not None, f"python -m {form} ({script}) finds nothing"
        if spec.submodule_search_locations:
            main = Path(spec.submodule_search_locations[0]) / "__main__.py"
            assert main.exists(), f"python -m {form} ({script}) needs {main}"
            imports = {f"{n.module}:{a.name}" for n in ast.parse(main.read_text()).body
                       if isinstance(n, ast.ImportFrom) for a in n.names}
            assert target in imports, f"{main} does not run {target}"
        else:
            assert form == module, f"python -m {form} is not {script}'s module {module}"


def test_the_training_entry_keeps_its_trainer_name():
    # `from titanext.train import Trainer` (a module __getattr__) is the trainer itself
    from titanext.train import Trainer
    from titanext.trainer import Trainer as NewTrainer

    assert Trainer is NewTrainer


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


def test_the_planner_loads_no_training_runtime():
    # titanext-plan reads the schedules' action lists, never the pipeline runtime,
    # the trainer or the distributed recipe.
    code = textwrap.dedent("""
        import sys
        from titanext.planning.cli import main
        main(["--config", "train_configs/debug_pp.toml", "--world-size", "2"])
        loaded = sorted(m for m in sys.modules if m.startswith(("titanext.distributed",
                        "titanext.trainer", "titanext.launch", "titanext.components.checkpoint")))
        print("LOADED", loaded)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "LOADED []" in result.stdout, result.stdout[-500:]
