"""No rank left waiting, on the docs' own-model pipeline recipe: ``split_model(...,
skip_missing=True)`` on a tiny transformers GPT-2 under 1F1B (that it trains like one process is
tests/multiprocess/test_pipeline_hf_outputs.py).

- Where rank 1 fails (in the schedule's step, or already in ``split_model``), both ranks end
  within seconds, rank 1 with its own error and rank 0 with a ``PeerFailed`` naming rank 1's
  error; the same under the parity check's run.
- An error every rank raises alike leaves the process group usable.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.spawn import run_distributed

pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 4
SPLIT = dict(blocks="transformer.h", first=["transformer.wte", "transformer.wpe"],
             last=["transformer.ln_f", "lm_head"], skip_missing=True)
PLANTED = "planted: rank 1's loss cannot be computed"
TIMEOUT_S = 60  # the collective timeout: waiting for it would take a minute
ENDED_WITHIN_S = 40  # 7-9 s on a quiet machine, 12-13 s at load 34 (the 5 s grace included)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def _batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _pipeline(rank: int, model, *, fail: str | None = None):
    from titanext.distributed.pipeline import build_pipeline, split_model

    inputs, labels = _batch()

    def loss_fn(logits, target):  # a micro-batch's share of the global mean
        if fail == "loss" and rank == 1:
            raise RuntimeError(PLANTED)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (
            labels.numel())

    split = dict(SPLIT, first=["transformer.wte", "transformer.embed"]) \
        if fail == "split" and rank == 1 else SPLIT  # a path only rank 1 looks up
    stage = split_model(model, [2, 2], rank, **split)
    _, schedule = build_pipeline([stage], [rank], num_stages=2, pp_group=dist.group.WORLD,
                                 device=torch.device("cpu"), schedule="1F1B", microbatches=2,
                                 loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    last = {"target": labels, "losses": losses} if rank == 1 else {}
    schedule.step(input_ids=inputs, return_outputs=False, **last)  # inputs by keyword
    return stage, losses


def _fails_on_rank_1(rank: int, world_size: int, fail: str) -> dict:
    start = time.monotonic()
    try:
        _pipeline(rank, gpt2(), fail=fail)
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start,
                "group_alive": dist.is_initialized()}
    return {"type": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("fail", ["loss", "split"])
def test_an_error_on_rank_1_ends_both_ranks_within_seconds(fail):
    r0, r1 = run_distributed(_fails_on_rank_1, 2, args=(fail,), timeout_s=TIMEOUT_S)
    # each rank's own time, building the model included (the pool's start-up is not the
    # fail-safe's): well below the 60 s collective timeout a waiting rank would need
    assert max(r0["seconds"], r1["seconds"]) < ENDED_WITHIN_S, (r0, r1)
    want = PLANTED if fail == "loss" else "no attribute `embed`"
    assert r1["type"] in ("RuntimeError", "AttributeError") and want in r1["message"], r1
    assert r0["type"] == "PeerFailed", r0
    assert "because rank 1 failed first" in r0["message"] and want in r0["message"], r0
    assert not r0["group_alive"] and not r1["group_alive"]  # aborted: nothing left waiting


def _alike(rank: int, world_size: int) -> tuple[str, float]:
    from titanext.distributed.pipeline import split_model

    try:
        split_model(gpt2(), [2, 2], rank, blocks="transformer.blocks")
    except ValueError as e:
        message = str(e)
    total = torch.ones(1)
    dist.all_reduce(total)  # the group still works
    return message, total.item()


def test_an_error_every_rank_raises_leaves_the_group_usable():
    for message, total in run_distributed(_alike, 2, timeout_s=TIMEOUT_S):
        assert "no submodule 'transformer.blocks'" in message and total == 2.0


# -- the same recipe under the parity check -------------------------------------------------

class Pipeline:
    def __init__(self, parts, schedule, is_last):
        self.parts, self.schedule, self.is_last = parts, schedule, is_last


def wire_pp_failing_on_rank_1(model, ctx):
    from titanext.distributed.pipeline import build_pipeline, split_model

    rank, tokens = ctx.mesh["pp"].get_local_rank(), ctx.batch_size * ctx.seq_len

    def loss_fn(logits, labels):
        if rank == 1:
            raise RuntimeError(PLANTED)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens

    stage = split_model(model, [2, 2], rank, **SPLIT)
    _, schedule = build_pipeline([stage], [rank], num_stages=2,
                                 pp_group=ctx.mesh["pp"].get_group(), device=torch.device("cpu"),
                                 schedule="1F1B", microbatches=2, loss_fn=loss_fn)
    return Pipeline([stage], schedule, rank == 1)


def pipeline_loss(wired, inputs, labels, ctx):
    losses: list[torch.Tensor] = []
    last = {"target": labels, "losses": losses} if wired.is_last else {}
    wired.schedule.step(input_ids=inputs, return_outputs=False, **last)
    return torch.stack(losses).sum().detach() if wired.is_last else None


def _parity_ranks(rank: int, world_size: int) -> tuple[list[dict], float]:
    from titanext.parity._run import RunSpec, run_ranks

    spec = RunSpec(build=gpt2, wiring=wire_pp_failing_on_rank_1, loss_fn=pipeline_loss,
                   mesh_shape=(2,), mesh_names=("pp",), data_dims=(), steps=1, batch=BATCH,
                   seq=SEQ, vocab=VOCAB, seed=0, optimizer="sgd", lr=0.1)
    start = time.monotonic()
    out = run_ranks(rank, world_size, [spec, spec])
    return out, time.monotonic() - start


def test_the_parity_check_reports_rank_1s_error_within_seconds():
    from titanext.parity.report import build_report

    (out0, t0), (out1, t1) = run_distributed(_parity_ranks, 2, timeout_s=TIMEOUT_S)
    assert max(t0, t1) < ENDED_WITHIN_S, (t0, t1)
    report = build_report([out0[0], out1[0]], {}, tol=1e-5, mesh={"pp": 2})
    assert not report.ok and "on rank 1" in report.error and PLANTED in report.error, report.error
    # the group ended with the first check: the second is not run, and says why
    assert "not run" in out0[1]["error"] and out0[1].get("rerun")
