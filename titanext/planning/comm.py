"""Communication per rank and step: one row per parallelism (bytes, collectives, link level).

Model-parallel traffic (TP/SP collectives, CP's ring or all-gather, EP's all-to-alls, PP's
point-to-point sends) sits on a micro-batch's critical path, so :func:`model_parallel_comm`
also adds its exposed time to the micro-batch's forward (F) and input-gradient (I) times.
Data-parallel traffic (FSDP all-gathers and reduce-scatters, HSDP all-reduce, ZeRO-1) overlaps
the step's compute (:func:`data_parallel_comm`; :mod:`~titanext.planning.estimate` counts what
is left exposed). Each row's time is alpha-beta: a latency per collective plus bytes over the
link (:func:`comm_time`).
"""

from __future__ import annotations

import dataclasses

from titanext.planning.hardware import Device
from titanext.planning.layout import Layout
from titanext.planning.memory import state_elements
from titanext.planning.moe import (
    all_to_all_bytes,
    destination_nodes,
    expert_copy_bytes,
    row_bytes,
    two_level_bytes,
)
from titanext.planning.muon import ns_element_bytes
from titanext.planning.roofline import MicrobatchTime
from titanext.planning.stages import RankStages

__all__ = ["comm_time", "context_parallel_comm", "data_parallel_comm", "expert_copies_comm",
           "model_parallel_comm"]


def comm_time(c: dict, device: Device) -> float:
    """alpha-beta time of a communication row: latency per collective plus bytes over the link."""
    inter = c["level"] == "inter-node"
    return (c["collectives"] * (device.inter_latency if inter else device.intra_latency)
            + c["bytes"] / (device.inter_bw if inter else device.intra_bw))


def model_parallel_comm(lo: Layout, device: Device, rank: RankStages, mt: MicrobatchTime, *,
                        imbalance: float = 1.0) -> tuple[list[dict], MicrobatchTime, float]:
    """(TP / CP / EP / PP rows, ``mt`` with their exposed time added, one p2p send's time).

    ``imbalance`` (max / mean routed rows per ep rank, >= 1) scales the all-to-all bytes of the
    busiest ep rank, which every rank waits for. The EP row also carries one micro-batch's
    all-to-all seconds in its F and in its I (``a2a_f_s``, ``a2a_i_s``), which the pipeline
    simulation may hide behind the paired chunk (``expert_parallel_comm_overlap``)."""
    shape, moe, tp, cp, ep, pp, a = lo.shape, lo.shape.moe, lo.tp, lo.cp, lo.ep, lo.pp, lo.a
    tokens, passes, sp = lo.tokens, lo.passes, lo.sp
    comm = []
    if tp > 1:
        tp_fwd = 4 if sp else 2  # SP: 2 all-gathers + 2 reduce-scatters per block
        tp_bytes = tokens * shape.dim * a * (tp - 1) / tp * (1 if sp else 2)  # per collective
        n_f = tp_fwd * rank.layers
        n_i = n_f + tp_fwd * lo.full_ac_blocks(rank)  # backward (+ the recomputed forwards')
        c = {"parallelism": "TP/SP" if sp else "TP", "collectives": (n_f + n_i) * passes,
             "bytes": (n_f + n_i) * tp_bytes * passes, "level": lo.level(1, tp),
             "overlap": "none"}
        comm.append(c)
        one = comm_time({**c, "collectives": 1, "bytes": tp_bytes}, device)
        mt = dataclasses.replace(mt, f=mt.f + n_f * one, i=mt.i + n_i * one)
    if cp > 1:
        rows, exposed_f, exposed_i = context_parallel_comm(lo, rank, device, mt.attention_f)
        comm += rows
        mt = dataclasses.replace(mt, f=mt.f + exposed_f, i=mt.i + exposed_i)
    r = lo.recipe
    if ep > 1 and lo.n_moe(rank) and (r.ep_dispatch != "flat" or r.ep_float8_dispatch):
        rows, mt = expert_dispatch_comm(lo, device, rank, mt, imbalance)
        comm += rows
    elif ep > 1 and lo.n_moe(rank):
        # dispatch + combine forward, again backward (and in the recompute); one count exchange
        # per dispatch; on the critical path (the MoE waits for its tokens)
        n_f = 2 * lo.n_moe(rank)
        n_i = n_f + 2 * lo.recomputed_moe(rank)
        one = all_to_all_bytes(tokens, dim=shape.dim, top_k=moe.top_k, ep=ep, a=a) * imbalance
        counts = lo.n_moe(rank) + lo.recomputed_moe(rank)  # once per dispatch
        overlapped = r.ep_comm_overlap
        c = {"parallelism": "EP all-to-all", "collectives": (n_f + n_i + counts) * passes,
             "bytes": (n_f + n_i) * one * passes, "level": lo.level(tp, ep),
             "overlap": "paired chunk" if overlapped else "none"}
        comm.append(c)
        t_one = comm_time({**c, "collectives": 1, "bytes": one}, device)
        c["a2a_f_s"], c["a2a_i_s"] = n_f * t_one, n_i * t_one
        mt = dataclasses.replace(mt, f=mt.f + n_f * t_one, i=mt.i + n_i * t_one)
    copies = r.expert_replicas
    if lo.n_moe(rank) and copies:  # hot-expert copies: weights out, gradients back
        rows, mt = expert_copies_comm(lo, device, rank, mt, copies)
        comm.append(rows)
    p2p = 0.0
    if pp > 1:
        send = tokens * shape.dim * a / (tp if sp else 1)  # one block-boundary activation
        c = {"parallelism": f"PP p2p ({lo.pipe.name})", "collectives": rank.sends * passes,
             "bytes": rank.sends * passes * send, "level": lo.level(lo.strides["pp"], pp),
             "overlap": "in the schedule"}
        comm.append(c)
        p2p = comm_time({**c, "collectives": 1, "bytes": send}, device)
    return comm, mt, p2p


def expert_dispatch_comm(lo: Layout, device: Device, rank: RankStages, mt: MicrobatchTime,
                         imbalance: float) -> tuple[list[dict], MicrobatchTime]:
    """The EP all-to-all rows of float8 and two-level dispatch (flat bf16: the plain row of
    :func:`model_parallel_comm`) and ``mt`` with their time.

    Per MoE block and micro-batch: F runs the dispatch (float8 rows, with the routing under
    two-level) and the combine; I runs their backwards (rows in the activations' dtype; the
    dispatch's backward returns the routing weights' gradients too) and, under full AC, the
    recomputed dispatch and combine. Two-level dispatch gives two rows: "EP all-to-all" (the
    network part: each token once per destination node) and "EP all-to-all intra-node" (the
    fan-out to the experts inside the node), both on the critical path; the first carries the
    micro-batch's all-to-all seconds of both (``a2a_f_s``, ``a2a_i_s``)."""
    r, shape, moe, a, tp, ep = lo.recipe, lo.shape, lo.shape.moe, lo.a, lo.tp, lo.ep
    n_moe, n_re, passes = lo.n_moe(rank), lo.recomputed_moe(rank), lo.passes
    row = row_bytes(shape.dim, a)
    disp_row = row_bytes(shape.dim, a, r.ep_float8_dispatch)
    if r.ep_dispatch == "flat":  # one level; one all-to-all each
        def sizes(r: float, routing: bool) -> list[tuple[float, int]]:
            return [(all_to_all_bytes(lo.tokens, dim=1, top_k=moe.top_k, ep=ep, a=1) * r
                     * imbalance, 1)]
        names = [("EP all-to-all", lo.level(tp, ep))]
        exchanges = [1]
    else:  # network (rows, and the routing beside a dispatch's), then NVLink
        rpn = r.ep_ranks_per_node
        if rpn < 1 or ep % rpn or ep == rpn:  # the config rules refuse it (the advice skips it)
            raise ValueError(f"two-level dispatch: ep = {ep} does not split into nodes of "
                             f"expert_parallel_ranks_per_node = {rpn}")
        nodes = ep // rpn

        def sizes(r: float, routing: bool) -> list[tuple[float, int]]:
            far, near = two_level_bytes(lo.tokens, row=r, top_k=moe.top_k, nodes=nodes,
                                        ranks_per_node=rpn, routing=routing,
                                        dest_nodes=destination_nodes(moe, nodes))
            return [(far * imbalance, 2 if routing else 1), (near * imbalance, 1)]
        names = [("EP all-to-all", lo.level(tp * rpn, nodes)),
                 ("EP all-to-all intra-node", lo.level(tp, rpn))]
        exchanges = [1, 1]
    # (bytes, collectives) per level of: dispatch, combine, and their backwards
    fwd_disp, fwd_comb = sizes(disp_row, True), sizes(row, False)
    bwd_disp, bwd_comb = sizes(row, True), sizes(row, False)
    f_parts = [fwd_disp, fwd_comb]
    i_parts = [bwd_comb, bwd_disp]  # and in the n_re blocks recomputed: the forward's again
    rows, t_f, t_i = [], 0.0, 0.0
    overlap = "paired chunk" if r.ep_comm_overlap else "none"
    for lvl, ((name, level), counts) in enumerate(zip(names, exchanges, strict=True)):
        c = {"parallelism": name, "level": level, "overlap": overlap,
             "collectives": passes * (n_moe * (counts + sum(part[lvl][1]
                                                            for part in f_parts + i_parts))
                                      + n_re * (counts + sum(part[lvl][1] for part in f_parts))),
             "bytes": passes * sum(part[lvl][0] * n for parts, n in ((f_parts + i_parts, n_moe),
                                                                     (f_parts, n_re))
                                   for part in parts)}
        rows.append(c)
        for parts, n, is_f in ((f_parts, n_moe, True), (i_parts, n_moe, False),
                               (f_parts, n_re, False)):
            t = n * sum(comm_time({**c, "collectives": part[lvl][1], "bytes": part[lvl][0]},
                                  device) for part in parts)
            t_f, t_i = (t_f + t, t_i) if is_f else (t_f, t_i + t)
    rows[0]["a2a_f_s"], rows[0]["a2a_i_s"] = t_f, t_i
    return rows, dataclasses.replace(mt, f=mt.f + t_f, i=mt.i + t_i)


def expert_copies_comm(lo: Layout, device: Device, rank: RankStages, mt: MicrobatchTime,
                       copies: int) -> tuple[dict, MicrobatchTime]:
    """The "EP expert copies" row of ``[moe] replicate_hot_experts`` and ``mt`` with its time.

    Per MoE block and optimizer step (the copies are fixed, sent and returned once per step:
    :func:`~titanext.plugins.expert_parallel.replication.copies_per_step`) a rank sends at most
    ``copies`` experts' weights (the step's first forward; recomputes and later micro-batches
    reuse them) and, hosting copies, at most ``copies`` summed gradients back (the step's last
    backward): the bound the dry run measures (``expert_replication.nominal_plan``). On the
    critical path, like the token all-to-alls; its time is spread over the step's micro-batches
    in ``mt`` (F: the weights, I: the gradients).
    """
    moe, a, passes = lo.shape.moe, lo.a, lo.passes
    one = expert_copy_bytes(moe.experts, moe.num_experts, copies=copies, a=a)
    n = lo.n_moe(rank)  # one weights all-to-all and one gradients all-to-all per block and step
    c = {"parallelism": f"EP expert copies (replicate_hot_experts = {copies})",
         "collectives": 2 * n, "bytes": 2 * n * one,
         "level": lo.level(lo.tp, lo.ep), "overlap": "none"}
    t_one = comm_time({**c, "collectives": 1, "bytes": one}, device)
    return c, dataclasses.replace(mt, f=mt.f + n * t_one / passes, i=mt.i + n * t_one / passes)


def context_parallel_comm(lo: Layout, rank: RankStages, device: Device, attention_f: float
                          ) -> tuple[list[dict], float, float]:
    """CP rows of one pp rank's step, and the time they add to a micro-batch's F and I.

    With u Ulysses ranks and r = cp / u ring ranks (u = 1: ring; u = cp: Ulysses), per layer
    and micro-batch, ``forwards`` = 2 with full AC (the recompute repeats the forward's), else 1:

    - Ulysses: one all-to-all of q, k, v (kv heads replicated up to u when fewer) and one of the
      output per forward, the same two (dout in, dq/dk/dv back) in backward; each moves
      (u-1)/u of its buffer. It sits on the critical path (nothing computes meanwhile).
    - ring (p2p): r-1 K/V blocks per forward; in backward r-1 K/V blocks again and r dK/dV
      accumulators (fp32, or the input's dtype if wider: each travels behind its block and
      goes home at the end), overlapped with the attention blocks. allgather: one all-gather
      of K/V per forward, again in backward, and one reduce-scatter of dK/dV (bytes on the
      wire: (r-1)/r of the gathered or scattered buffer). After Ulysses the ring's blocks hold
      u times the tokens for 1/u of the heads.
    - document masking adds one all-gather of the int64 document ids per forward and group.

    Counted against the attention's own counter (``count_comm``) in
    tests/multiprocess/test_plan_cp.py.
    """
    shape, a, tp, cp, u = lo.shape, lo.a, lo.tp, lo.cp, lo.ulysses
    r, tokens, passes = cp // u, lo.tokens, lo.passes
    forwards = 1 + lo.full_ac_blocks(rank) / max(1, rank.layers)  # (a share: full_blocks)
    head_dim = shape.dim // shape.n_heads
    heads, kv_heads = shape.n_heads // tp, shape.kv_dim // head_dim // tp
    sent_kv = max(kv_heads, u)  # replicated so that every Ulysses rank holds its q heads' kv
    docs = lo.cfg.training.document_masking
    calls = rank.layers * passes  # attention calls of this rank per step
    rows, exposed_f, exposed_i = [], 0.0, 0.0
    if u > 1:
        frac = (u - 1) / u  # the all-to-all keeps 1/u of its buffer on the rank
        fwd = a * frac * tokens * head_dim * (2 * heads + 2 * sent_kv)  # q, k, v in; out back
        c = {"parallelism": f"CP Ulysses all-to-all (u = {u})",
             "collectives": calls * (2 * forwards + 2 + (forwards if docs else 0)),
             "bytes": calls * (fwd * (forwards + 1) + (forwards * 8 * tokens * (u - 1)
                                                       if docs else 0)),
             "level": lo.level(tp, u), "overlap": "none"}
        rows.append(c)
        one = comm_time({**c, "collectives": 2, "bytes": fwd}, device)  # one forward's pair
        exposed_f, exposed_i = rank.layers * one, rank.layers * one * forwards
    if r > 1:
        kv = 2 * tokens * u * head_dim * sent_kv / u  # K and V elements of a ring block
        rounds = (r - 1) * forwards
        ring = lo.recipe.cp_comm != "allgather"
        name = lo.recipe.cp_comm  # p2p or allgather (alltoall has no ring: r = 1)
        grad = max(a, 4)  # the dK/dV accumulators' bytes per element
        c = {"parallelism": f"CP ring {name} (r = {r})" if u > 1 else f"CP ({name})",
             "collectives": calls * ((rounds + (r - 1) + r) if ring else forwards + 2)
             + (calls * forwards if docs else 0),
             # K/V blocks forward; K/V again and the dK/dV accumulators backward
             "bytes": calls * (kv * (rounds * a + (r - 1) * a + (r if ring else r - 1) * grad)
                               + (forwards * 8 * tokens * u * (r - 1) if docs else 0)),
             "level": lo.level(tp * u, r), "overlap": "attention"}
        rows.append(c)
        hidden = attention_f * (1 + 2.5 + (forwards - 1))
        exposed_i += max(0.0, comm_time(c, device) / passes - hidden)
    return rows, exposed_f, exposed_i


def data_parallel_comm(lo: Layout, rank: RankStages, psi_dense: float,
                       psi_experts: float) -> list[dict]:
    """FSDP / HSDP / ZeRO-1 rows of the busiest pp rank (its dense and expert parameters)."""
    n_fsdp, rep, ep, accum, a = lo.n_fsdp, lo.rep, lo.ep, lo.accum, lo.a
    psi = psi_dense + psi_experts
    units = rank.layers + 1
    comm = []
    if n_fsdp > 1 and lo.fsdp:
        gathers = 2 if lo.reshard else 1  # ZeRO-2 never reshards
        frac = (n_fsdp - 1) / n_fsdp
        per_element = lo.gathered_per_element * gathers + lo.reduce_bytes
        dense_only = psi_experts and ep > 1  # experts have their own FSDP group
        comm.append({"parallelism": "FSDP (dp_shard x cp)",
                     "collectives": units * (gathers + 1) * accum,
                     "bytes": (psi_dense if dense_only else psi) * frac * per_element * accum,
                     "level": lo.level(lo.strides["dp_shard"], n_fsdp), "overlap": "compute"})
        n_e = n_fsdp // ep
        if dense_only and n_e > 1:
            comm.append({"parallelism": "FSDP experts (dp_shard x cp / ep)",
                         "collectives": lo.n_moe(rank) * (gathers + 1) * accum,
                         "bytes": psi_experts * (n_e - 1) / n_e * (a * gathers + lo.reduce_bytes)
                         * accum,
                         "level": lo.level(lo.tp * ep, n_e), "overlap": "compute"})
    if rep > 1 and lo.fsdp:
        comm.append({"parallelism": "HSDP all-reduce (dp_replicate)",
                     "collectives": units * accum,
                     "bytes": 2 * (rep - 1) / rep * lo.reduce_bytes * accum
                     * state_elements(lo, psi_dense, psi_experts, n_fsdp),
                     "level": lo.level(lo.strides["dp_replicate"], rep), "overlap": "compute"})
    if lo.zero1:
        d = lo.dp * lo.cp  # DDP all-reduce once per step, then the sharded optimizer's gather
        comm.append({"parallelism": "DP all-reduce + ZeRO-1 gather", "collectives": 2 * units,
                     "bytes": (2 * lo.reduce_bytes + 4) * (d - 1) / d * psi,
                     "level": lo.level(lo.tp, d), "overlap": "compute"})
    comm += _muon_comm(lo, rank, psi_experts)
    return comm


def _muon_comm(lo: Layout, rank: RankStages, psi_experts: float) -> list[dict]:
    """Muon's owner exchange (titanext.components.muon): each rank sends the pieces of the
    matrices it does not own to their owners and gets the orthogonalized ones back, two
    all-to-alls per step over the n ranks holding distinct pieces (dp_shard x cp x tp), in the
    Newton-Schulz dtype. Replicas (HSDP) receive their copy too: not counted. Matches the owner
    plan's bytes for the debug model on 4 ranks (benchmarks/muon.py: 14.16 MB in all). It runs
    inside the optimizer step, after the backward: nothing hides it ("overlap": "optimizer
    step", which :func:`titanext.planning.estimate.step_time` adds whole)."""
    o = lo.cfg.optimizer
    if o.name != "Muon" or o.muon_params is not None:  # custom globs: not modelled
        return []
    shape, moe, n_m = lo.shape, lo.shape.moe, lo.n_moe(rank)
    matrices = (rank.layers - n_m) * shape.layer_sharded / lo.tp + (
        n_m * moe.sharded / lo.tp if moe else 0.0)
    n = (lo.n_fsdp if lo.fsdp else lo.zero_n if lo.zero1 else 1) * lo.tp
    if n <= 1:
        return []
    size = ns_element_bytes(lo)
    pieces = state_elements(lo, matrices, psi_experts, lo.n_fsdp if lo.fsdp else 1)
    return [{"parallelism": "Muon owners (gather + scatter)", "collectives": 2,
             "bytes": 2 * pieces * (n - 1) / n * size,
             "level": lo.level(1, n), "overlap": "optimizer step"}]
