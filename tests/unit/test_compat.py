"""titanext._compat: what differs between the supported torch versions (2.11 to 2.14.1).

The values pinned here were drawn on torch 2.13.0; CI's matrix runs this file on 2.11.0 and
2.14.1 too (``.ci/matrix``), so a torch whose sampler or generator draws differently fails here.
They are pinned per CPU kernel family (:func:`kernel_family`): torch's own normal_ rounds
differently without a vector ISA, whatever the torch version.
"""

from __future__ import annotations

import pytest
import torch

from titanext._compat import reduce_scatter_single, trunc_normal_
from titanext.models import build_model, get_model_args

pytestmark = pytest.mark.torch_seam


# torch's normal_ and log_ round differently on a CPU kernel path without a vector ISA
# (ATEN_CPU_CAPABILITY=default, .ci/kernel_paths sse: scalar Box-Muller and log), so each
# family of paths has its own pinned values; AVX2 and AVX-512 draw the same bits.
# std, limit: {family: (sum, first value)}
TRUNC_NORMAL = [
    (0.02, 2.0, {"vector": (2.3886522130228514, -0.01640268974006176),  # normal + redraws
                 "scalar": (2.3886505739442327, -0.01640268974006176)}),
    (1.0, 0.1, {"vector": (3.6197196930743303, 0.006984508130699396),  # uniform proposals
                "scalar": (3.619720794260502, 0.006984509527683258)}),
]
# debugtiny after init_weights(seed=7): {family: (sum, sum of absolute values)}
ONE_SEED_MODEL = {"vector": (165.37293828274125, 16596.363450976307),
                  "scalar": (165.3726172665277, 16596.363562396753)}


def kernel_family() -> str:
    """"vector" (AVX2, AVX-512) or "scalar" (no vector ISA); another CPU's path (ARM's NEON or
    SVE) has no pinned values yet: the tests that need them skip, naming it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return "vector"
    if capability == "DEFAULT":
        return "scalar"
    pytest.skip(f"no values pinned for this CPU kernel path ({capability}): draw them with "
                "tests/unit/test_compat.py's seeds and add them")


@pytest.mark.parametrize("std,limit,pinned", TRUNC_NORMAL)
def test_trunc_normal_draws_the_same_values_on_every_torch(std, limit, pinned):
    total, first = pinned[kernel_family()]
    g = torch.Generator().manual_seed(7)
    x = trunc_normal_(torch.empty(4096), 0.0, std, -limit * std, limit * std, generator=g)
    assert x.double().sum().item() == pytest.approx(total, rel=1e-12)
    assert x[0].item() == pytest.approx(first, rel=1e-7)
    assert x.abs().max().item() <= limit * std


def test_trunc_normal_equals_torchs_own_where_torch_uses_the_rejection_sampler():
    """Where torch's ``nn.init.trunc_normal_`` is the 2.12+ sampler, the values are bitwise
    torch's (titanext keeps a copy only so that 2.11 draws them too)."""
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    ours = trunc_normal_(torch.empty(2000), 0.0, 0.02, -0.04, 0.04, generator=g1)
    theirs = torch.nn.init.trunc_normal_(torch.empty(2000), 0.0, 0.02, -0.04, 0.04, generator=g2)
    if not torch.equal(ours, theirs):  # only torch <= 2.11's inverse-CDF sampler differs
        assert (theirs.abs() <= 0.04).all()
        pytest.skip("this torch's trunc_normal_ is the older inverse-CDF sampler")


def test_one_seed_initialises_the_same_model_on_every_torch():
    model = build_model("llama3", get_model_args("llama3", "debugtiny"), device="cpu")
    model.init_weights(seed=7)
    params = list(model.parameters())
    total, absolute = ONE_SEED_MODEL[kernel_family()]
    assert sum(p.double().sum().item() for p in params) == pytest.approx(total, rel=1e-9)
    assert sum(p.double().abs().sum().item() for p in params) == pytest.approx(absolute,
                                                                               rel=1e-9)


def test_reduce_scatter_single_is_a_collective_of_this_torch():
    import torch.distributed as dist

    assert reduce_scatter_single in (getattr(dist, "reduce_scatter_single", None),
                                     dist.reduce_scatter_tensor)


def test_pinned_async_save_options_follow_this_torchs_async_save(monkeypatch):
    import torch.distributed.checkpoint as dcp

    from titanext._compat import pinned_async_save_options

    options = pinned_async_save_options()
    if options:  # this torch stages through a DefaultStager and writes from a process
        from torch.distributed.checkpoint.staging import DefaultStager
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        assert options["async_checkpointer_type"] == AsyncCheckpointerType.PROCESS
        assert isinstance(options["async_stager"], DefaultStager)
        options["async_stager"].close()

    def older_async_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None,
                         process_group=None):
        raise AssertionError("not called")

    monkeypatch.setattr(dcp, "async_save", older_async_save)
    assert pinned_async_save_options() == {}  # plain async: a thread and CPU memory
