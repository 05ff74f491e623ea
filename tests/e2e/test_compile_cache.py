"""Inductor's on-disk cache and the CPU kernel paths (docs/cpu_kernel_paths.md): code compiled
through titanext under one vector ISA is not reused under another.

Torch 2.13's FX graph cache keys generated C++ by the graph and inductor's config, not by the
vector ISA (the CPU's, or ``ATEN_CPU_CAPABILITY``'s): a float8 block compiled on the default
path (AVX-512 here), then again under the AVX2 variables with the same cache folder, reused
kernels written for 16-float vectors in a build for 8-float ones, and gave NaN (or corrupted
the heap). ``titanext._compat.inductor_cache_options`` names the ISA's width in the key. Two
processes, one cache folder; on a CPU without AVX-512 both paths pick AVX2 and the check is
plain compile-equals-eager.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import REPO_ROOT

AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2"}
PATH_VARS = tuple(AVX2)

# one process: a 2-block float8 model, each block compiled by titanext, against eager
SCRIPT = """
import torch
from torch import nn
from torch._inductor import cpu_vec_isa
from titanext.plugins.compile import apply_compile
from titanext.plugins.float8 import apply_float8

torch.manual_seed(0)
model = nn.Module()
model.layers = nn.ModuleList(
    nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    for _ in range(2))
apply_float8(model)
x = torch.randn(32, 64)

def run(m):
    h = x
    for block in m.layers:
        h = block(h)
    return h

eager = run(model)
apply_compile(model)
compiled = run(model)
err = ((compiled - eager).norm() / eager.norm()).item()
print(f"isa {cpu_vec_isa.pick_vec_isa()} relative error {err:.2e}")
assert err < 1e-5, err
"""


@pytest.mark.slow
def test_compiled_float8_blocks_match_eager_after_another_kernel_paths_compile(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in PATH_VARS}
    base.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                PYTHONPATH=str(REPO_ROOT), TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    for label, env in (("default", base), ("avx2", {**base, **AVX2})):
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env=env)
        assert out.returncode == 0, f"{label} path: {out.stdout[-1500:]}{out.stderr[-3000:]}"
        print(f"{label} path: {out.stdout.strip().splitlines()[-1]}")
