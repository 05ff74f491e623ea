"""The plugins: each a plain function (or ParallelStyle) that takes your ``nn.Module`` and a
``DeviceMesh``, plus a small options value, and works on any model that fits its protocol.

==========================================  ================================================
module                                      entry points
==========================================  ================================================
:mod:`~titanext.plugins.fsdp`               ``apply_fsdp`` (FSDP2 / HSDP), ``apply_ddp``
:mod:`~titanext.plugins.tensor_parallel`    ``apply_tensor_parallel``, ``llama_tp_plan``,
                                            ``Conv1DColwiseParallel`` / ``Conv1DRowwiseParallel``
:mod:`~titanext.plugins.tp_coverage`        ``unruled_parameters`` (weights a TP plan misses)
:mod:`~titanext.plugins.replicated_grads`   ``ReplicatedGradCheck``,
                                            ``install_replicated_grad_check`` (an invariant)
:mod:`~titanext.plugins.context_parallel`   ``ring_attention``, ``ulysses_attention``,
                                            ``zigzag_shard`` / ``zigzag_unshard``,
                                            ``apply_context_parallel``
:mod:`~titanext.plugins.expert_parallel`    ``apply_expert_parallel`` (flat or two-level
                                            dispatch, float8 dispatch, hot-expert
                                            replication; its config rules in ``rules``)
:mod:`~titanext.plugins.moe_balancing`      ``MoEBalancing`` (bias and aux-loss balancing)
:mod:`~titanext.plugins.float8`             ``apply_float8`` (torchao; a converter; Linear
                                            and transformers' Conv1D)
:mod:`~titanext.plugins.float8_blockwise`   DeepSeek-style blockwise float8 linears
:mod:`~titanext.plugins.weight_grad`        ``defer_weight_grads`` (zero-bubble I/W split)
:mod:`~titanext.plugins.activation_checkpoint`  ``apply_activation_checkpointing``
:mod:`~titanext.plugins.compile`            ``apply_compile`` (per block)
:mod:`~titanext.plugins.rules`              option values and config rules of the flat
                                            plugins, importable without torch
==========================================  ================================================

:func:`titanext.distributed.parallelize.parallelize` applies them in the trainer's order.
Importing this package imports none of them.
"""
