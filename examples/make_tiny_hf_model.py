"""Build a tiny Hugging Face model directory locally (no downloads): a byte-level BPE
tokenizer trained on titanext's Shakespeare corpus and a random ``LlamaForCausalLM``.

    python examples/make_tiny_hf_model.py ./tiny_hf            # then see docs/hf_checkpoints.md
    python examples/make_tiny_hf_model.py ./tiny_hf --jsonl ./tiny_corpus.jsonl

The directory holds what a real HF checkpoint holds: config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. ``--jsonl`` also writes the corpus as JSON lines
(one ``{"text": ...}`` per paragraph) for ``[training] dataset = "text"``. Needs
``transformers`` (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources

import torch


def corpus_paragraphs() -> list[str]:
    text = resources.files("titanext").joinpath("assets/shakespeare.txt").read_text("utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def make_tokenizer(directory: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_paragraphs(), trainer=trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)


def make_model(directory: str, vocab_size: int, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab_size,
                      max_position_embeddings=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", help="also write the corpus as JSON lines here")
    args = parser.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    make_tokenizer(args.directory, args.vocab_size)
    make_model(args.directory, args.vocab_size, args.seed)
    if args.jsonl:
        with open(args.jsonl, "w", encoding="utf-8") as f:
            for paragraph in corpus_paragraphs():
                f.write(json.dumps({"text": paragraph}) + "\n")
    print(f"wrote {args.directory}" + (f" and {args.jsonl}" if args.jsonl else ""))


if __name__ == "__main__":
    main()
