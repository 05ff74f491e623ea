"""Context parallelism: exact ring attention over a sequence split across ranks.

Each of the W ranks of a CP group holds a slice of every sequence. Attention needs all keys
and values, so KV blocks travel around the ring while each rank merges the partial results
with an online softmax (outputs in fp32, log-sum-exps in fp64; as flash attention does
across tiles).

- ``layout="zigzag"`` (the default) cuts the sequence into 2W equal chunks and gives rank r
  chunks r and 2W-1-r. Under a causal mask every ring step then costs every rank exactly half
  a block: the fully masked half is skipped. ``"contiguous"`` (rank r holds chunk r) is kept for
  comparison; its last rank does W times the work of its first.
- ``comm="p2p"`` sends KV to the next rank with ``batch_isend_irecv`` while the current block
  is computed; backward runs the same ring plus a travelling dK/dV accumulator that ends at
  its owner. ``comm="allgather"`` gathers all KV at once and reduce-scatters dK/dV.
- K and V travel with their own (kv_heads) head count, so GQA/MQA models move
  heads/kv_heads times fewer bytes than an expanded implementation.

Nothing here depends on a particular SDPA backend, so it runs on CPU (gloo) and CUDA (nccl).

Under torchrun with 2 ranks, where q, k, v are this rank's zigzag shards:

>>> out = ring_attention(q, k, v, cp_mesh.get_group())  # in a process group  # doctest: +SKIP

See ``apply_context_parallel`` for models and ``ring_attention_sdpa`` for code that calls
``F.scaled_dot_product_attention`` directly.

Beyond the ring (see :func:`ulysses_attention` and :func:`hybrid_attention`):

- **Ulysses** swaps the sequence split for a head split with one all-to-all, attends over the
  whole sequence locally, and swaps back: 4 all-to-alls per layer (2 forward, 2 backward) of
  (q + k + v + out) / W each instead of the ring's 2W-1 KV messages.
- **Hybrid** runs Ulysses inside groups of u ranks and the ring across the cp/u groups.
- **Document masking**: ``document_ids`` ([batch, local_seq], in q's layout) keep attention
  inside each packed document; the ring skips every block and tile without a shared document.
- **Sliding windows**: ``window=w`` lets the query at global position i see keys
  i - w < j <= i (transformers' sliding-window mask, Gemma 3 / Mistral / GPT-OSS); blocks and
  tiles outside every window are skipped, and a contiguous p2p ring stops sending early.
  ``sinks`` ([heads]) are GPT-OSS's per-head attention sinks.
"""

from titanext.plugins._attention_kernels import KERNELS
from titanext.plugins.context_parallel._comm import (
    CommCounter,
    WorkCounter,
    count_comm,
    count_work,
)
from titanext.plugins.context_parallel._layout import (
    LAYOUTS,
    POSITIONS_SHAPES,
    cp_rank,
    cp_world_size,
    layout_positions,
    prepare_batch,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    zigzag_shard,
    zigzag_unshard,
)
from titanext.plugins.context_parallel._models import (
    MODEL_COMMS,
    RingAttentionFn,
    apply_context_parallel,
    attention_fn_holders,
    check_options,
    cp_attention_fn,
    ring_attention_sdpa,
)
from titanext.plugins.context_parallel._ring import (
    COMMS,
    RingPlan,
    _step_slices,
    plan_work,
    ring_attention,
    ring_steps,
)
from titanext.plugins.context_parallel._ulysses import (
    check_heads,
    hybrid_attention,
    ulysses_attention,
    ulysses_order,
)

__all__ = [
    "LAYOUTS", "COMMS", "KERNELS", "ring_attention", "ulysses_attention", "hybrid_attention",
    "zigzag_shard", "zigzag_unshard", "shard_sequence", "unshard_sequence", "shard_batch",
    "layout_positions", "apply_context_parallel", "ring_attention_sdpa", "RingAttentionFn",
    "check_options", "check_heads", "CommCounter", "count_comm", "WorkCounter", "count_work",
    "RingPlan", "plan_work", "ulysses_order", "_step_slices",
    "ring_steps", "MODEL_COMMS", "cp_attention_fn",
    "cp_rank", "cp_world_size", "prepare_batch", "POSITIONS_SHAPES", "attention_fn_holders",
]
