"""Random checkpoints for tests and benchmarks: a model of a preset's geometry with random weights,
saved as a Hugging Face directory with a byte-level BPE tokenizer (trained in a second on a few
standard-library modules) and a chat template — what `LLM`, `megactx serve` and transformers load.

Nothing here is a trained model: outputs are noise, but deterministic for a seed, so tests can
compare engines token for token and benchmarks measure real work."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megactx.config import ModelConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE of vocab_size tokens (special tokens first) on a few stdlib modules."""
    import inspect
    import json as json_module
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(m) for m in (json_module, inspect, textwrap)], trainer)
    return tok


def make_random_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                           **overrides) -> Path:
    """Write a random model of `preset` (config fields overridden by `overrides`) with a tokenizer
    to `path`; its vocabulary is the tokenizer's (at most the preset's vocab_size), and `<|end|>`
    is its EOS. Returns the directory."""
    from megactx.model import build_model, save_pretrained

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_pretrained(preset)
    tok = train_tokenizer(overrides.pop("vocab_size", cfg.vocab_size))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|end|>")
    cfg = cfg.replace(vocab_size=vocab, eos_token_id=[eos], bos_token_id=None, pad_token_id=eos, **overrides)
    save_pretrained(build_model(cfg, seed=seed), path, dtype=dtype)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "pad_token": "<|end|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return path
