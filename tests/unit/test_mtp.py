"""Multi-token prediction in one process: the injected gradient is the explicit loss's, the
labels' shift, the pipeline split, and the config's bad-input rule (exit 2, one line)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests import REPO_ROOT
from titanext.config import ConfigError, load_config
from titanext.models import build_model, get_model_args
from titanext.models.mtp import mtp_labels, set_mtp_grad_weight


def _model(depth: int = 2):
    args = dataclasses.replace(get_model_args("llama3", "debugmoe"), num_mtp_layers=depth)
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=0)
    return model


def test_the_injected_mtp_gradient_is_the_explicit_weighted_loss():
    model = _model()
    torch.manual_seed(0)
    x = torch.randint(0, 264, (2, 17))
    inputs, labels = x[:, :-1], x[:, 1:]
    future = mtp_labels(labels, 2)
    set_mtp_grad_weight([model], 0.37)
    logits = model(inputs, mtp_labels=future)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums = model.mtp.loss_sum.clone()
    model.zero_grad()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum")
    for k, mtp_logits in enumerate(model.mtp_logits(inputs, future), start=1):
        ce = F.cross_entropy(mtp_logits.flatten(0, 1), future[..., k].flatten(),
                             reduction="sum", ignore_index=-100)
        torch.testing.assert_close(sums[k - 1], ce.detach())
        loss = loss + 0.37 * ce
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(injected[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert injected["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_mtp_labels_shift_and_module_k_sees_token_i_plus_k():
    labels = torch.arange(10, 16).unsqueeze(0)
    assert mtp_labels(labels, 1)[0, :, 1].tolist() == [11, 12, 13, 14, 15, -100]
    model = _model(depth=1)
    x = torch.randint(0, 264, (1, 8))
    future = mtp_labels(x[:, 1:], 1)
    # changing the last MTP input token changes only the last position's MTP logits (causal)
    other = future.clone()
    other[0, -1, 0] = (other[0, -1, 0] + 1) % 264
    a, b = model.mtp_logits(x[:, :-1], future)[0], model.mtp_logits(x[:, :-1], other)[0]
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_the_last_pipeline_stage_holds_mtp_and_an_embedding_copy():
    from titanext.distributed.pipeline import split_model, stage_parts

    model = build_model("llama3", dataclasses.replace(
        get_model_args("llama3", "debugmodel"), num_mtp_layers=1), device="meta")
    parts = [split_model(model, [3, 3], i, **stage_parts(model, i, 2)) for i in range(2)]
    assert parts[0].mtp is None and parts[0].tok_embeddings is not None
    assert parts[1].mtp is not None and parts[1].tok_embeddings is not None
    assert parts[1].output is not None and parts[0].output is None


def test_mtp_runs_under_tensor_parallelism_but_not_autograd_split_backward():
    load_config(None, ["--model.flavor=debugmoe", "--model.num_mtp_layers=1",
                       "--parallelism.tensor_parallel_degree=2"], world_size=2)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.flavor=debugmoe", "--model.num_mtp_layers=1",
                           "--parallelism.pipeline_parallel_degree=2",
                           "--parallelism.pipeline_parallel_split_backward=autograd"],
                    world_size=2)
    assert len(e.value.problems) == 1, e.value.problems
    assert "pipeline_parallel_split_backward = 'autograd'" in e.value.problems[0]
    assert "allowed: 'deferred'" in e.value.problems[0]


def test_the_cli_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "titanext.launch", "--nproc_per_node", "2", "--config",
         "train_configs/debug_moe.toml",
         "--model.num_mtp_layers=1", "--parallelism.pipeline_parallel_degree=2",
         "--parallelism.pipeline_parallel_split_backward=autograd"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if x.strip()]
    assert proc.returncode == 2, proc
    assert len(lines) == 1 and "split_backward = 'autograd'" in lines[0], lines
    assert "Traceback" not in proc.stderr


def test_planner_counts_the_mtp_modules_and_the_embedding_copy():
    """One pp rank: the MTP modules' parameters, exactly; under PP the last stage also holds an
    embedding copy; [model] num_mtp_layers = 0 removes them."""
    from titanext.config import load_config
    from titanext.models import build_model, get_model_args
    from titanext.planning.estimate import plan_config

    args = get_model_args("llama3", "debugdeepseek")
    base = ["--model.flavor=debugdeepseek", "--training.mixed_precision_param=float32"]
    params = {}
    for mtp in (0, 1):
        cfg = load_config(None, [*base, f"--model.num_mtp_layers={mtp}"], world_size=1)
        params[mtp] = plan_config(cfg, 1).memory["params (fp32 master)"]
    model = build_model("llama3", dataclasses.replace(args, num_mtp_layers=1), device="meta")
    assert params[1] - params[0] == 4 * sum(p.numel() for p in model.mtp.parameters())
    pp = ["--parallelism.pipeline_parallel_degree=2",
          "--parallelism.pipeline_parallel_schedule=1F1B", "--training.local_batch_size=4"]
    last = {}
    for mtp in (0, 1):
        cfg = load_config(None, [*base, *pp, f"--model.num_mtp_layers={mtp}"], world_size=2)
        last[mtp] = plan_config(cfg, 2).memory_per_pp_rank[1]["params (fp32 master)"]
    copy = model.tok_embeddings.weight.numel()
    assert last[1] - last[0] == 4 * (sum(p.numel() for p in model.mtp.parameters()) + copy)
