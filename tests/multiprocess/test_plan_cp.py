"""The planner's context-parallel rows equal what the real trainer sends.

One training step of the real Trainer runs under ``count_comm`` (the CP attention's own counter
of p2p sends and collectives), and ``plan_config`` of the same config must give the same number
of messages and the same bytes: the ring, Ulysses (with kv heads replicated when fewer than the
Ulysses ranks), hybrid Ulysses x ring, full activation checkpointing (the recompute repeats the
forward's traffic) and document masking (an all-gather of the ids per attention call). Every
group here has 2 ranks, or the counter's convention (an all-gather counts this rank's input)
and the planner's (bytes on the wire) would differ by the group size for the document ids.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.spawn import fp32_trainer_overrides, run_distributed

P, T = "--parallelism.", "--training."
ULYSSES = [P + "context_parallel_comm=alltoall"]
# name: overrides on 4 ranks, batch 4 x 64 tokens, 2 micro-batches of gradient accumulation
CASES = {
    "ring_cp2_documents": [P + "context_parallel_degree=2", "+docs"],
    "ulysses_cp2_documents_full_ac": [P + "context_parallel_degree=2", *ULYSSES, "+docs",
                                      "--activation_checkpoint.mode=full"],
    "ulysses_cp4_kv2_replicated": [P + "context_parallel_degree=4", *ULYSSES,
                                   "--model.flavor=kv2"],
    "hybrid_2x2_documents": [P + "context_parallel_degree=4",
                             P + "context_parallel_ulysses_degree=2", "+docs"],
}


def _register_kv2():
    """debugtiny with 2 kv heads: under Ulysses over 4 ranks each kv head goes to 2 ranks."""
    from titanext.models import MODEL_FLAVORS, ModelArgs

    MODEL_FLAVORS["llama3"].setdefault("kv2", ModelArgs(dim=64, n_layers=2, n_heads=8,
                                                        n_kv_heads=2, vocab_size=264,
                                                        multiple_of=32))


def _counted_and_planned(rank, world_size, runs, dump):
    """Per run: (counted messages, counted bytes, planned messages, planned bytes, CP rows)."""
    from titanext.config import load_config
    from titanext.planning.cli import plan_config
    from titanext.plugins.context_parallel import count_comm
    from titanext.trainer import Trainer

    _register_kv2()
    out = []
    for i, overrides in enumerate(runs):
        cfg = load_config(None, [*fp32_trainer_overrides(steps=1, seq_len=64, flavor="debugtiny"),
                                 T + "local_batch_size=2", T + "global_batch_size=4",
                                 f"--job.dump_folder={dump}/{i}", *overrides],
                          world_size=world_size)
        trainer = Trainer(cfg)
        with count_comm() as counted:
            trainer.train()
        rows = [r for r in plan_config(cfg, world_size).comm if r["parallelism"].startswith("CP")]
        out.append((counted.sends + sum(counted.collectives.values()),
                    counted.send_bytes + counted.collective_bytes,
                    sum(r["collectives"] for r in rows), sum(r["bytes"] for r in rows), rows))
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan_cp")
    corpus = folder / "docs.jsonl"
    rng = random.Random(0)
    with corpus.open("w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": "".join(rng.choice("abc ") for _ in
                                                range(rng.randint(1, 30)))}) + "\n")
    docs = [T + "document_masking=true", T + "dataset=text", f"{T}dataset_path={corpus}"]
    runs = [[o for o in overrides if o != "+docs"] + (docs if "+docs" in overrides else [])
            for overrides in CASES.values()]
    per_rank = run_distributed(_counted_and_planned, 4, args=(runs, str(folder)), timeout_s=240)
    return dict(zip(CASES, per_rank[0], strict=True)), per_rank


@pytest.mark.parametrize("name", list(CASES))
def test_planned_cp_traffic_equals_the_counted_traffic(measured, name):
    results, per_rank = measured
    messages, sent, planned_messages, planned_bytes, rows = results[name]
    assert rows and sent > 0, rows
    assert planned_messages == messages, (name, rows)
    assert planned_bytes == pytest.approx(sent, rel=1e-12), (name, rows)
    i = list(CASES).index(name)
    assert all(r[i][:2] == (messages, sent) for r in per_rank), "every rank sends alike"


def test_ulysses_and_hybrid_get_their_own_rows(measured):
    results, _ = measured
    names = {name: [r["parallelism"] for r in results[name][4]] for name in CASES}
    assert names["ring_cp2_documents"] == ["CP (p2p)"]
    assert names["ulysses_cp4_kv2_replicated"] == ["CP Ulysses all-to-all (u = 4)"]
    assert names["hybrid_2x2_documents"] == ["CP Ulysses all-to-all (u = 2)",
                                             "CP ring p2p (r = 2)"]
    levels = {r["level"] for r in results["hybrid_2x2_documents"][4]}
    assert levels == {"intra-node"}
