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
