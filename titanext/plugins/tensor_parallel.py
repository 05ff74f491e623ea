"""Tensor and sequence parallelism as plain plans: dicts from module FQN to ParallelStyle.

A plan is handed to ``torch.distributed.tensor.parallel.parallelize_module`` unchanged, so any
model can be parallelized with a dict written for it (FQNs may use ``*`` wildcards):

>>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
>>> plan = {"blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
>>> apply_tensor_parallel(my_model, tp_mesh, plan)  # in a process group  # doctest: +SKIP

``llama_tp_plan`` is the plan of titanext's reference model (Megatron-style TP with sequence
parallelism on the norms, and a vocab-sharded output for loss parallelism).

Without a plan, ``apply_tensor_parallel`` uses that plan only on a model laid out like the
reference one (:func:`default_plan_problems`), else it raises; :func:`tp_plan_matches` lists
what each rule of a plan matches, before anything is sharded.

A fused projection has one of two row layouts (docs/fsdp_tp.md#fused-projections):

- concatenated parts ``[q; k; v]`` (or ``[gate; up]``): use :class:`FusedColwiseParallel`; a
  plain ``ColwiseParallel`` gives rank r rows r/tp of the stacked weight (all of q and half of
  k, say) and computes the wrong thing without an error;
- rows grouped per KV head (``[q_g; k_g; v_g]`` for each KV head g): plain ``ColwiseParallel``
  is right when tp divides the KV heads (each rank gets whole groups), and
  ``FusedColwiseParallel`` is wrong there.

No style can tell the two apart (a Linear does not say what its rows mean): compare against one
process once.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanext.plugins._blocks import mtp_modules
from titanext.plugins._loud import matmul_kind
from titanext.plugins._tp_conv1d import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    check_conv1d_styles,
)
from titanext.plugins.float8 import supports_float8_tp
from titanext.plugins.tp_coverage import unruled_parameters

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "FusedColwiseParallel",
           "ReplicatedOverTP", "VocabParallelEmbedding", "apply_tensor_parallel",
           "default_plan_problems", "has_mtp", "llama_tp_plan", "mla_rope_dim",
           "tp_plan_matches", "tp_plan_targets"]

TPPlan = dict[str, ParallelStyle]


def _vocab_parallel_embedding_forward(module: nn.Embedding, ids: DTensor) -> DTensor:
    # Each rank looks up the token ids in its own vocabulary rows (the others give zero rows):
    # the output is a partial sum, and the weight gradient is the rank's rows only.
    weight = module.weight
    local_w, n = weight.to_local(), weight.device_mesh.size()
    rows = -(-weight.shape[0] // n)  # Shard(0) splits like torch.chunk
    start = min(weight.device_mesh.get_local_rank() * rows, weight.shape[0])
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    outside = (local_ids < start) | (local_ids >= start + local_w.shape[0])
    out = F.embedding((local_ids - start).masked_fill(outside, 0), local_w)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Embedding`` whose backward stays vocabulary-sharded.

    DTensor's embedding backward has no vocabulary-sharded strategy: under plain
    ``RowwiseParallel`` every rank builds the weight gradient over the FULL vocabulary
    (``embedding_dense_backward`` gives a full-size partial sum), 4.2 GB in fp32 for a 128k x 8k
    table at any tp degree. This style computes the lookup on the local rows instead (ids outside
    them give zero rows; the output is a partial sum, reduced by the output layout as before), so
    the gradient is the local ``[vocab / tp, dim]`` rows. Embeddings with ``padding_idx`` or
    ``max_norm`` keep the DTensor path.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if (isinstance(module, nn.Embedding) and module.padding_idx is None
                and module.max_norm is None and not module.sparse):
            _use_local_lookup(module)
        return module


class _LocalLookup(nn.Embedding):
    """``nn.Embedding``'s lookup, done on the rank's own vocabulary rows."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        return _vocab_parallel_embedding_forward(self, input)


def _use_local_lookup(module: nn.Embedding) -> None:
    """Replace only ``nn.Embedding.forward`` under ``module``'s own forward: the module's class
    becomes a subclass of its class and of :class:`_LocalLookup`, which sits before
    ``nn.Embedding`` in the MRO. A subclass's forward (Gemma 3's scaled embedding:
    ``super().forward(ids) * scale``) keeps running around the local lookup; one that does not
    call ``super().forward`` keeps DTensor's embedding (correct, with a full-vocabulary
    gradient buffer)."""
    cls = type(module)
    if issubclass(cls, _LocalLookup):
        return
    bases = (_LocalLookup,) if cls is nn.Embedding else (cls, _LocalLookup)
    module.__class__ = type(cls.__name__, bases, {"__module__": cls.__module__})


class ReplicatedOverTP(ParallelStyle):
    """Keep a module replicated over tp: plain parameters, local input and output, the same
    computation on every tp rank. Its parameters get complete (and equal) gradients on every
    rank because each consumer of its output sums its input gradient over tp, as a
    ``ColwiseParallel`` linear does. ``grad_sum_last = n`` is for an output whose last n
    features feed head-sharded computation directly, through no TP layer: their gradient is
    summed over tp here (forward unchanged). MLA's latent projections use it: ``wq_a``,
    ``q_norm``, ``kv_norm`` plain, and ``wkv_a`` with ``grad_sum_last = qk_rope_head_dim``
    (the RoPE key, shared by every head, meets the rank's heads in attention).
    """

    def __init__(self, *, grad_sum_last: int = 0):
        super().__init__()
        self.grad_sum_last = int(grad_sum_last)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n = self.grad_sum_last
        if n > 0:
            def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
                # forward: identity; backward: the Partial gradient is summed into Replicate
                tail = DTensor.from_local(out[..., -n:], device_mesh, [Replicate()],
                                          run_check=False).to_local(grad_placements=[Partial()])
                return torch.cat([out[..., :-n], tail], dim=-1)

            module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return f"ReplicatedOverTP(grad_sum_last={self.grad_sum_last})"


def mla_rope_dim(model: nn.Module) -> int | None:
    """The RoPE key size of the multi-head latent attention in ``model`` (``wkv_a``'s output
    minus ``kv_norm``'s width), or None without MLA."""
    for module in model.modules():
        wkv_a, kv_norm = getattr(module, "wkv_a", None), getattr(module, "kv_norm", None)
        if isinstance(wkv_a, nn.Linear) and kv_norm is not None:
            return wkv_a.out_features - kv_norm.weight.shape[0]
    return None


def _attention_plan(colwise, rowwise, seq, mla_rope: int | None) -> TPPlan:
    """The attention rules of a block: GQA, or MLA when ``mla_rope`` is its RoPE key size."""
    if mla_rope is None:
        return {
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=seq),
            # QK-norm (Qwen3): each rank normalises its own heads (dim 2 of [b, s, heads, hd]);
            # the weight is replicated and its gradient summed over tp.
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
    # MLA: heads split (wq / wq_b and wkv_b column-wise, wo row-wise); the compressed latents
    # are computed replicated on every tp rank from the gathered input (docs/deepseek_v3.md).
    return {
        "attention.wq": colwise(),
        "attention.wq_a": ReplicatedOverTP(),
        "attention.q_norm": ReplicatedOverTP(),
        "attention.wq_b": colwise(),
        "attention.wkv_a": ReplicatedOverTP(grad_sum_last=mla_rope),
        "attention.kv_norm": ReplicatedOverTP(),
        "attention.wkv_b": colwise(),
        "attention.wo": rowwise(output_layouts=seq),
    }


def llama_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True,
                  layers_prefix: str = "layers.*", float8: bool = False,
                  mla_rope: int | None = None, mtp: bool = False) -> TPPlan:
    """The TP/SP plan of :class:`titanext.models.llama.Transformer`.

    With ``sequence_parallel`` the activations between blocks stay sharded on the sequence
    dimension (norms run on a slice), and each block all-gathers before attention/FFN and
    reduce-scatters after. With ``loss_parallel`` the logits stay sharded over the vocabulary
    and the cross-entropy must run under ``torch.distributed.tensor.parallel.loss_parallel()``.
    MoE blocks (a ``moe`` instead of ``feed_forward``) get TP on attention only; their MoE is
    replicated over tp (every tp rank routes the same tokens through all experts): under SP its
    input is all-gathered over the sequence and its output sliced back to ``Shard(1)``.
    With ``float8`` the block linears use torchao's float8 TP styles: activations are cast to
    float8 before their all-gathers (needs tensorwise Float8Linear blocks and NCCL).
    ``mla_rope`` (:func:`mla_rope_dim`) gives the rules of multi-head latent attention
    instead of GQA's: heads split, latents replicated (:class:`ReplicatedOverTP`); its blocks
    take no ``float8`` styles.
    With ``mtp`` (the model has multi-token prediction modules, :func:`has_mtp`), the plan
    also covers each ``mtp.layers.*``: its ``block`` as the main blocks, its three norms as the
    final norm, and ``eh_proj`` column-wise (see :func:`_mtp_plan`).
    """
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        # optional dependency (torchao)
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = (Float8ColwiseParallel, Float8RowwiseParallel,
                                           PrepareFloat8ModuleInput)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: TPPlan = {
        "tok_embeddings": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block: TPPlan = {
        **_attention_plan(colwise, rowwise, seq, mla_rope),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=seq),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # attention(x, cos, sin): gather x over the sequence, leave the RoPE tables alone.
            # MLA's replicated latent projections take it as a plain tensor (their consumers
            # sum the gradients over tp, so x's gradient is complete on every rank).
            "attention": prepare_input(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=mla_rope is not None,
                **({"fwd_config_submodule_fqn": "wq"} if float8 else {}),
            ),
            "feed_forward": prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                **({"fwd_config_submodule_fqn": "w1"} if float8 else {}),
            ),
            # Gradients flow back through the gather/slice, so the replicated MoE parameters
            # get identical, complete gradients on every tp rank (no tp reduction needed).
            "moe": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),), use_local_output=True,
            ),
        })
    plan.update({f"{layers_prefix}.{k}": v for k, v in block.items()})
    if mtp:
        plan.update(_mtp_plan(block, seq, sequence_parallel))
    return plan


def has_mtp(model: nn.Module) -> bool:
    """Whether ``model`` holds multi-token prediction modules at ``mtp.layers``
    (:class:`titanext.models.mtp.MultiTokenPrediction`)."""
    return bool(mtp_modules(model))


def _mtp_plan(block: TPPlan, seq, sequence_parallel: bool) -> TPPlan:
    """The rules of every MTP module ``mtp.layers.*`` (``enorm``, ``hnorm``, ``eh_proj``,
    ``block``, ``norm``), its input and output laid out as the main blocks' (``seq``)."""
    plan: TPPlan = {f"mtp.layers.*.block.{k}": v for k, v in block.items()}
    # eh_proj([enorm(emb); hnorm(h)]) column-wise: each rank computes whole output features
    # over the full 2 x dim input, so the forward is exact (no partial sums, unlike
    # row-wise, whose input split would also have to follow the concatenation); the input
    # is gathered over the sequence and the output goes back to the blocks' layout (under
    # SP an all-to-all from features to sequence). Its input gradient is summed over tp.
    plan["mtp.layers.*.eh_proj"] = ColwiseParallel(input_layouts=seq, output_layouts=seq)
    if sequence_parallel:  # the norms run on the rank's sequence slice, as the final norm
        plan.update({f"mtp.layers.*.{n}": SequenceParallel() for n in ("enorm", "hnorm", "norm")})
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan | None = None,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    float8: bool = False,
) -> nn.Module:
    """Apply ``plan`` (default: :func:`llama_tp_plan`) to ``model`` over the 1D ``tp_mesh``.

    Modules a plan names but the model lacks (a pipeline stage without embeddings, a MoE
    block without ``feed_forward``, say) are skipped, so one plan serves every stage and
    block kind: ``*`` keys are expanded (one ``*`` per name component) to the modules present.
    ``float8`` (the model went through ``apply_float8``) picks torchao's float8 TP styles for
    the default plan where they can work: tensorwise float8 block linears on a backend with
    float8 collectives. Otherwise TP
    communicates in high precision and says so; the linears still compute in float8. A custom
    ``plan`` is used as given (put torchao's ``Float8ColwiseParallel`` etc. in it yourself).

    Loud or correct: one WARNING line says how many parameters were sharded, which rules
    matched nothing, and which parameters inside a split attention / MLP no rule covers
    (:func:`titanext.plugins.tp_coverage.unruled_parameters`: a QK-norm without its rule, say).
    ``ValueError`` (naming the model class and the fix) when no plan is given and
    :func:`default_plan_problems` finds the model unlike titanext's Llama, when no rule matches
    any module, or when nothing was sharded. See :func:`tp_plan_matches`.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1D, got {tp_mesh.ndim}D")
    if plan is None and float8:
        float8 = _float8_comm_possible(model, tp_mesh, sequence_parallel, loss_parallel)
    plan, matches, kept = tp_plan_targets(model, tp_mesh.size(), plan,
                                          sequence_parallel=sequence_parallel,
                                          loss_parallel=loss_parallel, float8=float8)
    shared = _shared_parameters(model)
    unruled = unruled_parameters(model, kept)  # before sharding: what the plan leaves alone
    parallelize_module(model, tp_mesh, kept)
    _retie(model, shared)
    _report(model, tp_mesh, matches, replicated=_unsharded_matmuls(model, kept),
            unruled=unruled)
    return model


def _unsharded_matmuls(model: nn.Module, kept: TPPlan) -> list[str]:
    """Matmul modules (``titanext.plugins._loud``) no rule matched: replicated over tp."""
    return [f"{fqn} ({type(m).__name__})" for fqn, m in model.named_modules()
            if fqn not in kept and matmul_kind(m) is not None]


def tp_plan_targets(model: nn.Module, tp: int, plan: TPPlan | None = None, *,
                    sequence_parallel: bool = True, loss_parallel: bool = True,
                    float8: bool = False) -> tuple[TPPlan, dict[str, list[str]], TPPlan]:
    """What :func:`apply_tensor_parallel` would do, checked without changing ``model``:
    (the plan, the modules each rule matches, {module FQN: style}). Raises the same
    ``ValueError`` it would (no plan for an unknown layout, no rule matching, a style that
    cannot take the module it matches), so a recipe can check before it mutates anything."""
    if plan is None:
        plan = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                             float8=float8, mla_rope=mla_rope_dim(model), mtp=has_mtp(model))
        problems = default_plan_problems(model, plan)
        if problems:
            raise ValueError(
                f"apply_tensor_parallel: no tp_plan was given and {type(model).__name__} is not "
                "laid out like titanext's Llama, which the default plan is for: "
                + "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems)"
                                             if len(problems) > 6 else "")
                + ". Fix: pass tp_plan={FQN pattern: ParallelStyle} for your model "
                "(docs/fsdp_tp.md#tensor-parallelism-on-your-own-model); "
                "tp_plan_matches(model, plan) shows what a plan's rules match")
    matches = _plan_matches(model, plan)
    kept = {name: plan[rule] for rule, names in matches.items() for name in names}
    if not kept:
        raise ValueError(
            f"apply_tensor_parallel: no rule of the tp plan matches a module of "
            f"{type(model).__name__} (rules: {', '.join(plan) or 'none'}), so tp = "
            f"{tp} would shard nothing. Fix: write the plan's keys as the model's "
            "module FQNs (print [n for n, _ in model.named_modules()]), '*' for one component")
    check_conv1d_styles(model, kept)
    return plan, matches, kept


def _report(model: nn.Module, tp_mesh: DeviceMesh, matches: dict[str, list[str]],
            replicated: Sequence[str] = (), unruled: Sequence[str] = ()) -> None:
    """One WARNING line saying what TP did; ValueError when it sharded no parameter."""
    params = dict(model.named_parameters())
    sharded = [n for n, p in params.items() if isinstance(p, DTensor)]
    unused = [rule for rule, names in matches.items() if not names]
    name = type(model).__name__
    if not sharded and tp_mesh.size() > 1:
        raise ValueError(
            f"apply_tensor_parallel: the plan matched modules of {name} but sharded none of its "
            f"{len(params)} parameters over tp = {tp_mesh.size()}; give the linears "
            "ColwiseParallel / RowwiseParallel (or other parameter-sharding styles)")
    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger("titanext").warning(
            "tensor parallel: %s: %d of %d parameters sharded over tp = %d; %d rule(s) "
            "matched%s%s%s", name, len(sharded), len(params), tp_mesh.size(),
            len(matches) - len(unused),
            f"; matching no module (skipped): {', '.join(unused)}" if unused else "",
            f"; matmul modules no rule names (replicated over tp): {', '.join(replicated[:6])}"
            + (f", ... ({len(replicated)})" if len(replicated) > 6 else "") if replicated else "",
            f"; NO RULE inside a split attention / MLP, kept replicated (each rank would get its "
            f"heads' gradient only; the replicated-gradient check tests it at the first steps): "
            f"{', '.join(unruled[:6])}{' ...' if len(unruled) > 6 else ''}" if unruled else "")


def tp_plan_matches(model: nn.Module, plan: TPPlan | None = None) -> list[dict]:
    """Which modules each rule of ``plan`` (default: :func:`llama_tp_plan`) matches, before
    anything is sharded: one row per rule with ``rule``, ``style``, ``modules`` (how many) and
    ``matched`` (their FQNs, shortened). Print it with
    ``titanext.components.metrics.format_table(rows)``.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> [(r["rule"], r["modules"], r["matched"]) for r in tp_plan_matches(
    ...     model, {"0": ColwiseParallel(), "*.up": ColwiseParallel()})]
    [('0', 1, '0'), ('*.up', 0, '')]
    """
    plan = llama_tp_plan(mla_rope=mla_rope_dim(model), mtp=has_mtp(model)) if plan is None \
        else plan
    rows = []
    for fqn, names in _plan_matches(model, plan).items():
        shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        rows.append({"rule": fqn, "style": type(plan[fqn]).__name__, "modules": len(names),
                     "matched": shown})
    return rows


def _plan_matches(model: nn.Module, plan: TPPlan) -> dict[str, list[str]]:
    present = [name for name, _ in model.named_modules()]
    return {fqn: _matching(fqn, present) for fqn in plan}


#: Default-plan rules a Llama block may lack: QK-norm is Qwen3's only; MLA has ``wq`` or the
#: low-rank ``wq_a``, ``q_norm``, ``wq_b``.
_OPTIONAL_BLOCK_RULES = ("attention.q_norm", "attention.k_norm", "attention.wq",
                         "attention.wq_a", "attention.wq_b")


def default_plan_problems(model: nn.Module, plan: TPPlan | None = None) -> list[str]:
    """Why the default plan (:func:`llama_tp_plan`) does not fit ``model``; empty when it fits.

    It fits when the blocks are at ``layers.*`` and every block rule matches in every block
    (QK-norm rules optional; a block has its ``feed_forward`` rules or a replicated ``moe``),
    and every matmul module (``titanext.plugins._loud.matmul_kind``: ``nn.Linear``, Conv1D, a
    module multiplying by its own 2-D parameter) and ``nn.Embedding`` is named by a rule or sits
    in a ``moe``. A pipeline stage may lack ``tok_embeddings``, ``norm`` and ``output``.
    """
    plan = llama_tp_plan(mla_rope=mla_rope_dim(model), mtp=has_mtp(model)) if plan is None \
        else plan
    modules = dict(model.named_modules())
    names = list(modules)
    targets = {n for key in plan for n in _matching(key, names)}
    blocks = _matching("layers.*", names)
    problems = [] if blocks else ["no blocks at layers.* (an nn.ModuleList / ModuleDict)"]
    block_rules = [k.removeprefix("layers.*.") for k in plan if k.startswith("layers.*.")]
    for b in blocks:
        has_moe = f"{b}.moe" in modules
        for rule in block_rules:
            group = rule.split(".")[0]
            if rule in _OPTIONAL_BLOCK_RULES or (has_moe and group == "feed_forward") or (
                    not has_moe and group == "moe"):
                continue
            if f"{b}.{rule}" not in targets:
                problems.append(f"rule layers.*.{rule} matches nothing in {b}")
    for n, m in modules.items():
        if (isinstance(m, nn.Embedding) or matmul_kind(m) is not None) and n not in targets \
                and ".moe." not in f".{n}.":
            problems.append(f"{n} ({type(m).__name__}) is named by no rule")
    return problems


def _shared_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module FQN, parameter name) that hold one parameter (tied weights)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mod_name, p_name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, shared: list[list[tuple[str, str]]]) -> None:
    """Make tied parameters shared again: ``parallelize_module`` replaces each module's
    parameter separately. Every holder must have ended up with the same placements (say an
    embedding and an output head both sharded on the vocabulary); else ValueError."""
    for group in shared:
        params = [getattr(model.get_submodule(m), n) for m, n in group]
        first = params[0]
        for (m, n), p in zip(group[1:], params[1:]):
            if p is first:
                continue
            same = (isinstance(p, DTensor) and isinstance(first, DTensor)
                    and p.placements == first.placements and p.device_mesh == first.device_mesh)
            if not same:
                raise ValueError(
                    f"apply_tensor_parallel: {group[0][0]}.{group[0][1]} and {m}.{n} are one "
                    "tied parameter, but the plan shards them differently "
                    f"({getattr(first, 'placements', 'not sharded')} vs "
                    f"{getattr(p, 'placements', 'not sharded')}); shard both alike or untie them")
            setattr(model.get_submodule(m), n, first)


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a Linear whose output stacks several parts, each split separately.

    ``split_sizes`` are the parts' output sizes in order, e.g. ``(n_heads * head_dim,
    n_kv_heads * head_dim, n_kv_heads * head_dim)`` for a fused qkv projection or
    ``(hidden, hidden)`` for a fused gate+up; each must be divisible by the tp degree. Rank r
    holds rows r/tp of *every* part, so its local output is ``[q_r | k_r | v_r]`` and the module
    splits it locally with the sizes divided by tp::

        plan = {"layers.*.attn.qkv": FusedColwiseParallel(split_sizes=(q, kv, kv)),
                "layers.*.attn.out": RowwiseParallel()}
        ...
        q, k, v = self.qkv(x).split([q // tp, kv // tp, kv // tp], dim=-1)   # in forward

    How: the rows are permuted into rank-major order (``[q_0; k_0; v_0; q_1; k_1; v_1]``) before
    the ``Shard(0)`` distribution. ``state_dict`` un-permutes (the saved weight is the plain
    ``[q; k; v]`` one, loadable by any layout, at the cost of one all-gather per fused weight)
    and ``load_state_dict`` permutes back. A parameter's or gradient's ``full_tensor()`` is in
    rank-major order: :meth:`to_original` (the module's ``titanext_to_original``) maps it back.
    Only a local output is allowed (``output_layouts=Shard(-1)``, ``use_local_output=True``): a
    gathered output would be in rank-major order too.
    """

    def __init__(self, split_sizes: Sequence[int], *, input_layouts=None):
        super().__init__(input_layouts=input_layouts)
        self.split_sizes = tuple(int(n) for n in split_sizes)
        if not self.split_sizes or min(self.split_sizes) < 1:
            raise ValueError(f"FusedColwiseParallel: split_sizes = {split_sizes!r}; give the "
                             "output size of every fused part, each >= 1")

    def _problems(self, module: nn.Module, tp: int) -> list[str]:
        """What this style can check about ``module`` (it cannot see what the rows mean)."""
        if not isinstance(module, nn.Linear):
            return ["it applies to an nn.Linear"]
        rows = module.weight.shape[0]
        problems = []
        if sum(self.split_sizes) != rows:
            problems.append(f"the split sizes add up to {sum(self.split_sizes)}, but the weight "
                            f"has {rows} rows (out_features): give every part's output size")
        if module.bias is not None and module.bias.shape[0] != rows:
            problems.append(f"the bias has {module.bias.shape[0]} rows, the weight {rows}")
        uneven = [n for n in self.split_sizes if n % tp]
        if uneven:
            problems.append(f"parts {uneven} are not divisible by tp = {tp}")
        return problems

    def _blocks(self, tp: int, to_rank_major: bool) -> list[tuple[int, int]]:
        """(start, length) row ranges whose concatenation reorders the rows."""
        chunks = [n // tp for n in self.split_sizes]
        part_starts = [sum(self.split_sizes[:i]) for i in range(len(chunks))]
        rank_starts = [sum(chunks[:i]) for i in range(len(chunks))]
        per_rank = sum(chunks)
        if to_rank_major:  # rank r's chunk of every part, rank by rank
            return [(part_starts[i] + r * c, c) for r in range(tp) for i, c in enumerate(chunks)]
        return [(r * per_rank + rank_starts[i], c) for i, c in enumerate(chunks) for r in range(tp)]

    def _reorder(self, t: torch.Tensor, tp: int, to_rank_major: bool) -> torch.Tensor:
        return torch.cat([t.narrow(0, start, n) for start, n in self._blocks(tp, to_rank_major)])

    def to_original(self, full: torch.Tensor, tp: int) -> torch.Tensor:
        """A full (gathered) weight, bias or gradient of the fused Linear in ``[q; k; v]`` order."""
        return self._reorder(full, tp, to_rank_major=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for problem in self._problems(module, tp):
            raise ValueError(f"FusedColwiseParallel(split_sizes={self.split_sizes}) on "
                             f"{type(module).__name__}: {problem}. If the rows are grouped per KV "
                             "head ([q_g; k_g; v_g] per group), use ColwiseParallel instead (tp "
                             "must divide the KV heads); see docs/fsdp_tp.md#fused-projections")
        if self.output_layouts != (Shard(-1),) and self.output_layouts != Shard(-1):
            raise ValueError("FusedColwiseParallel keeps its output local (Shard(-1))")
        with torch.no_grad():
            for name, param in list(module.named_parameters(recurse=False)):
                moved = nn.Parameter(self._reorder(param, tp, to_rank_major=True),
                                     requires_grad=param.requires_grad)
                module.register_parameter(name, moved)
        module.register_state_dict_post_hook(self._state_dict_hook(tp))
        module.register_load_state_dict_pre_hook(self._load_hook(tp))
        # what reads named_parameters() (the parity check) maps full values back with it
        module.titanext_to_original = functools.partial(self.to_original, tp=tp)
        return super()._apply(module, device_mesh)

    def _convert(self, value: torch.Tensor, tp: int, to_rank_major: bool) -> torch.Tensor:
        if isinstance(value, DTensor):
            full = self._reorder(value.full_tensor(), tp, to_rank_major)
            return distribute_tensor(full, value.device_mesh, value.placements)
        return self._reorder(value, tp, to_rank_major)

    def _state_dict_hook(self, tp: int):
        def hook(module, state_dict, prefix, local_metadata):
            for name, _ in module.named_parameters(recurse=False):
                if prefix + name in state_dict:
                    value = state_dict[prefix + name].detach()
                    state_dict[prefix + name] = self._convert(value, tp, to_rank_major=False)
        return hook

    def _load_hook(self, tp: int):
        def hook(module, state_dict, prefix, *args):
            for name, _ in module.named_parameters(recurse=False):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = self._convert(state_dict[prefix + name], tp,
                                                              to_rank_major=True)
        return hook

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(split_sizes={self.split_sizes})"


def _matching(pattern: str, names: list[str]) -> list[str]:
    """The module names matching ``pattern`` component by component (fnmatch per component)."""
    if "*" not in pattern:
        return [pattern] if pattern in names else []
    parts = pattern.split(".")
    return [n for n in names if len(n.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def _float8_comm_possible(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          loss_parallel: bool) -> bool:
    """Whether torchao's float8 TP styles can run here; logs why not."""

    backend = str(dist.get_backend(tp_mesh.get_group()))
    if "nccl" not in backend:
        reason = (f"the {backend} backend has no float8 collectives, so TP all-gathers and "
                  "reduce-scatters activations in high precision")
    elif mla_rope_dim(model) is not None:
        reason = ("multi-head latent attention computes its latents replicated over tp from the "
                  "gathered input (no float8 TP style for them), so TP communicates in high "
                  "precision")
    else:
        hp_plan = llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                mtp=has_mtp(model))
        names = [n for n, _ in model.named_modules()]
        linears = [n for key, style in hp_plan.items()
                   if isinstance(style, (ColwiseParallel, RowwiseParallel))
                   and key not in ("tok_embeddings", "output")
                   for n in names if fnmatch.fnmatchcase(n, key)]
        if supports_float8_tp(model, linears):
            return True
        reason = ("float8 TP styles need every block linear to be a tensorwise float8 linear, so "
                  "TP communicates in high precision")
    if dist.get_rank() == 0:
        logging.getLogger("titanext").warning(
            "float8 + tensor parallel: %s (the linears still compute in float8)", reason)
    return False
