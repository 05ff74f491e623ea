"""Recompute without re-dispatch (``[activation_checkpoint] keep_all_to_all``) through the trainer
(debugmoe: block 0 dense, blocks 1 and 2 MoE; fp32, 4 gloo ranks, one spawn):

- ep = 2 over FSDP 4 (flat dispatch), ep = 4 as 2 "nodes" x 2 (two-level dispatch, two hot-expert
  copies), and ep = 2 inside pipeline stages (1F1B; DualPipe, whose split backward recomputes
  every block twice and so replays the tape twice): the losses, gradient norms and parameters
  after 2 steps are bitwise those of full AC, and follow one process
  (tests/multiprocess/test_expert_parallel.py's reference and bounds);
- the token all-to-alls per MoE layer and micro-batch fall from 6 (forward dispatch + combine,
  the recompute's two, the backward's two) to 4, and the count exchanges (each a device-to-host
  sync) from 2 to 1 (DualPipe: fewer, counted per direction elsewhere);
- with expert_parallel_comm_overlap (DualPipeV, pp 2 x ep 2), whose recompute runs on the other
  side's thread: bitwise full AC, with and without the overlap;
- recompute by module (``mode = "modules"``, every part debugmoe has) on the two-level and the
  pipeline layouts, and with the overlap: bitwise full AC (itself bitwise no AC), with the
  all-to-alls and count exchanges of keep_all_to_all (no collective runs twice);
- recompute by module with the first block of each 1F1B stage fully checkpointed
  (``full_blocks = 1`` with keep_all_to_all): bitwise full AC, the all-to-alls of keep_all_to_all;
  with one count per stage (``full_blocks = [0, 1]``): bitwise, and stage 1's ranks re-dispatch
  as full AC does, stage 0's not;
- DeepSeek-V3's choice on debugdeepseek (MLA's up-projections through RoPE, the weighted
  SwiGLU, norms, shared experts) in DualPipe stages over pp 2 x ep 2, also with each stage's
  first block fully checkpointed (``full_blocks = 1``, re-dispatching): bitwise no AC.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import test_expert_parallel as _ep
from tests.multiprocess.test_expert_parallel import STEPS, _assert_matches
from tests.spawn import run_distributed

P = "--parallelism."
FULL = ["--activation_checkpoint.mode=full"]
KEEP = [*FULL, "--activation_checkpoint.keep_all_to_all=true"]
MODULES = ["--activation_checkpoint.mode=modules",
           "--activation_checkpoint.recompute_modules=layernorm,core_attn,moe_act,mlp,"
           "shared_experts"]
# float8 storage of the three inputs, with recompute by module, on the 1F1B layout: within the
# measured float8 error of full AC (the first step's loss is bitwise: only gradients change)
F8_STORE = [*MODULES, "--activation_checkpoint.float8_storage=expert_up_proj_input,"
            "attention_out_input,expert_act_input"]
F8_LOSS_RTOL, F8_PARAM_RTOL = 2e-4, 2.5e-2
# recompute by module with each stage's first block fully checkpointed (full_blocks = 1, and
# keep_all_to_all for those), on the 1F1B layout: stage 0's dense block 0 full and MoE block 1
# by module, stage 1's MoE block 2 full; bitwise full AC, nothing sent twice
MIXED = [*MODULES, "--activation_checkpoint.full_blocks=1",
         "--activation_checkpoint.keep_all_to_all=true"]
# one count per stage (0 on stage 0, 1 on stage 1: MoE block 2 full, re-dispatching): bitwise,
# and stage 1's ranks send what full AC sends, stage 0's what keep_all_to_all sends
MIXED_LIST = [*MODULES, "--activation_checkpoint.full_blocks=0,1"]
# DeepSeek-V3's choice on MLA (debugdeepseek) inside DualPipe stages (pp 2 x ep 2; its split
# backward recomputes each region twice): mla_up_proj recomputes q, k, v through RoPE, moe_act the
# weighted SwiGLU; bitwise no AC
DEEPSEEK = {"none": ["--model.flavor=debugdeepseek", "--activation_checkpoint.mode=none"],
            "modules": ["--model.flavor=debugdeepseek", "--activation_checkpoint.mode=modules",
                        "--activation_checkpoint.recompute_modules=layernorm,mla_up_proj,"
                        "moe_act,shared_experts"]}
# and with each DualPipe stage's first block fully checkpointed (stage 0: dense block 0 full, MoE
# block 1 by module; stage 1: MoE block 2 full, its recompute dispatching again): bitwise no AC
DEEPSEEK["mixed"] = [*DEEPSEEK["modules"], "--activation_checkpoint.full_blocks=1"]
# name: (overrides, micro-batches per step, MoE layers on rank 0 x dispatch levels), global
# batch 8; DualPipe's two directions are left to the ratio check
LAYOUTS = {
    "ep2_x_fsdp4": (["--training.local_batch_size=2", P + "expert_parallel_degree=2"], 1, 2),
    "ep4_two_level_rep2": (["--training.local_batch_size=2", P + "expert_parallel_degree=4",
                            P + "expert_parallel_dispatch=two_level",
                            P + "expert_parallel_ranks_per_node=2",
                            "--moe.replicate_hot_experts=2"], 1, 2 * 2),
    "pp2_x_ep2_1F1B": (["--training.local_batch_size=4", P + "expert_parallel_degree=2",
                        P + "pipeline_parallel_degree=2", P + "pipeline_parallel_schedule=1F1B",
                        P + "pipeline_parallel_microbatches=4"], 4, 1),
    "pp2_dualpipe_x_ep2": (["--training.local_batch_size=4", P + "expert_parallel_degree=2",
                            P + "pipeline_parallel_degree=2",
                            P + "pipeline_parallel_schedule=DualPipe"], None, None),
}


def _train(rank: int, world_size: int, folder: str) -> dict:
    """{case: (losses, grad norms, this rank's full params, token all-to-alls, count exchanges)}."""
    from titanext.plugins.expert_parallel import count_comm

    out = {}
    for layout, (overrides, _, _) in LAYOUTS.items():
        modules = (("modules", MODULES),) if layout != "ep2_x_fsdp4" else ()
        modules += ((("f8", F8_STORE), ("mixed", MIXED), ("mixed_list", MIXED_LIST))
                    if layout == "pp2_x_ep2_1F1B" else ())
        for ac, extra in (("full", FULL), ("keep", KEEP), *modules):
            name = f"{layout}_{ac}"
            with count_comm() as cc:  # around test_expert_parallel's own counter
                got = _ep._train(rank, world_size, {name: [*overrides, *extra]}, folder)[name]
            out[name] = (*got[:3], cc.all_to_alls, cc.count_exchanges)
    dualpipe = LAYOUTS["pp2_dualpipe_x_ep2"][0]
    for ac, extra in DEEPSEEK.items():
        name = f"deepseek_dualpipe_{ac}"
        out[name] = _ep._train(rank, world_size, {name: [*dualpipe, *extra]}, folder)[name][:3]
    return out, _overlap(rank, world_size, f"{folder}/overlap")


def _overlap(rank: int, world_size: int, folder: str) -> list:
    """expert_parallel_comm_overlap (DualPipeV, 4 micro-batches, debugmoe with 4 blocks): the
    backward's recompute replays on the other side's thread. Full AC, then keep_all_to_all
    without and with the overlap, then recompute by module with it: (losses, params, handovers,
    token all-to-alls) each."""
    from tests.multiprocess.test_ep_overlap import BASE as OVERLAP_BASE
    from tests.multiprocess.test_ep_overlap import CASES as OVERLAP_CASES
    from tests.multiprocess.test_ep_overlap import ON, _with_flavor

    case = [a for a in OVERLAP_CASES["DualPipeV_full_ac"] if not a.startswith("--activation")]
    from titanext.plugins.expert_parallel import count_comm

    out = []
    for i, ac in enumerate((FULL, KEEP, [*KEEP, ON], [*MODULES, ON])):
        with count_comm() as cc:
            got, = _with_flavor(rank, world_size, [[*OVERLAP_BASE, *case, *ac]], f"{folder}/{i}")
        out.append((*got, cc.all_to_alls))
    return out


moe_reference = _ep.moe_reference  # the one-process reference runs (a module-scoped fixture)


@pytest.mark.slow
def test_recompute_without_redispatch(moe_reference, tmp_path):  # noqa: F811
    per_rank = run_distributed(_train, 4, args=(str(tmp_path),), timeout_s=300)
    for rank, (_, (full, keep, overlapped, modules)) in enumerate(per_rank):  # bitwise
        assert full[0] == keep[0] == overlapped[0] == modules[0] and len(full[0]) == 2, (
            full[0], keep[0], overlapped[0], modules[0])
        bad = [k for k in full[1] if not (torch.equal(full[1][k], keep[1][k])
                                          and torch.equal(keep[1][k], overlapped[1][k])
                                          and torch.equal(keep[1][k], modules[1][k]))]
        assert not bad and overlapped[2] > 0 and keep[2] == 0, (rank, bad, overlapped[2])
        assert overlapped[3] == keep[3] == modules[3] and 4 * full[3] == 6 * keep[3], (
            full[3], keep[3], overlapped[3], modules[3])
    per_rank = [trained for trained, _ in per_rank]
    for rank, got in enumerate(per_rank):  # MLA and the weighted SwiGLU recomputed: bitwise
        none = got["deepseek_dualpipe_none"]
        for case in ("modules", "mixed"):
            mod = got[f"deepseek_dualpipe_{case}"]
            assert none[:2] == mod[:2] and len(none[0]) == 2, (rank, case, none[:2], mod[:2])
            bad = [n for n in none[2] if not torch.equal(none[2][n], mod[2][n])]
            assert not bad, f"debugdeepseek DualPipe {case} rank {rank}: parameters differ: {bad}"
    counts = {}
    for rank, got in enumerate(per_rank):
        for layout, (_, microbatches, n_moe) in LAYOUTS.items():
            full, keep = got[f"{layout}_full"], got[f"{layout}_keep"]
            assert full[0] == keep[0] and full[1] == keep[1], (layout, full[:2], keep[:2])
            bad = [n for n in full[2] if not torch.equal(full[2][n], keep[2][n])]
            assert not bad, f"{layout} rank {rank}: parameters differ from full AC: {bad}"
            if f"{layout}_f8" in got:  # float8 storage: the measured float8 error
                f8 = got[f"{layout}_f8"]
                assert f8[0][0] == full[0][0] and f8[3:] == keep[3:], (layout, f8, full)
                torch.testing.assert_close(torch.tensor(f8[0]), torch.tensor(full[0]),
                                           rtol=F8_LOSS_RTOL, atol=0)
                worst = max(((f8[2][n] - p).norm() / p.norm()).item() for n, p in full[2].items())
                print(f"float8 storage {layout} rank {rank}: losses {f8[0]} vs {full[0]}, "
                      f"grad norms {f8[1]} vs {full[1]}, worst parameter relative error "
                      f"{worst:.2e}")
                assert 0 < worst < F8_PARAM_RTOL, (layout, rank, worst)
            for case in ("modules", "mixed"):  # by module (some blocks full): bitwise, nothing
                if f"{layout}_{case}" not in got:  # sent twice
                    continue
                mod = got[f"{layout}_{case}"]
                assert full[:2] == mod[:2] and mod[3:] == keep[3:], (layout, case, full, mod, keep)
                bad = [n for n in full[2] if not torch.equal(full[2][n], mod[2][n])]
                assert not bad, f"{layout} rank {rank}: {case}' parameters differ: {bad}"
            if f"{layout}_mixed_list" in got:  # each stage its own count (ranks 2, 3: stage 1)
                mod = got[f"{layout}_mixed_list"]
                assert full[:2] == mod[:2] and mod[3:] == (full if rank >= 2 else keep)[3:], (
                    layout, rank, full, mod, keep)
                bad = [n for n in full[2] if not torch.equal(full[2][n], mod[2][n])]
                assert not bad, f"{layout} rank {rank}: mixed_list's parameters differ: {bad}"
            assert 0 < keep[3] < full[3] and 0 < keep[4] < full[4], (layout, full, keep)
            # every recompute full AC ran issued the forward's count exchange(s) and its two
            # token all-to-alls per level again; with keep_all_to_all no recompute issues any
            recomputes = full[4] - keep[4]
            assert full[3] - keep[3] == 2 * recomputes, (layout, rank, full[3:], keep[3:])
            if n_moe:  # per MoE layer, micro-batch (and level); a pipeline's start-up adds one
                per = n_moe * microbatches * STEPS  # forward per stage (the last one's with
                extra = keep[3] - 4 * per  # its backward: 2 or 4 more)
                assert recomputes >= per and 0 <= extra <= (4 * n_moe if "pp2" in layout else 0), (
                    layout, rank, full[3:], keep[3:], per)
                if rank == 0:
                    counts[layout] = ((full[3] - extra) / per, (keep[3] - extra) / per)
    assert counts == {k: (6.0, 4.0) for k in counts}, counts
    for layout in LAYOUTS:  # pipeline stages: rank 0 holds stage 0's parameters, rank 2 stage 1's
        got = per_rank[0][f"{layout}_keep"]
        params = {**got[2], **(per_rank[2][f"{layout}_keep"][2] if "pp2" in layout else {})}
        _assert_matches((got[0], got[1], params), moe_reference["ref"], f"{layout}_keep")


# -- the layer: a 2-block stack of dispatch / experts / combine, on any device ---------------------

class _Block(torch.nn.Module):
    """tanh, top-1 routing, flat dispatch, one matmul per local expert, combine, weighted by the
    router's score, residual."""

    def __init__(self, dim: int, n_exp: int, group, flip: bool = False):
        super().__init__()
        world = torch.distributed.get_world_size(group)
        self.router = torch.nn.Linear(dim, n_exp)
        self.w = torch.nn.Parameter(torch.randn(n_exp // world, dim, dim) / dim ** 0.5)
        self.group, self.n_exp, self.flip, self.calls = group, n_exp, flip, 0

    def forward(self, x):
        from titanext.plugins.expert_parallel import combine_tokens, dispatch_tokens

        h = torch.tanh(x)
        scores = self.router(h).softmax(-1)
        ids = scores.argmax(-1)
        self.calls += 1
        if self.flip and self.calls > 1:  # a router that is not deterministic
            ids = (ids + 1) % self.n_exp
        order = torch.argsort(ids, stable=True)
        counts = torch.zeros(self.n_exp, dtype=torch.int64, device=x.device).index_add_(
            0, ids, torch.ones_like(ids))
        rows, local, route = dispatch_tokens(h[order], counts, self.group)
        expert = torch.repeat_interleave(torch.arange(local.numel(), device=x.device), local,
                                         output_size=rows.shape[0])
        y = torch.relu(torch.bmm(rows.unsqueeze(1), self.w[expert]).squeeze(1))
        back = torch.zeros_like(h).index_copy(0, order, combine_tokens(y, route))
        return x + back * scores.gather(1, ids.unsqueeze(1))


def layer_run(rank: int, world_size: int, device: str = "cpu", flip: bool = False,
              modes: tuple[str, ...] = ("none", "full", "keep")) -> dict:
    """{mode: (loss, grads, token all-to-alls, count exchanges)} for no AC, full AC and full AC
    with keep_all_to_all, from the same weights and tokens."""
    from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
    from titanext.plugins.expert_parallel import count_comm

    group = torch.distributed.group.WORLD
    out = {}
    for mode in modes:
        keep = mode == "keep"
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(_Block(16, 4, group, flip) for _ in range(2))
        model.to(device)
        apply_activation_checkpointing(model, mode="none" if mode == "none" else "full",
                                       keep_all_to_all=keep)
        torch.manual_seed(1 + rank)
        x = torch.randn(24, 16, device=device, requires_grad=True)
        with count_comm() as cc:
            for layer in model.layers:
                x = layer(x)
            loss = x.square().mean()
            loss.backward()
        out[mode] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()},
                     cc.all_to_alls, cc.count_exchanges)
    return out


def assert_layer_run(out: dict) -> None:
    """Bitwise full AC (and no AC); 6 -> 4 token all-to-alls and 2 -> 1 count exchanges per
    MoE layer (2 here) and micro-batch."""
    for mode in ("full", "keep"):
        assert torch.equal(out[mode][0], out["none"][0]), (mode, out[mode][0], out["none"][0])
        bad = [n for n, g in out[mode][1].items() if not torch.equal(g, out["none"][1][n])]
        assert not bad, (mode, bad)
    assert [out[m][2:] for m in ("none", "full", "keep")] == [(8, 2), (12, 4), (8, 2)], out


def test_layer_replays_what_crossed_the_network():
    for out in run_distributed(layer_run, 2):
        assert_layer_run(out)


def test_a_recompute_that_routes_otherwise_raises():
    with pytest.raises(Exception, match="routes other rows than the forward"):
        run_distributed(layer_run, 2, kwargs={"flip": True, "modes": ("keep",)})


def test_a_received_tensor_written_in_place_raises():
    from titanext.plugins.expert_parallel._comm import CommTape, taped

    tape, x = CommTape(), torch.ones(3)
    with tape.session():
        taped(("tokens",), lambda: x).mul_(2)  # the block writes what it received, in place
    with pytest.raises(RuntimeError, match="modified in place after the forward"), tape.session():
        taped(("tokens",), lambda: x)
