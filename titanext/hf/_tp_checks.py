"""What :func:`titanext.hf.transformers.hf_tp_plan` checks on the model in hand before it returns
a plan: fused projections it has no rule for, attention that reshapes by a head count the split
changes, and a plan that would split nothing inside the blocks. Each refusal names the modules.

The attention check reads the attention class's ``forward`` source: a reshape by ``-1`` heads
(the Llama family) runs each rank's local heads unchanged; one by ``self.num_heads`` /
``self.num_key_value_heads`` (StableLM) gets those attributes set to the rank's local counts
before every call (:func:`local_head_counts`); one by ``config.num_attention_heads`` (Phi-3)
cannot be given local counts without changing the shared config, so it is refused.
"""

from __future__ import annotations

import inspect
import re

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanext.plugins.tp_coverage import fqn_matches

__all__ = ["tp_plan_problems", "local_head_counts", "interleaved_qkv_rules"]

#: output projections that stack several parts (q, k, v; gate, up) in one weight
FUSED = ("qkv_proj", "query_key_value", "gate_up_proj", "c_attn", "Wqkv", "W_pack")
_OWN_COUNTS = re.compile(r"self\.(num_heads|num_key_value_heads|num_kv_heads)\b")
_CONFIG_COUNTS = re.compile(r"config\.(num_attention_heads|num_key_value_heads)\b")


_PER_HEAD = re.compile(r"\(\*input_shape, -1, 3 \* self\.head_size\)")


def interleaved_qkv_rules(model: nn.Module) -> dict[str, ParallelStyle]:
    """Rules for GPT-NeoX's layout: ``attention.query_key_value`` holds ``[q_h; k_h; v_h]`` per
    head and the attention views it as ``(-1 heads, 3 * head_size)``, so a plain column split
    gives each rank whole heads; ``attention.dense`` row-wise, the MLP's ``dense_h_to_4h`` /
    ``dense_4h_to_h`` column- / row-wise. Only where the attention's forward is seen to reshape
    that way; {} otherwise."""
    rules: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if name.endswith(".attention") and isinstance(
                getattr(module, "query_key_value", None), nn.Linear) and _PER_HEAD.search(
                _source(type(module))):
            block = re.sub(r"\.\d+\.attention$", ".*", name)
            rules.update({f"{block}.attention.query_key_value": ColwiseParallel(),
                          f"{block}.attention.dense": RowwiseParallel(),
                          f"{block}.mlp.dense_h_to_4h": ColwiseParallel(),
                          f"{block}.mlp.dense_4h_to_h": RowwiseParallel()})
            break
    return rules


def _matmuls_in_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every Linear-like module inside a block (``<...>.layers.<i>`` or
    ``<...>.h.<i>``), routed experts' modules excluded (they stay replicated over tp)."""
    out = []
    for name, m in model.named_modules():
        parts = name.split(".")
        in_block = any(p in ("layers", "h", "blocks") and i + 1 < len(parts) - 1
                       and parts[i + 1].isdigit() for i, p in enumerate(parts))
        if in_block and "experts" not in parts and (
                isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
            out.append((name, m))
    return out


def _ruled(name: str, plan: dict[str, ParallelStyle]) -> bool:
    chain = name
    while chain:
        if any(fqn_matches(k, chain) for k in plan):
            return True
        chain = chain.rpartition(".")[0]
    return False


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _sharded(name: str, plan: dict[str, ParallelStyle]) -> bool:
    return any(isinstance(s, ColwiseParallel | RowwiseParallel) and fqn_matches(k, name)
               for k, s in plan.items())


def tp_plan_problems(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Why ``plan`` (matched against ``model``) cannot split ``model`` correctly; [] if it can."""
    kind = type(model).__name__
    matmuls = _matmuls_in_blocks(model)
    fused = [n for n, _ in matmuls if n.rpartition(".")[2] in FUSED and not _ruled(n, plan)]
    if fused:
        attn = sorted({type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in fused})
        return [f"{kind} has fused projections that hf_tp_plan has no rule for: "
                f"{_some(fused)} (in {', '.join(attn)}). Split them yourself with "
                "FusedColwiseParallel(split_sizes=...) (rank-major parts: q | k | v, gate | up) "
                "if the module splits their output with local sizes and reshapes with -1 heads; "
                "one that slices or reshapes by the config's head counts needs local counts "
                "first. Otherwise leave tp = 1 for this model"]
    split = [n for n, _ in matmuls if _sharded(n, plan)]
    if matmuls and not split:
        return [f"{kind}: hf_tp_plan has no rule for any matmul inside its blocks "
                f"({_some([n for n, _ in matmuls])}); the plan would split only the embedding "
                "and the LM head, a tp degree that changes nothing in the blocks. Write a plan "
                "for these modules, or leave tp = 1"]
    problems = []
    for parent in sorted({n.rpartition(".")[0] for n in split}):
        module = model.get_submodule(parent)
        src = _source(type(module))
        wrong = sorted(set(_CONFIG_COUNTS.findall(src)))
        if wrong:
            problems.append(f"{parent} ({type(module).__name__}) reshapes by config."
                            f"{', config.'.join(wrong)}, the global head counts: under tp each "
                            "rank holds only its heads. Leave tp = 1 for this model")
    if len(problems) > 1:
        problems = [f"{problems[0]} (+{len(problems) - 1} more like it)"]
    return problems


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")


class _LocalHeads:
    """Forward pre-hook: the attention module's head-count attributes, from its projections'
    local rows (the rank's heads under tp, the whole count without it)."""

    def __init__(self, attrs: dict[str, str], head_dim: int):
        self.attrs, self.head_dim = attrs, head_dim  # attribute -> projection that sets it

    def __call__(self, module: nn.Module, args) -> None:
        for attr, proj in self.attrs.items():
            w = getattr(module, proj).weight
            rows = w.to_local().shape[0] if isinstance(w, DTensor) else w.shape[0]
            setattr(module, attr, rows // self.head_dim)


def local_head_counts(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Give every split attention that reshapes by ``self.num_heads`` / ``self.num_key_value_heads``
    its rank's local counts at each call (a forward pre-hook); returns their FQNs."""
    done = []
    for name, module in model.named_modules():
        q = getattr(module, "q_proj", None)
        if not isinstance(q, nn.Linear) or not _sharded(f"{name}.q_proj", plan):
            continue
        used = set(_OWN_COUNTS.findall(_source(type(module))))
        head_dim = getattr(module, "head_dim", None)
        if not used or not head_dim:
            continue
        attrs = {}
        for attr in used:
            attrs[attr] = "q_proj" if attr == "num_heads" else "k_proj"
        if getattr(module, "_titanext_local_heads", False):
            continue
        module.register_forward_pre_hook(_LocalHeads(attrs, int(head_dim)))
        module._titanext_local_heads = True
        done.append(name)
    return done
