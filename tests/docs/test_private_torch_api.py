"""torch's private pipelining API is touched in one module only: titanext/schedules/_torch_ir.py.

A rename in a new torch then needs a fix there and nowhere else. This test reads every other
module of the package and fails on a private pipelining name.
"""

from __future__ import annotations

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
