"""What differs between the torch versions titanext supports (2.11 to 2.14.1), outside the two
areas that have their own module (pipelining: ``schedules/_torch_ir.py``; the dry run:
``_fake_backend.py``).

Each difference is detected by feature (``hasattr``), never by version string, and titanext
reaches it through the name here only:

- :func:`reduce_scatter_single`: torch 2.13 renamed ``dist.reduce_scatter_tensor`` to
  ``reduce_scatter_single`` (and deprecated the old name); 2.11 has only the old one.
- :func:`trunc_normal_`: torch 2.12 replaced ``nn.init.trunc_normal_``'s inverse-CDF sampler
  by a rejection sampler, so the same generator gave different weights on 2.11 (the debug
  model's step-1 loss at seed 7: 6.6337 on 2.11, 6.8509 on 2.13). titanext samples with its own
  copy of the newer algorithm, so one seed starts the same model on every supported torch.

It is also the one place outside those two modules that reaches a private torch name (one
with a leading underscore; ``tests/docs/test_private_torch_api.py`` enforces it), so a rename
in a new torch is fixed here:

- :data:`grouped_mm` (``torch._grouped_mm``, None where this torch lacks it): the MoE experts'
  grouped GEMM and its deferred weight gradient;
- :func:`flash_attention_cpu`, :func:`flash_attention_cpu_backward`,
  :func:`flash_attention_cuda`, :func:`flash_attention_cuda_backward`: the ATen flash kernels
  that return the log-sum-exp the ring attention merges by;
- :data:`foreach_mul_` (``torch._foreach_mul_``): one kernel launch to scale many gradients;
- :data:`profiler_enabled`: whether a profiler collects (one C call, no allocation);
- :func:`aten_op_names`: every ATen operator name (a config hint's "did you mean");
- :func:`set_pg_timeout`: shorten the default process group's collective timeout;
- :func:`abort_all_process_groups`, :func:`default_store`: tear every group down at once, and the
  store the default group was started with (titanext.distributed.failsafe);
- :func:`record_cuda_memory_history`, :func:`cuda_memory_snapshot`: CUDA's allocator history;
- :data:`pytree`: torch's pytree utilities;
- :func:`view_base`: the tensor a view shares its storage with (``Tensor._base``);
- :func:`inductor_cache_options`: ``torch.compile`` options that key inductor's cache by the CPU
  vector ISA it generates C++ for (``torch._inductor.cpu_vec_isa``).
- :func:`fsdp_reduce_dtype_accumulators`, :func:`fold_into_reduce_dtype`: FSDP2's per-parameter
  gradient accumulator in the reduce dtype, which a deferred weight gradient joins at once.

Not private, but shaped by the torch version: :func:`pinned_async_save_options`, the
``async_save`` options of ``[checkpoint] async_mode = "async_with_pinned_mem"``.

Leaf module: imports torch only.
"""

from __future__ import annotations

import datetime
import inspect
import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["aten_op_names", "view_base", "cuda_memory_snapshot", "flash_attention_cpu",
           "flash_attention_cpu_backward", "flash_attention_cuda", "flash_attention_cuda_backward",
           "foreach_mul_", "grouped_mm", "profiler_enabled", "pytree", "record_cuda_memory_history",
           "reduce_scatter_single", "set_pg_timeout", "trunc_normal_",
           "abort_all_process_groups", "assert_on_device", "default_store",
           "inductor_cache_options", "fsdp_reduce_dtype_accumulators", "fold_into_reduce_dtype"]

#: ``torch._grouped_mm(a, b, offs=...)`` where this torch has it (CPU from 2.9), else None.
grouped_mm = getattr(torch, "_grouped_mm", None)

#: ``torch._foreach_mul_(tensors, scalar_or_tensor)``, in place.
foreach_mul_ = torch._foreach_mul_

#: ``profiler_enabled()``: whether an autograd profiler is collecting.
profiler_enabled = torch._C._autograd._profiler_enabled


def flash_attention_cpu(q, k, v, dropout_p: float, causal: bool, *, scale: float, attn_mask=None):
    """ATen's CPU flash attention: (out, logsumexp)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, causal, scale=scale, attn_mask=attn_mask)


def flash_attention_cpu_backward(dout, q, k, v, out, lse, dropout_p: float, causal: bool, *,
                                 scale: float, attn_mask=None):
    """Its backward: (dq, dk, dv)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, dropout_p, causal, scale=scale, attn_mask=attn_mask)


def flash_attention_cuda(q, k, v, dropout_p: float, causal: bool, return_debug_mask: bool, *,
                         scale: float):
    """ATen's CUDA flash attention: (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    philox_seed, philox_offset, debug_mask)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, causal, return_debug_mask, scale=scale)


def flash_attention_cuda_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q: int,
                                  max_k: int, dropout_p: float, causal: bool, philox_seed,
                                  philox_offset, *, scale: float):
    """Its backward: (dq, dk, dv)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, causal,
        philox_seed, philox_offset, scale=scale)


def aten_op_names() -> list[str]:
    """Every registered operator name (``"aten::mm"``, ...)."""
    return torch._C._dispatch_get_all_op_names()


def set_pg_timeout(seconds: float) -> bool:
    """Set the default process group's collective timeout; False where this torch cannot."""
    try:
        # feature probe: this torch may lack it
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return False
    _set_pg_timeout(datetime.timedelta(seconds=seconds), None)
    return True


def abort_all_process_groups() -> bool:
    """Abort every process group of this process now, without waiting for peers (gloo closes
    its sockets, NCCL aborts its communicators); False where this torch has no such call."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


def default_store():
    """The key-value store the default process group was started with (None if there is none)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    return getter()


def record_cuda_memory_history(on: bool, max_entries: int) -> None:
    """Start (``on``) or stop recording CUDA allocator events with their stacks."""
    torch.cuda.memory._record_memory_history("all" if on else None, max_entries=max_entries)


def cuda_memory_snapshot() -> dict:
    """The recorded allocator history (the pickle that pytorch.org/memory_viz reads)."""
    return torch.cuda.memory._snapshot()

#: ``dist.reduce_scatter_single`` where this torch has it (2.13+), else the older name.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


@torch.no_grad()
def trunc_normal_(t: torch.Tensor, mean: float, std: float, a: float, b: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with normal(``mean``, ``std``) values truncated to ``[a, b]``, drawing from
    ``generator`` exactly as ``torch.nn.init.trunc_normal_`` of torch 2.12+ does (the same
    values on torch 2.11, whose own sampler differs).

    >>> g = lambda: torch.Generator().manual_seed(0)
    >>> x = trunc_normal_(torch.empty(1000), 0.0, 0.02, -0.04, 0.04, generator=g())
    >>> bool(x.abs().max() <= 0.04)
    True
    """
    if t.is_meta:
        return t
    if _norm_cdf((b - mean) / std) - _norm_cdf((a - mean) / std) > 0.3:
        # most draws land inside: redraw the ones outside until none is
        lo, hi = t.new_tensor(a, device="cpu").item(), t.new_tensor(b, device="cpu").item()
        t.normal_(mean, std, generator=generator)
        while (mask := (t < lo) | (t > hi)).any():
            t.copy_(torch.where(mask, torch.empty_like(t).normal_(mean, std, generator=generator),
                                t))
        return t
    # a narrow window: uniform proposals on [a, b], accepted with the normal's relative density
    log_peak = -0.5 * ((max(a, min(mean, b)) - mean) / std) ** 2
    candidates, accept = torch.empty_like(t), torch.empty_like(t)

    def rejected(x: torch.Tensor) -> torch.Tensor:  # overwrites candidates with log densities
        candidates.copy_(x).sub_(mean).div_(std).pow_(2).mul_(-0.5).sub_(log_peak)
        return accept.uniform_(generator=generator).log_().gt(candidates)

    t.uniform_(a, b, generator=generator)
    pending = rejected(t)
    result = t
    while pending.any():
        candidates.uniform_(a, b, generator=generator)
        result = torch.where(pending, candidates, result)
        pending = torch.where(pending, rejected(candidates), pending)
    if result is not t:
        t.copy_(result)
    return t


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail where ``condition`` (a 0-dim bool tensor) is False, checked on its device without a
    host sync (a device-side assert on CUDA): torch's private ``_assert_async``."""
    torch._assert_async(condition, message)


def pinned_async_save_options() -> dict:
    """Keyword arguments for ``dcp.async_save`` that stage into pinned (and shared) memory and
    write from a separate checkpoint process (no GIL contention with training); {} where this
    torch's ``async_save`` lacks ``async_stager`` / ``async_checkpointer_type`` (then it stages
    into plain CPU memory and writes from a thread). Pinning and non-blocking copies need an
    accelerator; on a CPU-only machine the staging is a plain copy. The caller closes
    ``options["async_stager"]`` after the last save."""


    params = inspect.signature(dcp.async_save).parameters
    if "async_stager" not in params or "async_checkpointer_type" not in params:
        return {}
    try:  # feature probes: this torch may lack them
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return {}

    accelerator = torch.accelerator.is_available()
    options = StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                             use_async_staging=True, use_non_blocking_copy=accelerator)
    return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS,
            "async_stager": DefaultStager(options)}


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage the view ``t`` shares (the root of a chain of views), or None
    when ``t`` is not a view (recompute by module recognizes a region's output in a view)."""
    return t._base


def inductor_cache_options(backend: str) -> dict | None:
    """``torch.compile(..., options=)`` for ``backend``: for inductor, the width of the CPU vector
    ISA it generates C++ for (``cpp.simdlen``; the ISA it picks anyway), else None.

    Inductor's FX graph cache (on disk, shared by every process of a user) keys generated code
    by the graph and inductor's config, not by the vector ISA, which ``ATEN_CPU_CAPABILITY``
    or the CPU decides; the C++ compile of a cache hit takes this process's ISA. Kernels
    written for 16-float AVX-512 vectors, built for 8-float AVX2 ones, read and write past
    their buffers: NaN, heap corruption or an abort (torch 2.13; the other way round too),
    after any earlier compile of the same graph under another ISA on this machine or on a
    shared cache folder (docs/cpu_kernel_paths.md). Naming the width puts it in the key.
    """
    if backend != "inductor":
        return None
    # deferred: loading inductor costs seconds, and only a compile needs it
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return {"cpp.simdlen": isa.bit_width()} if isa else None


def fsdp_reduce_dtype_accumulators(module: torch.nn.Module) -> dict[int, object]:
    """FSDP2's per-parameter state of every parameter under ``module`` whose gradient is
    accumulated in another dtype than the parameter's (``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``), keyed by ``id`` of the unsharded parameter the forward uses.

    FSDP2 converts a backward's param-dtype gradient to the reduce dtype in its post-backward
    hook. A weight gradient written after that hook (a deferred W) stays in the param dtype
    until the next backward of that module, and several such W's sum in it:
    :func:`fold_into_reduce_dtype` moves it at once, as the hook would."""
    found = {}
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = fully_shard.state(m)._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            param = getattr(fp, "_unsharded_param", None)
            if param is not None and fp.reduce_dtype not in (None, param.dtype):
                found[id(param)] = fp
    return found


def fold_into_reduce_dtype(fsdp_param) -> None:
    """Add the unsharded parameter's param-dtype ``.grad`` into FSDP2's reduce-dtype
    accumulator (creating it on the first fold) and drop it: FSDP2's own two steps of its
    post-backward, in its order (the same methods on torch 2.11 to 2.14.1)."""
    fsdp_param.accumulate_unsharded_grad_if_needed()
    fsdp_param.to_accumulated_grad_if_needed()
