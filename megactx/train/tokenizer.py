"""The tokenizer of megactx models: a byte-level BPE trained on the code corpus with `tokenizers`,
saved as a Hugging Face tokenizer directory (`tokenizer.json` + `tokenizer_config.json` with the chat
template) that `megactx.engine.tokenizer.Tokenizer` and `transformers.AutoTokenizer` both load.

Pre-tokenization, in order:
1. split after every "\\n": no token spans a line boundary, so the ids of a text are the ids of its
   lines, one after another. The needle tasks rely on it: they build haystacks from per-line ids
   tokenized once, and insert needles between lines without re-tokenizing anything;
2. digits one by one: a number (a needle's value) always becomes the same tokens, whatever surrounds it;
3. GPT-2's byte-level rule (words with their leading space, runs of punctuation, runs of spaces), so
   every byte string is representable and decoding is lossless.

Special tokens come first in the vocabulary (ids 0..4): `<|end|>` ends a document and a chat turn (the
model's EOS and pad), `<|user|>`, `<|assistant|>`, `<|system|>`, `<|tool|>` open chat turns. The chat
template renders `<|role|>\\ncontent<|end|>\\n` per message, as `megactx.testing`'s does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END = "<|end|>"
SPECIAL_TOKENS = (END, "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_VOCAB_SIZE = 4096  # the tiny preset's vocabulary
NUM_BYTES = 256  # byte-level BPE starts from one token per byte value


def _byte_level() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def new_tokenizer() -> Tokenizer:
    """The untrained pipeline described in the module docstring."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="merged_with_previous"),
        pre_tokenizers.Digits(individual_digits=True),
        _byte_level(),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` tokens (special tokens and all 256 bytes included)
    on `texts`. Deterministic: the same texts in the same order give the same vocabulary and merges."""
    if vocab_size < NUM_BYTES + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {NUM_BYTES + len(SPECIAL_TOKENS)} "
                         f"(every byte and the special tokens), got {vocab_size}")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | Path) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` (chat template, EOS = pad = `<|end|>`) into
    `directory` (created if needed), e.g. a checkpoint directory; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": END,
        "pad_token": END,
        # transformers would otherwise "clean up" spaces before punctuation, which changes code
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` saved in `directory` (the fast path the data pipeline uses)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json; write one with save_tokenizer")
    return Tokenizer.from_file(str(path))


def fingerprint(tok: Tokenizer) -> str:
    """A hash of the whole tokenizer (vocabulary, merges, pipeline): keys caches of token ids."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def token_byte_lengths(tok: Tokenizer) -> torch.Tensor:
    """[vocab] int64: how many bytes of text each token stands for; 0 for special tokens, which
    stand for no text. Summed over the ids of a text it gives the text's UTF-8 length, the
    denominator of bits per byte."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())  # one printable character per byte value
    special = set(SPECIAL_TOKENS)
    lengths = torch.zeros(tok.get_vocab_size(), dtype=torch.int64)
    for token, token_id in tok.get_vocab().items():
        if token in special:
            continue
        if not set(token) <= alphabet:
            raise ValueError(f"token {token!r} is not byte-level; token_byte_lengths needs a byte-level BPE")
        lengths[token_id] = len(token)
    return lengths
