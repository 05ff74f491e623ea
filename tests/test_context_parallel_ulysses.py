"""Ulysses, hybrid Ulysses x ring, and document masking are exact: out, dq, dk and dv match
single-process attention with the equivalent mask (causal within a document, nothing across).

Every rank builds the same full q, k, v, upstream gradient and document ids from a seed, runs the
CP attention on its shard, and compares with the matching shard of ``F.scaled_dot_product_attention``
given the full boolean mask, computed the simplest way (K/V expanded to all heads). One spawn per
world size runs every case of that size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_distributed

SEQ, BATCH, DIM = 48, 2, 8
BOUND = {torch.float64: 1e-10, torch.float32: 1e-5}


def document_ids(seq: int, seed: int = 0) -> torch.Tensor:
    """[2, seq]: row 0 packs random lengths (1 to 11) with every third document of length 1;
    row 1 has one document spanning every rank's chunks (positions 1 .. seq-3)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = 1 if len(lengths) % 3 == 0 else int(torch.randint(1, 12, (), generator=g))
        lengths.append(min(n, seq - total))
        total += lengths[-1]
    row0 = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    row1 = torch.repeat_interleave(torch.arange(4), torch.tensor([1, seq - 3, 1, 1]))
    return torch.stack([row0, row1])


def _inputs(heads, kv_heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, DIM, generator=g, dtype=dtype)
    k = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g, dtype=dtype)
    v = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g, dtype=dtype)
    dout = torch.randn(BATCH, heads, SEQ, DIM, generator=g, dtype=dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, docs):
    """Full attention with the equivalent boolean mask, one process."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    mask = torch.ones(BATCH, SEQ, SEQ, dtype=torch.bool)
    if docs is not None:
        mask &= docs[:, :, None] == docs[:, None, :]
    if causal:
        mask &= torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask[:, None])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _groups(world, ulysses):
    """(Ulysses group, ring group) of this rank: cp rank = ring_rank * u + ulysses_rank."""
    ring = world // ulysses
    mine_u = mine_r = None
    for j in range(ring):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(j * ulysses, (j + 1) * ulysses)))
        if dist.get_rank() // ulysses == j:
            mine_u = g
    for i in range(ulysses):
        g = dist.new_group(list(range(i, world, ulysses)))
        if dist.get_rank() % ulysses == i:
            mine_r = g
    return mine_u, (mine_r if ring > 1 else None)


def _errors(case, groups):
    """Max relative error of (out, dq, dk, dv) of one case on this rank."""
    from titanext.plugins.context_parallel import (
        hybrid_attention,
        ring_attention,
        shard_sequence,
        ulysses_attention,
    )
    from titanext.plugins.context_parallel import _ring as ring_module

    kind, (heads, kv_heads), layout, comm, causal, with_docs, dtype, kernel, tile = case
    ring_module._DOC_TILE = tile
    full = _inputs(heads, kv_heads, dtype)
    docs = document_ids(SEQ) if with_docs else None
    ref = _reference(*full, causal, docs)
    world = dist.group.WORLD
    q, k, v, dout = (shard_sequence(t, 2, world, layout).clone() for t in full)
    ids = None if docs is None else shard_sequence(docs, 1, world, layout)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if kind == "ring":
        out = ring_attention(q, k, v, world, causal=causal, layout=layout, comm=comm,
                             kernel=kernel, document_ids=ids)
    elif kind == "ulysses":
        out = ulysses_attention(q, k, v, world, causal=causal, layout=layout, kernel=kernel,
                                document_ids=ids)
    else:
        out = hybrid_attention(q, k, v, *groups, causal=causal, layout=layout, comm=comm,
                               kernel=kernel, document_ids=ids)
    out.backward(dout)
    got = [out.detach(), q.grad, k.grad, v.grad]
    assert all(torch.isfinite(t).all() for t in got)
    mine = [shard_sequence(t, 2, world, layout) for t in ref]
    return [_rel(a, b) for a, b in zip(got, mine)]


def _cases(world):
    """(kind, (heads, kv_heads), layout, comm, causal, documents, dtype, kernel, doc tile)."""
    cases = []
    for layout in ("zigzag", "contiguous"):
        for dtype in (torch.float64, torch.float32):
            math = "math" if dtype == torch.float64 else "auto"
            cases += [("ring", (4, 2), layout, "p2p", True, True, dtype, "auto", 1024),
                      ("ring", (4, 2), layout, "allgather", True, True, dtype, "auto", 5),
                      ("ring", (4, 2), layout, "p2p", True, True, dtype, math, 5),
                      ("ring", (4, 2), layout, "p2p", False, True, dtype, "auto", 1024)]
            if world in (2, 4):
                heads = [(4, 2), (8, 2), (4, 1)] if world == 4 else [(4, 2), (4, 4), (4, 1)]
                cases += [("ulysses", hk, layout, "p2p", True, True, dtype, "auto", 7)
                          for hk in heads]
                cases += [("ulysses", (4, 2), layout, "p2p", True, False, dtype, "auto", 7),
                          ("ulysses", (4, 2), layout, "p2p", False, True, dtype, math, 1024)]
            if world == 4:
                cases += [("hybrid", (4, 2), layout, "p2p", True, False, dtype, "auto", 6),
                          ("hybrid", (4, 2), layout, "p2p", True, True, dtype, "auto", 6),
                          ("hybrid", (4, 2), layout, "allgather", True, True, dtype, "auto", 6),
                          ("hybrid", (8, 1), layout, "p2p", True, True, dtype, math, 1024)]
    return cases


def _body(rank, world_size):
    torch.set_num_threads(1)
    groups = _groups(world_size, 2) if world_size == 4 else (None, None)
    return {case: _errors(case, groups) for case in _cases(world_size)}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def errors(request):
    world = request.param
    per_rank = run_distributed(_body, world, timeout_s=120)
    return {c: [max(r[c][i] for r in per_rank) for i in range(4)] for c in _cases(world)}


def _name(case):
    kind, (h, kvh), layout, comm, causal, docs, dtype, kernel, tile = case
    return (f"{kind}-h{h}kv{kvh}-{layout}-{comm}-{'causal' if causal else 'full'}"
            f"-{'docs' if docs else 'nodocs'}-{str(dtype)[6:]}-{kernel}-tile{tile}")


def test_out_and_grads_match_full_attention_with_the_document_mask(errors):
    bad = {_name(c): dict(zip(("out", "dq", "dk", "dv"), e)) for c, e in errors.items()
           if max(e) > BOUND[c[6]]}
    assert not bad, bad


def test_document_ids_cover_the_required_shapes():
    docs = document_ids(SEQ)
    lengths = torch.unique_consecutive(docs[0], return_counts=True)[1]
    assert (lengths == 1).sum() >= 2 and lengths.sum() == SEQ
    assert torch.unique_consecutive(docs[1], return_counts=True)[1].max() == SEQ - 3
