"""torch's private names are reached from three modules only.

- titanext/schedules/_torch_ir.py: the pipelining runtime;
- titanext/_fake_backend.py: the dry run (fake tensors, MemTracker);
- titanext/_compat.py: everything else (grouped GEMM, the ATen flash kernels, ...).

A rename in a new torch then needs a fix there and nowhere else. The tests below read every
other module of the package and fail on a private pipelining name (by pattern, which also
catches private attributes of torch's pipelining objects), and on any private torch name at all
(by the syntax tree: an import of a private module or name, or an attribute chain through
``torch`` or an alias of it with a component that starts with one underscore).
"""

from __future__ import annotations

import ast
import re

from tests import REPO_ROOT

ROOT = REPO_ROOT / "titanext"
ALLOWED = ROOT / "schedules" / "_torch_ir.py"

# torch.distributed.pipelining's private classes, methods and attributes that titanext uses
PRIVATE = [
    r"\b_Action\b", r"\b_ComputationType\b", r"\b_PipelineScheduleRuntime\b",
    r"\b_prepare_schedule_with_comms\b", r"(?<![A-Za-z0-9])_stages\b", r"\b_n_microbatches\b",
    r"(?<![A-Za-z0-9])_loss_fn\b", r"torch\.distributed\.pipelining\.schedules\._",
    r"pipelining\.schedules import _", r"pipelining import schedules",
]


def hits(text: str) -> list[str]:
    """``line: pattern`` for every private pipelining name in ``text``."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [f"{n}: {line.strip()}" for pat in PRIVATE if re.search(pat, line)]
    return out


def test_private_pipelining_names_only_in_torch_ir():
    found = {str(p.relative_to(ROOT.parent)): h for p in sorted(ROOT.rglob("*.py"))
             if p != ALLOWED and (h := hits(p.read_text()))}
    assert not found, f"private torch pipelining names outside {ALLOWED.name}: {found}"


def test_the_check_sees_each_name():
    """Each pattern catches the use it stands for (so the test above cannot pass vacuously)."""
    uses = ["a = _s._Action(0, F, 1)", "k = _ComputationType.FORWARD",
            "class X(_PipelineScheduleRuntime):",
            "self._prepare_schedule_with_comms(order)", "for st in self._stages:",
            "m = sched._n_microbatches", "if self._loss_fn is None:",
            "from torch.distributed.pipelining.schedules._x import y",
            "from torch.distributed.pipelining.schedules import _Action",
            "from torch.distributed.pipelining import schedules as _s"]
    assert all(hits(u) for u in uses), [u for u in uses if not hits(u)]
    assert not hits("num_stages = pp_stages + len(stages); n_microbatches = 4; loss_fn = f")
    assert hits(ALLOWED.read_text())  # the allowed module does use them


SEAMS = {ROOT / "schedules" / "_torch_ir.py", ROOT / "_fake_backend.py", ROOT / "_compat.py"}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_torch_names(source: str) -> list[str]:
    """``line: name`` for every private torch name that ``source`` imports or reaches through
    ``torch`` (or a name bound to a torch module or object by an import)."""
    tree = ast.parse(source)
    bound, out = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if any(map(_private, a.name.split("."))):
                        out.add(f"{node.lineno}: import {a.name}")
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if any(map(_private, full.split("."))):
                    out.add(f"{node.lineno}: from {node.module} import {a.name}")
                bound[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                out.add(f"{node.lineno}: {'.'.join([bound[base.id], *reversed(chain)])}")
    return sorted(out)


def test_private_torch_names_only_in_the_three_seam_modules():
    found = {str(p.relative_to(ROOT.parent)): h for p in sorted(ROOT.rglob("*.py"))
             if p not in SEAMS and (h := private_torch_names(p.read_text()))}
    assert not found, f"private torch names outside {sorted(p.name for p in SEAMS)}: {found}"


def test_the_syntax_check_sees_each_kind_of_use():
    """Each way of reaching a private name is caught; public names, dunders, private names of
    titanext's own objects and names inside strings are not."""
    uses = ["import torch\ny = torch._grouped_mm(a, b)",
            "import torch\nf = torch.ops.aten._scaled_dot_product_flash_attention",
            "import torch\ntorch._C._autograd._profiler_enabled()",
            "import torch.utils._pytree as pytree",
            "from torch._subclasses.fake_tensor import FakeTensor",
            "from torch.distributed.distributed_c10d import _set_pg_timeout",
            "import torch.distributed as dist\ndist._functional_collectives.all_gather(x)",
            "from torch import cuda\ncuda.memory._snapshot()"]
    assert all(private_torch_names(u) for u in uses), [u for u in uses
                                                      if not private_torch_names(u)]
    clean = ["import torch\nv = torch.__version__\ny = torch.matmul(a, b)",
             "import torch\nself._cache = torch.zeros(1)\nx = self._grouped_mm",
             "import torch\ns = 'torch._grouped_mm'\nok = hasattr(torch, 'cuda')"]
    assert not any(private_torch_names(c) for c in clean), [private_torch_names(c) for c in clean]
    assert all(private_torch_names(p.read_text()) for p in SEAMS)  # the seams do use them
