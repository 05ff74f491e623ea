"""Ring attention is exact: every CP layout, comm mode and head layout matches full SDPA.

Each rank builds the same full q, k, v (and upstream gradient) from a seed, runs ring attention
on its shard, and compares output and gradients with the matching shard of a single-process
``F.scaled_dot_product_attention`` computed the simplest way (K/V expanded to all heads).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import REPO_ROOT
from tests.spawn import run_distributed

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # (heads, kv_heads)


def _inputs(heads, kv_heads, seq, dtype, seed=0, batch=2, dim=16, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype) * q_scale
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                         v.repeat_interleave(rep, 1), is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _ring_errors(case, seq=48):
    """Max relative error of (out, dq, dk, dv) of one case on this rank."""
    from titanext.plugins.context_parallel import ring_attention, shard_sequence

    heads, causal, comm, layout, dtype, kernel, q_scale = case
    h, kvh = HEADS[heads]
    full = _inputs(h, kvh, seq, dtype, q_scale=q_scale)
    ref = _reference(*full, causal)
    if q_scale != 1:  # ill-conditioned in fp32 whatever the kernel: judge against fp64
        ref = [t.to(dtype) for t in _reference(*(t.double() for t in full), causal)]
    group = dist.group.WORLD
    q, k, v, dout = (shard_sequence(t, 2, group, layout).clone() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, group, causal=causal, layout=layout, comm=comm, kernel=kernel)
    out.backward(dout)
    mine = [shard_sequence(t, 2, group, layout) for t in ref]
    got = [out.detach(), q.grad, k.grad, v.grad]
    assert all(torch.isfinite(t).all() for t in got)
    errs = [_rel(a, b) for a, b in zip(got, mine)]
    return errs


def _parity_body(rank, world_size, cases):
    return {case: _ring_errors(case) for case in cases}


FP32_CASES = [(heads, causal, comm, layout, torch.float32, "auto", 1.0)
              for heads, causal, comm, layout in itertools.product(
                  HEADS, (True, False), ("p2p", "allgather"), ("zigzag", "contiguous"))]
EXTRA_CASES = [
    ("gqa", True, "p2p", "zigzag", torch.float32, "math", 1.0),
    ("gqa", True, "allgather", "contiguous", torch.float32, "math", 1.0),
    ("mqa", False, "p2p", "zigzag", torch.float32, "math", 1.0),
]
FP64_CASES = [(heads, causal, "p2p", "zigzag", torch.float64, kernel, 1.0)
              for heads in ("mha", "gqa") for causal in (True, False)
              for kernel in ("auto", "math")]
LARGE_LOGITS = [("gqa", True, comm, "zigzag", torch.float32, kernel, 300.0)
                for comm in ("p2p", "allgather") for kernel in ("auto", "math")]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def errors(request):
    cases = FP32_CASES + EXTRA_CASES + FP64_CASES + LARGE_LOGITS
    world = request.param
    per_rank = run_distributed(_parity_body, world, args=(cases,), timeout_s=60)
    # worst rank for every case
    return world, {c: [max(r[c][i] for r in per_rank) for i in range(4)] for c in cases}


def _name(case):
    heads, causal, comm, layout, dtype, kernel, q_scale = case
    return (f"{heads}-{'causal' if causal else 'full'}-{comm}-{layout}-{str(dtype)[6:]}-{kernel}"
            + (f"-qx{q_scale:g}" if q_scale != 1 else ""))


@pytest.mark.parametrize("case", FP32_CASES + EXTRA_CASES, ids=_name)
def test_fp32_out_and_grads_match_sdpa(errors, case):
    world, errs = errors
    assert max(errs[case]) < 1e-5, dict(zip(("out", "dq", "dk", "dv"), errs[case]))


@pytest.mark.parametrize("case", FP64_CASES, ids=_name)
def test_fp64_out_and_grads_match_sdpa(errors, case):
    world, errs = errors
    assert max(errs[case]) < 1e-10, dict(zip(("out", "dq", "dk", "dv"), errs[case]))


@pytest.mark.parametrize("case", LARGE_LOGITS, ids=_name)
def test_large_logits_do_not_overflow(errors, case):
    # q scaled by 300 gives logits in the thousands: exp() of them would overflow fp32. In fp32
    # such inputs carry ~1e-5 relative error in any kernel (single-process fp32 SDPA itself is
    # off by up to 2e-5 against fp64 here), so the bound is against an fp64 reference. The math
    # kernel (the fallback where no LSE-returning kernel exists) recomputes fp32 scores of
    # magnitude ~1e3 in backward, which costs up to ~2e-4.
    world, errs = errors
    bound = 1e-4 if case[5] == "auto" else 5e-4
    assert max(errs[case]) < bound, dict(zip(("out", "dq", "dk", "dv"), errs[case]))


def _growth_body(rank, world_size):
    case = ("gqa", True, "p2p", "zigzag", torch.float32, "auto", 1.0)
    return _ring_errors(case, seq=256)


def test_error_does_not_grow_with_world_size():
    """Same full problem at W=2 and W=4: the fp32 merge keeps the error flat."""
    err2 = max(max(r) for r in run_distributed(_growth_body, 2, timeout_s=60))
    err4 = max(max(r) for r in run_distributed(_growth_body, 4, timeout_s=60))
    assert err2 < 1e-5 and err4 < 1e-5
    assert err4 < 2 * err2 + 1e-7, (err2, err4)


def _comm_body(rank, world_size):
    from titanext.plugins.context_parallel import count_comm, ring_attention, zigzag_shard

    counts = {}
    for kv_heads, comm in ((2, "p2p"), (8, "p2p"), (2, "allgather")):
        q, k, v, dout = (zigzag_shard(t, 2, dist.group.WORLD)
                         for t in _inputs(8, kv_heads, 32, torch.float32))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with count_comm() as fwd:
            out = ring_attention(q, k, v, dist.group.WORLD, comm=comm)
        with count_comm() as bwd:
            out.backward(dout)
        counts[kv_heads, comm] = {"fwd": (fwd.sends, fwd.send_bytes, dict(fwd.collectives)),
                                  "bwd": (bwd.sends, bwd.send_bytes, dict(bwd.collectives))}
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_messages_and_bytes_match_formula(world_size):
    W, batch, local_seq, dim = world_size, 2, 32 // world_size, 16
    for counts in run_distributed(_comm_body, W, timeout_s=60):
        for kv_heads in (2, 8):
            kv_block = 2 * batch * kv_heads * local_seq * dim * 4  # K and V, fp32
            # forward: W-1 KV blocks; backward: W-1 KV blocks + W fp32 dK/dV accumulators
            assert counts[kv_heads, "p2p"]["fwd"] == (W - 1, (W - 1) * kv_block, {})
            assert counts[kv_heads, "p2p"]["bwd"] == (2 * W - 1, (2 * W - 1) * kv_block, {})
        # allgather: one collective forward; one all-gather and one reduce-scatter backward
        assert counts[2, "allgather"]["fwd"][2] == {"all_gather": 1}
        assert counts[2, "allgather"]["bwd"][2] == {"all_gather": 1, "reduce_scatter": 1}


def _shard_body(rank, world_size):
    from titanext.plugins.context_parallel import (
        shard_batch,
        shard_sequence,
        unshard_sequence,
        zigzag_shard,
        zigzag_unshard,
    )

    g = dist.group.WORLD
    x = torch.arange(2 * 24).view(2, 24)
    z = zigzag_shard(x, 1, g)
    c = shard_sequence(x, 1, g, "contiguous")
    inputs, labels, pos = shard_batch(x, x + 100, g)
    return (z.tolist(), torch.equal(zigzag_unshard(z, 1, g), x),
            torch.equal(unshard_sequence(c, 1, g, "contiguous"), x),
            inputs.tolist() == z.tolist(), (labels - 100).tolist() == z.tolist(), pos.tolist())


def test_zigzag_shard_layout_and_roundtrip():
    results = run_distributed(_shard_body, 3, timeout_s=30)
    chunks = torch.arange(24).chunk(6)  # 2W = 6 chunks of 4 positions
    for rank, (z, back_z, back_c, same_inputs, same_labels, pos) in enumerate(results):
        expect = torch.cat([chunks[rank], chunks[5 - rank]]).tolist()
        assert z[0] == expect and pos == expect
        assert back_z and back_c and same_inputs and same_labels


def _user_model_body(rank, world_size):
    """A user's module calling F.scaled_dot_product_attention, under ring_attention_sdpa."""
    from titanext.plugins.context_parallel import ring_attention_sdpa, shard_batch

    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)  # not ours; unused except weights
    proj = torch.nn.Linear(32, 96)

    def forward(x):
        q, k, v = proj(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], 32)

    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    ref = forward(x)
    ref.square().sum().backward()
    ref_grad = proj.weight.grad.clone()
    proj.weight.grad = None
    g = dist.group.WORLD
    xs, _, _ = shard_batch(x, None, g)
    with ring_attention_sdpa(g):
        out = forward(xs)
    out.square().sum().backward()
    dist.all_reduce(proj.weight.grad)
    del attn
    return (_rel(out.detach(), shard_batch(ref.detach(), None, g)[0]),
            _rel(proj.weight.grad, ref_grad))


def test_sdpa_context_manager_on_a_user_module():
    for out_err, grad_err in run_distributed(_user_model_body, 2, timeout_s=30):
        assert out_err < 1e-5 and grad_err < 1e-5


def test_bad_arguments_are_rejected_clearly():
    from titanext.plugins.context_parallel import apply_context_parallel, ring_attention

    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="layout = 'zig' is not one of"):
        ring_attention(q, q, q, None, layout="zig")
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        ring_attention(q, q[:, :3], q[:, :3], None)
    with pytest.raises(ValueError, match="no module of Linear has an attention function"):
        apply_context_parallel(torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="comm = 'ring' is not allowed"):
        apply_context_parallel(torch.nn.Linear(2, 2), None, comm="ring")


def _model_grads_body(rank, world_size, layout, comm):
    """Loss and gradients of the reference model on a CP group vs one process."""
    from titanext.models import build_model, get_model_args
    from titanext.plugins.context_parallel import apply_context_parallel, shard_batch

    args = get_model_args("llama3", "debugtiny")
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 64), generator=g)

    def loss_and_grads(inputs, targets, positions=None):
        model.zero_grad()
        logits = model(inputs, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads(tokens, labels)
    apply_context_parallel(model, dist.group.WORLD, layout=layout, comm=comm)
    loss, grads = loss_and_grads(*shard_batch(tokens, labels, dist.group.WORLD, layout=layout))
    dist.all_reduce(loss)
    for grad in grads.values():
        dist.all_reduce(grad)
    errs = {n: ((grads[n] - ref).norm() / ref.norm()).item() for n, ref in ref_grads.items()}
    return abs(loss - ref_loss).item() / ref_loss.item(), errs


@pytest.mark.parametrize("layout,comm", [("zigzag", "p2p"), ("contiguous", "allgather")])
def test_reference_model_loss_and_grads_match_one_process(layout, comm):
    for loss_err, errs in run_distributed(_model_grads_body, 2, args=(layout, comm), timeout_s=60):
        assert loss_err < 1e-6
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, f"{worst}: {errs[worst]:.2e}"


def test_user_model_example_runs_and_matches(tmp_path):
    """examples/context_parallel.py (docs/context_parallel.md) under torchrun, 2 ranks."""
    import re

    from tests.spawn import run_example

    root = REPO_ROOT
    out = run_example(root / "examples" / "context_parallel.py", 2, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]  # the example asserts its own checks
    full, cp, err = map(float, re.search(
        r"full-sequence loss (\S+)  context-parallel loss (\S+)  worst grad error (\S+)",
        out.stdout).groups())
    assert abs(full - cp) < 1e-5 * abs(full) and err < 1e-5
    right = re.search(r"tables indexed by positions: loss (\S+) vs (\S+)  worst grad error (\S+)",
                      out.stdout)
    wrong = re.search(r"NOT indexed \(wrong\): loss (\S+) vs (\S+)  worst grad error (\S+)",
                      out.stdout)
    assert float(right.group(3)) < 1e-5 and float(wrong.group(3)) > 1e-3, out.stdout


def _positions_shapes_body(rank, world_size):
    from titanext.plugins.context_parallel import shard_batch

    x = torch.arange(16).view(2, 8)
    shapes = {}
    for kind in ("seq", "row", "batch"):
        _, _, pos = shard_batch(x, x, dist.group.WORLD, positions_shape=kind)
        shapes[kind] = (tuple(pos.shape), pos.reshape(-1, 4)[0].tolist())
    try:
        shard_batch(x, x, dist.group.WORLD, positions_shape="2d")
    except ValueError as e:
        shapes["error"] = str(e)
    return shapes


def test_shard_batch_returns_positions_in_the_shape_the_model_takes():
    """[local_seq], [1, local_seq] (Llama / HF position_ids) or [batch, local_seq]; the same
    zigzag positions in each; an unknown shape names the choices."""
    r0, r1 = run_distributed(_positions_shapes_body, 2, timeout_s=30)
    assert r0["seq"] == ((4,), [0, 1, 6, 7]) and r1["seq"] == ((4,), [2, 3, 4, 5])
    assert r0["row"] == ((1, 4), [0, 1, 6, 7]) and r0["batch"] == ((2, 4), [0, 1, 6, 7])
    assert "'seq', 'row', 'batch'" in r0["error"]


def test_own_attention_example_runs_ring_ulysses_and_hybrid_exactly(tmp_path):
    """examples/context_parallel_attention.py (docs/context_parallel.md) under torchrun, 4 ranks:
    ring, Ulysses and hybrid 2x2 with packed documents against masked SDPA on one process."""
    import re

    from tests.spawn import run_example

    root = REPO_ROOT
    out = run_example(root / "examples" / "context_parallel_attention.py", 4, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    found = dict(re.findall(r"(.+): max relative error of out, dq, dk, dv (\S+)", out.stdout))
    assert set(found) == {"ring", "ulysses", "hybrid 2x2"}, out.stdout
    assert all(float(err) < 1e-5 for err in found.values()), found
