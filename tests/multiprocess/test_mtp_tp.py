"""Multi-token prediction under tensor parallelism follows one fp32 process (4 CPU ranks, one
spawn): TP 2 x FSDP 2 (also with EP 2), and PP 2 (1F1B, the MTP module on the last stage) x
TP 2, with sequence parallelism and loss parallelism (the defaults; TP 2 x FSDP 2 also without
either), on the debug DeepSeek flavor (MLA, MoE, one MTP module).

As in test_mtp.py (whose ``_runs`` this reuses): the main and the MTP loss of every step (so
the parameters after each step too) and the first step's gradient of every parameter, gathered
over tp, against one process on the same global batch of 8 sequences of 32 tokens.
"""

from __future__ import annotations

import pytest

from tests.multiprocess.test_mtp import DEBUG, FSDP2, P, _pp, _runs, check_case
from tests.spawn import run_distributed

TP2 = [P + "tensor_parallel_degree=2"]
CASES = {
    "tp2_x_fsdp2": [*DEBUG, *FSDP2, *TP2],
    # the MTP block's MoE: replicated over tp as the blocks' are, its experts split over ep
    "tp2_x_fsdp2ep2": [*DEBUG, *FSDP2, *TP2, P + "expert_parallel_degree=2"],
    # replicated activations between blocks, the logits gathered over the vocabulary
    "tp2_x_fsdp2_no_sp_no_loss_parallel": [*DEBUG, *FSDP2, *TP2,
                                           P + "enable_sequence_parallel=false",
                                           P + "enable_loss_parallel=false"],
    "1F1B_pp2_x_tp2": [*DEBUG, "--training.local_batch_size=8", *TP2, *_pp("1F1B", 2)],
}


@pytest.mark.slow
def test_mtp_under_tp_follows_one_process(tmp_path):
    (ref_losses, ref_mtp, ref_grads), = run_distributed(
        _runs, 1, args=([[*DEBUG, "--training.local_batch_size=8"]], str(tmp_path / "ref")),
        timeout_s=120)[0]
    names = list(CASES)
    per_rank = run_distributed(_runs, 4, args=([CASES[n] for n in names], str(tmp_path / "run")),
                               timeout_s=300)
    failures = []
    for i, name in enumerate(names):
        copies = check_case(name, per_rank, i, (ref_losses, ref_mtp, ref_grads), failures)
        assert any(k.startswith("mtp.layers.0.eh_proj") for k in copies), name
    assert not failures, "\n".join(failures)
