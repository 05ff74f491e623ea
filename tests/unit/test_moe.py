"""The MoE layer on one process: experts, router, capacity, balancing, aux loss. The debugmoe
model through the real Trainer, against one process: tests/multiprocess/test_moe.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests import REPO_ROOT
from titanext.models.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    Router,
    expert_load,
    grouped_mm_supported,
    update_expert_bias,
)

DIM, HIDDEN = 16, 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: one intra-op thread (2 threads on a busy 2-core machine is 10-30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _experts(dtype=torch.float32, n=4):
    torch.manual_seed(0)
    ex = GroupedExperts(n, DIM, HIDDEN)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    return ex.to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_grouped_mm_equals_loop_forward_and_grads(dtype, tol):
    ex = _experts(dtype)
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no tokens
    x = torch.randn(int(counts.sum()), DIM, dtype=dtype)
    assert grouped_mm_supported(x, ex.w1, ex.w2, ex.w3)
    g = torch.randn(x.shape[0], DIM, dtype=dtype)
    results = []
    for use in (True, False):
        ex.use_grouped_mm = use
        ex.zero_grad()
        xi = x.clone().requires_grad_()
        y = ex(xi, counts)
        (y * g).sum().backward()
        results.append((y.float(), xi.grad.float(),
                        *(p.grad.float().clone() for p in ex.parameters())))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()
    assert results[0][3][1].abs().max() == 0  # w2 of the empty expert has no gradient


def test_grouped_mm_support_rule():
    w = torch.empty(2, 5, 6)  # 6 * 4 bytes is not a multiple of 16
    assert not grouped_mm_supported(torch.empty(3, 6), w)
    assert grouped_mm_supported(torch.empty(3, 8), torch.empty(2, 4, 8))
    # base +4 B
    assert not grouped_mm_supported(torch.empty(25)[1:].view(3, 8), torch.empty(2, 4, 8))
    assert not grouped_mm_supported(torch.empty(3, 8, dtype=torch.float64),
                                    torch.empty(2, 4, 8, dtype=torch.float64))


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens: sum_k w_k * expert_k(x) + shared(x), with the router's choices."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, ids, _ = moe.router(tokens)
    ex = moe.experts
    out = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(x.shape[-1])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = F.silu(ex.w1[e] @ tokens[t]) * (ex.w3[e] @ tokens[t])
            acc = acc + weights[t, k] * (ex.w2[e] @ h)
        if moe.shared_experts is not None:
            acc = acc + moe.shared_experts(tokens[t])
        out.append(acc)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("kw", [
    dict(score_func="softmax", num_shared_experts=1),
    dict(score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4,
         num_limited_groups=2),
    dict(score_func="softmax", use_grouped_mm=False, route_norm=True),
])
def test_moe_matches_per_token_reference(kw):
    torch.manual_seed(1)
    moe = MoE(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=HIDDEN, **kw))
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.randn(8) * 0.05)
    x = torch.randn(2, 6, DIM)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-6)


def _router(E=8, **kw) -> Router:
    """A router whose gate is the identity: the input rows are the logits."""
    r = Router(E, MoEArgs(num_experts=E, hidden_dim=8, **kw))
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(E))
    return r


def test_router_softmax_sigmoid_norm_scale():
    logits = torch.randn(5, 8)
    for score_func, fn in (("softmax", lambda z: z.softmax(-1)), ("sigmoid", torch.sigmoid)):
        for norm in (False, True):
            r = _router(top_k=3, score_func=score_func, route_norm=norm, route_scale=1.5)
            w, ids, scores = r(logits)
            ref = fn(logits)
            top = ref.topk(3, -1)
            assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values)
            expect = ref.gather(-1, ids)
            if norm:
                expect = expect / expect.sum(-1, keepdim=True)
            torch.testing.assert_close(w, expect * 1.5)
            torch.testing.assert_close(scores, ref)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_routing_picks_inside_best_groups(score_func):
    # 8 experts in 4 groups of 2; token 0's globally best two experts (6 and 0) lie in groups
    # 3 and 0, but groups 1 and 2 score higher as groups (sum of top-2 / best expert).
    logits = torch.tensor([[3.0, -5, 2.5, 2.5, 2.6, 2.4, 3.1, -5]])
    r = _router(top_k=2, score_func=score_func, num_expert_groups=4, num_limited_groups=2)
    _, ids, _ = r(logits)
    if score_func == "sigmoid":  # groups by top-2 sum: g1 = {2,3}, g2 = {4,5} win
        assert set(ids[0].tolist()) <= {2, 3, 4, 5}
        assert set(ids[0].tolist()) == {4, 2} or set(ids[0].tolist()) == {4, 3}
    else:  # groups by best expert: g3 (3.1) and g0 (3.0) win
        assert set(ids[0].tolist()) == {6, 0}
    # Without the limit the global top-2 is chosen.
    _, ids, _ = _router(top_k=2, score_func=score_func)(logits)
    assert set(ids[0].tolist()) == {6, 0}


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    r = _router(E=4, top_k=1, score_func="sigmoid")
    w0, ids0, _ = r(logits)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    w1, ids1, scores = r(logits)
    assert ids0.item() == 0 and ids1.item() == 3
    torch.testing.assert_close(w1, torch.sigmoid(logits[:, 3:]))
    r_off = _router(E=4, top_k=1, score_func="sigmoid", load_balance_coeff=None)
    r_off.expert_bias.fill_(5.0)  # ignored when balancing is off
    assert r_off(logits)[1].item() == 0


def test_router_runs_in_fp32_under_bf16():
    torch.manual_seed(0)
    r = Router(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=8)).to(torch.bfloat16)
    x = torch.randn(7, DIM, dtype=torch.bfloat16)
    w, ids, scores = r(x)
    assert w.dtype == scores.dtype == torch.float32
    ref = F.linear(x.float(), r.gate.weight.float()).softmax(-1)
    torch.testing.assert_close(scores, ref, rtol=0, atol=0)
    moe_args = MoEArgs(num_experts=8, top_k=2, hidden_dim=HIDDEN, num_shared_experts=1)
    moe = MoE(DIM, moe_args).to(torch.bfloat16)
    assert moe(x.view(1, 7, DIM)).dtype == torch.bfloat16


def _skewed_moe(**kw) -> MoE:
    torch.manual_seed(2)
    moe = MoE(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=HIDDEN, **kw))
    with torch.no_grad():  # a shared direction in the inputs makes experts 0 and 1 win
        moe.router.gate.weight[:2] += 0.3
    return moe


def test_capacity_drops_per_formula_and_keeps_best_scores():
    T, k, E, factor = 24, 2, 8, 1.25
    moe = _skewed_moe(capacity_factor=factor)
    x = torch.randn(1, T, DIM) + 1.0
    out = moe(x)
    capacity = math.ceil(T * k / E * factor)
    counts = moe.tokens_per_expert.long()  # routed (pre-drop) assignments
    assert counts.sum() == T * k
    kept = counts.clamp(max=capacity)
    assert counts.max() > capacity  # the construction really drops
    dropped_fraction = 1 - kept.sum() / (T * k)
    # Reference: drop by hand (lowest score first within each over-full expert).
    weights, ids, scores = moe.router(x.view(T, DIM))
    s = scores.gather(-1, ids)
    keep = torch.zeros(T, k, dtype=torch.bool)
    for e in range(E):
        pos = (ids == e).nonzero().tolist()
        pos.sort(key=lambda tk: (-s[tk[0], tk[1]].item(), tk[0], tk[1]))
        for t, j in pos[:capacity]:
            keep[t, j] = True
    assert 1 - keep.sum() / (T * k) == dropped_fraction
    ex = moe.experts
    ref = torch.stack([
        sum((weights[t, j] * (ex.w2[ids[t, j]] @ (F.silu(ex.w1[ids[t, j]] @ x[0, t])
                                                   * (ex.w3[ids[t, j]] @ x[0, t])))
             for j in range(k) if keep[t, j]), torch.zeros(DIM))
        for t in range(T)])
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-6)


def test_dropless_keeps_every_assignment():
    moe = _skewed_moe()
    x = torch.randn(2, 12, DIM) + 1.0
    out = moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 12 * 2
    torch.testing.assert_close(out, _naive_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_aux_loss_free_balancing_reduces_max_load():
    moe = _skewed_moe(load_balance_coeff=5e-3)
    torch.manual_seed(3)
    history = []
    with torch.no_grad():
        for _ in range(60):  # fresh tokens each step, as in training
            moe(torch.randn(8, 64, DIM) + 0.3)
            history.append(float(expert_load(update_expert_bias(moe))[0]))
    late = sum(history[-10:]) / 10
    assert history[0] > 3.0 and late < 0.6 * history[0] and late < 2.2, history
    assert abs(float(moe.router.expert_bias.sum())) < 1e-5  # mean-centred
    assert moe.tokens_per_expert.sum() == 0  # counts reset


def test_sequence_aux_loss_matches_hand_computation_and_reaches_gate():
    alpha, B, S, E, k = 0.1, 3, 5, 8, 2
    moe = _skewed_moe(aux_loss_alpha=alpha, load_balance_coeff=None)
    x = torch.randn(B, S, DIM)
    g = torch.randn(B, S, DIM)
    (moe(x) * g).sum().backward()
    grad = moe.router.gate.weight.grad.clone()
    # Hand computation with the same routing.
    W = moe.router.gate.weight.detach().clone().requires_grad_()
    scores = (x.view(-1, DIM) @ W.T).softmax(-1)
    ids = scores.topk(k, -1).indices.view(B, S, k)
    total = 0.0
    for b in range(B):
        f = torch.stack([(ids[b] == i).sum() for i in range(E)]).float() * E / (k * S)
        P = (scores.view(B, S, E)[b] / scores.view(B, S, E)[b].sum(-1, keepdim=True)).mean(0)
        total = total + alpha * (f * P).sum()
    torch.testing.assert_close(moe.aux_loss, total.detach() / B)
    # Gradient: the MoE's gate grad = grad of <out, g> + mean over sequences of L_seq.
    moe2 = _skewed_moe(aux_loss_alpha=0.0, load_balance_coeff=None)
    (moe2(x) * g).sum().backward()
    (total / B).backward()
    torch.testing.assert_close(grad, moe2.router.gate.weight.grad + W.grad, rtol=1e-5, atol=1e-7)
    assert W.grad.abs().sum() > 0
    # An explicit per-sequence weight scales the injected gradient.
    moe.zero_grad()
    moe.aux_loss_weight = 2.0
    (moe(x) * g).sum().backward()
    torch.testing.assert_close(moe.router.gate.weight.grad,
                               moe2.router.gate.weight.grad + 2 * B * W.grad,
                               rtol=1e-5, atol=1e-7)


def test_moe_args_validation():
    for kw, msg in [
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=6, num_expert_groups=4), "divisible"),
        (dict(num_experts=8, num_expert_groups=4, num_limited_groups=5), "num_limited_groups"),
        (dict(num_experts=8, top_k=6, num_expert_groups=4, num_limited_groups=2), "limited groups"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(score_func="relu"), "score_func"),
    ]:
        with pytest.raises(ValueError, match=msg):
            MoEArgs(**kw)


def test_moe_layer_example_runs(capsys):
    """examples/moe_layer.py (the MoE example of docs/moe_ep.md) in this process, a few steps."""
    import runpy

    path = REPO_ROOT / "examples" / "moe_layer.py"
    runpy.run_path(str(path), run_name="example")["main"](steps=10)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "10"]
    assert all("max/mean expert load" in line for line in lines)


def test_float8_leaves_the_router_gate_alone():
    """The router computes in fp32: float8 conversion skips its gate (a RouterGate, not a
    plain nn.Linear) but converts the shared experts."""
    from titanext.models import build_model, get_model_args, with_moe_overrides
    from titanext.plugins.float8 import apply_float8

    args = with_moe_overrides(get_model_args("llama3", "debugmoe"), num_experts=16)
    model = build_model("llama3", args)
    converted = apply_float8(model, emulate=True)
    assert "layers.1.moe.shared_experts.w1" in converted
    assert not [f for f in converted if "router" in f]


@pytest.mark.parametrize("overrides,message", [
    (["--moe.top_k=9"], "moe.top_k = 9 must be <= num_experts = 8"),
    (["--moe.num_experts=6", "--moe.num_expert_groups=4"], "must divide num_experts = 6"),
    (["--moe.num_limited_groups=5"], "num_limited_groups = 5 must be <= num_expert_groups = 4"),
    (["--moe.top_k=5", "--moe.num_limited_groups=1"], "does not fit in the limited groups"),
    (["--moe.capacity_factor=0"], "moe.capacity_factor = 0.0 is out of range"),
    (["--moe.score_func=sigmod"], "did you mean 'sigmoid'"),
    (["--moe.use_grouped_mm=maybe"], "true, false or 'auto'"),
    (["--moe.n_dense_layers=3"], "leaves no MoE block"),
    (["--model.flavor=debugtiny"], "is a dense model (no MoE blocks)"),
])
def test_moe_config_rules_at_load(overrides, message):
    from titanext.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("train_configs/debug_moe.toml", overrides, world_size=1)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_moe_config_overrides_reach_the_model():
    from titanext.config import load_config, model_args

    cfg = load_config("train_configs/debug_moe.toml", [
        "--moe.num_experts=4", "--moe.top_k=1", "--moe.num_expert_groups=1",
        "--moe.num_limited_groups=1", "--moe.capacity_factor=1.5", "--moe.use_grouped_mm=false",
        "--moe.moe_layer_interval=2"])
    args = model_args(cfg)
    m = args.moe
    assert (m.num_experts, m.top_k, m.capacity_factor, m.use_grouped_mm) == (4, 1, 1.5, False)
    assert [args.is_moe_layer(i) for i in range(args.n_layers)] == [False, True, False]


@pytest.mark.parametrize("flavor,dtype,changes", [
    ("debugmoe", torch.float32, {}), ("debugdeepseek", torch.bfloat16, {}),
    ("debugdeepseek", torch.bfloat16, {"score_func": "softmax", "route_norm": False, "top_k": 3})])
def test_moe_keeps_no_expert_output_for_the_routing_weights(flavor, dtype, changes):
    """The routing weight multiplies SwiGLU's output before w2, so the backward keeps no expert
    output [rows, dim] (and no fp32 copy of one) for the weights' gradient: of the [T k, dim]
    tensors, only the experts' input is saved, and the layer saves what the planner counts.

    Counted: the saved tensors the graph still holds when the forward returns (a tensor saved by
    a node that died in the forward, such as the expert choice's, is freed then, and its memory
    may come back as a later tensor's: keyed by storage alone, it would hide that tensor)."""
    import dataclasses
    import weakref

    from titanext.models import get_model_args
    from titanext.planning.moe import MoEShape, moe_activation_extra

    args = get_model_args("llama3", flavor)
    m = dataclasses.replace(args.moe, **changes)
    assert m.num_limited_groups < m.num_expert_groups  # group-limited routing keeps nothing
    torch.manual_seed(6)  # a seed whose routing made storage-keyed counting miss a tensor
    moe = MoE(args.dim, m).to(dtype)
    tokens = 256
    x = torch.randn(1, tokens, args.dim, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in (x, *moe.parameters(), *moe.buffers())}
    packed = []

    def pack(t):
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = moe(x).float().sum()
    saved = {t.untyped_storage().data_ptr(): (tuple(t.shape), t.untyped_storage().nbytes())
             for t in (r() for r in packed) if t is not None}
    saved = {ptr: v for ptr, v in saved.items() if ptr not in skip}
    loss.backward()
    rows = [shape for shape, _ in saved.values() if shape == (tokens * m.top_k, args.dim)]
    assert len(rows) == 1, sorted(saved.values())  # the dispatched rows only
    shape = MoEShape(layer_ids=frozenset(), num_experts=m.num_experts, top_k=m.top_k,
                     hidden=m.hidden_dim, shared_hidden=m.num_shared_experts * m.hidden_dim,
                     groups=m.num_expert_groups, sharded=0, replicated=0, experts=0, tensors=0,
                     linears=(), route_norm=m.route_norm)
    planned = moe_activation_extra(shape, "none", dim=args.dim, a=dtype.itemsize)
    measured = sum(n for _, n in saved.values()) / tokens
    # what the planner leaves out: the [E] int32 expert counts (4 E / T bytes a token)
    assert abs(planned + 4 * m.num_experts / tokens - measured) <= 1e-3 * measured, (
        planned, measured)
