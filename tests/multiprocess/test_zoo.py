"""The zoo certification (titanext.hf.zoo) on a fixed sample of transformers families, in the
test suite's 2-rank worker pool: every plugin on each family's tiny copy (both variants: untied
head with pad_token_id None, tied head with pad_token_id 0) is exact against one process,
refused by name, or not applicable; no cell is WRONG. The whole zoo is ``titanext-zoo``
(docs/zoo.md)."""

from __future__ import annotations

import pytest

from tests.spawn import run_distributed

pytest.importorskip("transformers")

#: dense, sliding + global, fused projections, parallel attention, MoE with 3-D experts, MLA,
#: hybrid Mamba + attention, pure state space
SAMPLE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "olmo2", "gpt_neox",
          "stablelm", "falcon", "olmoe", "granitemoe", "deepseek_v2", "bamba", "mamba2")


def _run(model_type, plugins, done):
    from titanext.hf.zoo.cells import certify_rank

    return run_distributed(certify_rank, 2, args=(model_type, plugins, done), timeout_s=60)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_no_wrong_cell(model_type):
    from titanext.hf.zoo.cells import PLUGINS, certify_type
    from titanext.hf.zoo.table import cell

    result = certify_type(_run, model_type, PLUGINS)
    assert "_build" not in result, f"{model_type} no longer builds tiny: {result['_build']}"
    cells = {p: cell(result[p]) for p in PLUGINS}
    wrong = {p: text for p, (kind, text) in cells.items() if kind == "WRONG"}
    assert not wrong, f"{model_type}: WRONG cells: {wrong}"
    refused = {p: text for p, (kind, text) in cells.items() if kind == "refused"}
    assert all(text for text in refused.values()), f"a refusal without a reason: {refused}"
