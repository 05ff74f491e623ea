"""Tiny Hugging Face artifacts built inside the tests (no downloads): a byte-level BPE
tokenizer trained with ``tokenizers`` on the shipped corpus, and tiny ``LlamaForCausalLM`` /
``MixtralForCausalLM`` models saved with ``save_pretrained``."""

from __future__ import annotations

import json
import os
from importlib import resources

import torch

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # > TOKENIZER_VOCAB, as real models pad their embedding


def shakespeare_lines(limit: int = 4000) -> list[str]:
    text = resources.files("titanext").joinpath("assets/shakespeare.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()][:limit]


def make_bpe_tokenizer(directory: str, vocab_size: int = TOKENIZER_VOCAB) -> str:
    """Train a byte-level BPE on the corpus; write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(shakespeare_lines(), trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return directory


def make_tiny_llama(directory: str, *, tie: bool = False, rope_scaling: bool = False,
                    vocab_size: int = MODEL_VOCAB, layers: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float32, tokenizer: bool = True):
    """A random tiny LlamaForCausalLM (GQA 4 heads / 2 kv heads) saved to ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    extra = {}
    if rope_scaling:
        extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                      tie_word_embeddings=tie, max_position_embeddings=256,
                      rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                      **extra)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(directory)
    if tokenizer:
        make_bpe_tokenizer(directory)
    return model


def make_tiny_mixtral(directory: str, *, experts: int = 4, seed: int = 0):
    """A random tiny MixtralForCausalLM (top-2 of ``experts``) saved to ``directory``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=MODEL_VOCAB,
                        num_local_experts=experts, num_experts_per_tok=2,
                        max_position_embeddings=256, rms_norm_eps=1e-5)
    model = MixtralForCausalLM(cfg).float()
    model.save_pretrained(directory)
    return model


def make_tiny_qwen3(directory: str, *, moe: bool = False, seed: int = 0, **extra):
    """A random tiny Qwen3ForCausalLM (QK-norm, head_dim 32 != 64 / 4) or Qwen3MoeForCausalLM
    (4 experts, top-2) saved to ``directory``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  vocab_size=MODEL_VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6)
    if moe:
        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, **extra)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, **extra))
    model.float().save_pretrained(directory)
    return model


def make_tiny_deepseek_v3(directory: str, *, layers: int = 3, mtp: int = 1, seed: int = 0,
                          q_lora_rank: int | None = 32, rope_interleave: bool = True):
    """A random tiny DeepseekV3ForCausalLM saved to ``directory``, with ``mtp`` multi-token
    prediction layers stored as DeepSeek-V3 stores them (``model.layers.{layers + k}``: the
    block, enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and the head),
    which ``save_pretrained`` leaves out. MLA (q_lora_rank 32, kv_lora_rank 16, qk 16 + 8,
    v 12), YaRN, 8 experts in 4 groups (top-2 of 2 groups), block 0 dense; norms, the routing
    bias and the MTP weights random (not their identity init), so that a wrong name shows.

    Returns (main model, {MTP tensor name: tensor}) as transformers holds them."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)

    def config(n_layers: int) -> DeepseekV3Config:
        return DeepseekV3Config(
            vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank,
            qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
            num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
            max_position_embeddings=1024, rms_norm_eps=1e-6, rope_interleave=rope_interleave,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            num_mtp_layers=mtp, bos_token_id=0, eos_token_id=1)

    full = DeepseekV3ForCausalLM(config(layers + mtp)).float()  # the MTP blocks as layers
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in full.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    full.save_pretrained(directory)
    state = load_file(os.path.join(directory, "model.safetensors"))
    extra = {}
    for k in range(mtp):
        p = f"model.layers.{layers + k}."
        extra.update({p + "enorm.weight": torch.rand(64) + 0.5,
                      p + "hnorm.weight": torch.rand(64) + 0.5,
                      p + "eh_proj.weight": 0.05 * torch.randn(64, 128),
                      p + "shared_head.norm.weight": torch.rand(64) + 0.5})
        state[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    state.update(extra)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=mtp)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    main = DeepseekV3ForCausalLM(config(layers)).float()
    main.load_state_dict({k: v for k, v in full.state_dict().items()
                          if not k.startswith(tuple(f"model.layers.{layers + k}."
                                                    for k in range(mtp)))})
    blocks = [full.model.layers[layers + k] for k in range(mtp)]
    return main, blocks, extra


def deepseek_mtp_reference(main, blocks, extra: dict, layers: int):
    """transformers' own ``MtpModel`` for ``main`` with the MTP weights of
    :func:`make_tiny_deepseek_v3` (its from_pretrained finds only layer 61's)."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(main, len(blocks)).float()
    with torch.no_grad():
        for k, layer in enumerate(mtp.layers):
            layer.mtp_block = blocks[k]
            p = f"model.layers.{layers + k}."
            layer.enorm.weight.copy_(extra[p + "enorm.weight"])
            layer.hnorm.weight.copy_(extra[p + "hnorm.weight"])
            layer.eh_proj.weight.copy_(extra[p + "eh_proj.weight"])
            layer.post_norm.weight.copy_(extra[p + "shared_head.norm.weight"])
    return mtp.eval()
