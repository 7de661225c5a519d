"""Training data: the corpus tokenized once and cached, packed into fixed-length sequences for
next-token prediction, sharded for data parallel, and the bits-per-byte accounting of held-out loss.

One call prepares everything in a directory and reuses it afterwards:

    data = prepare_data("runs/data", vocab_size=4096)  # manifest.json, tokenizer/, tokens-*.npz
    train = data.pretraining_dataset(seq_len=1024, seed=epoch, rank=rank, world_size=world_size)
    batch = next(iter(DataLoader(train, batch_size=8)))  # {"input_ids": [8, 1025], "loss_mask": [8, 1024]}
    needles = data.needles("held_out")                # megactx.train.needles.NeedleGenerator
    evaluation = needle_generator(model_dir)          # the same tasks for any checkpoint's tokenizer
    data.save_tokenizer(checkpoint_dir)               # tokenizer.json + chat template beside the weights

Every example, whatever its source, is a dict `{"input_ids": int64 [L + 1], "loss_mask": bool [L]}`:
the model reads `input_ids[:-1]`, predicts `input_ids[1:]`, and the loss counts target j only where
`loss_mask[j]` (all of them for pretraining text; only the answer for needle tasks).

Documents are the corpus files, each followed by `<|end|>`; their order for a seed is fixed by hashing
(seed, path), and the rows of the packed stream are ordered by hashing (seed, row): nothing depends on
a random number generator's implementation, so every machine and library version packs the same rows.

`python -m megactx.train.data DIR` prepares DIR and prints the corpus and tokenizer figures.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from megactx.train.corpus import MANIFEST, SPLITS, Corpus
from megactx.train.needles import NeedleGenerator
from megactx.train.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    END,
    fingerprint,
    load_tokenizer,
    save_tokenizer,
    token_byte_lengths,
    train_tokenizer,
)

NEWLINE_BYTE = "\u010a"  # "\n" as the byte-level alphabet writes it
CORPUS_SNAPSHOT = "corpus"  # prepare_data reads DIR/corpus/ (a Corpus snapshot) instead of the stdlib when present
TOKENIZER_DIR = "tokenizer"


def _hash_key(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()


def hash_order(keys: list[str], seed: int) -> np.ndarray:
    """[len(keys)] int64: a permutation of range(len(keys)) fixed by (seed, key) alone."""
    return np.array(sorted(range(len(keys)), key=lambda i: _hash_key(seed, keys[i])), dtype=np.int64)


@dataclass(frozen=True)
class SplitTokens:
    """The token ids of one split's files, back to back in path order."""

    tokens: np.ndarray  # [num_tokens] int32
    line_starts: np.ndarray  # [num_lines + 1] int64: line i is tokens[line_starts[i]:line_starts[i + 1]]
    doc_starts: np.ndarray  # [num_docs + 1] int64: file j is tokens[doc_starts[j]:doc_starts[j + 1]]
    paths: tuple[str, ...]  # [num_docs]
    num_bytes: int  # UTF-8 bytes of the split's text

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def document(self, j: int) -> np.ndarray:
        return self.tokens[self.doc_starts[j] : self.doc_starts[j + 1]]

    def around(self, first: int, length: int) -> np.ndarray:
        """[length] ids from token `first` on, around the split again past its end (a long haystack)."""
        return self.tokens[(first + np.arange(length)) % self.num_tokens]


@dataclass(frozen=True)
class TokenizedCorpus:
    """Every file of a corpus tokenized once (whole files: the tokenizer never merges across lines,
    so line boundaries are token boundaries). Cached as one .npz keyed by corpus and tokenizer hash."""

    tokens: np.ndarray  # [num_tokens] int32, files back to back in corpus (path) order
    file_starts: np.ndarray  # [num_files + 1] int64 token offsets
    line_starts: np.ndarray  # [num_lines + 1] int64 token offsets; every file starts a line
    file_bytes: np.ndarray  # [num_files] int64
    held_out: np.ndarray  # [num_files] bool
    paths: tuple[str, ...]
    corpus_sha256: str
    tokenizer_sha256: str

    @classmethod
    def build(cls, corpus: Corpus, tok: Tokenizer) -> TokenizedCorpus:
        encodings = tok.encode_batch([f.text for f in corpus.files], add_special_tokens=False)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        tokens = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int32, count=int(lengths.sum()))
        file_starts = np.concatenate([[0], np.cumsum(lengths)])
        # a line ends with the one token that ends in "\n" (the pre-tokenizer splits after each newline)
        ends_line = np.zeros(tok.get_vocab_size(), dtype=bool)
        for token, token_id in tok.get_vocab().items():
            ends_line[token_id] = token.endswith(NEWLINE_BYTE)
        line_starts = np.union1d(np.flatnonzero(ends_line[tokens]) + 1, file_starts)
        return cls(tokens, file_starts, line_starts.astype(np.int64),
                   np.array([f.num_bytes for f in corpus.files], dtype=np.int64),
                   np.array([f.held_out for f in corpus.files], dtype=bool),
                   tuple(f.path for f in corpus.files), corpus.sha256, fingerprint(tok))

    def save(self, path: str | Path) -> None:
        meta = {"paths": list(self.paths), "corpus_sha256": self.corpus_sha256,
                "tokenizer_sha256": self.tokenizer_sha256}
        np.savez(path, tokens=self.tokens, file_starts=self.file_starts, line_starts=self.line_starts,
                 file_bytes=self.file_bytes, held_out=self.held_out, meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: str | Path) -> TokenizedCorpus:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return cls(z["tokens"], z["file_starts"], z["line_starts"], z["file_bytes"], z["held_out"],
                       tuple(meta["paths"]), meta["corpus_sha256"], meta["tokenizer_sha256"])

    @classmethod
    def load_or_build(cls, corpus: Corpus, tok: Tokenizer, cache_dir: str | Path) -> TokenizedCorpus:
        """The cached ids of `corpus` under `tok` in `cache_dir`, built and saved on first use."""
        key = hashlib.sha256((corpus.sha256 + fingerprint(tok)).encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"tokens-{key}.npz"
        if path.is_file():
            return cls.load(path)
        built = cls.build(corpus, tok)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.partial.npz")  # no process reads half a file
        built.save(tmp)
        tmp.replace(path)
        return built

    def split(self, name: str) -> SplitTokens:
        """The ids of split `name` ("train" or "held_out")."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        chosen = np.flatnonzero(self.held_out == (name == "held_out"))
        if len(chosen) == 0:
            raise ValueError(f"the corpus has no {name} files; use a larger corpus or another held_out_fraction")
        pieces, lines, docs, offset = [], [], [0], 0
        for j in chosen:
            start, end = self.file_starts[j], self.file_starts[j + 1]
            lo, hi = np.searchsorted(self.line_starts, [start, end])
            in_file = self.line_starts[lo:hi]
            pieces.append(self.tokens[start:end])
            lines.append(in_file - start + offset)
            offset += end - start
            docs.append(offset)
        return SplitTokens(np.concatenate(pieces), np.concatenate([*lines, [offset]]).astype(np.int64),
                           np.array(docs, dtype=np.int64), tuple(self.paths[j] for j in chosen),
                           int(self.file_bytes[chosen].sum()))


def document_stream(split: SplitTokens, end_id: int, seed: int) -> torch.Tensor:
    """[num_tokens + num_docs] int64: the split's documents in the order hashed from `seed`, each
    followed by `end_id`."""
    order = hash_order(list(split.paths), seed)
    end = np.array([end_id], dtype=np.int32)
    pieces = [p for j in order for p in (split.document(j), end)]
    return torch.from_numpy(np.concatenate(pieces).astype(np.int64))


def pack_sequences(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len + 1] rows of `stream` [n], consecutive rows overlapping by one token, so every
    token after the first is a target exactly once; N = (n - 1) // seq_len, the tail is dropped."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if len(stream) < seq_len + 1:
        raise ValueError(f"the stream has {len(stream)} tokens, fewer than one sequence of seq_len + 1 = "
                         f"{seq_len + 1}; use a shorter seq_len or a larger split")
    return stream.unfold(0, seq_len + 1, seq_len)


class PackedDataset(torch.utils.data.Dataset):
    """Rows of `sequences` [N, L + 1] for one data-parallel rank, as training examples.

    Rank r of W takes rows r, r + W, r + 2W, ... of the row order, N // W of them, so ranks never share
    a row and all take the same number of steps. The row order is hashed from `seed` (rows of one file
    sit apart), so a DataLoader needs no shuffle of its own."""

    def __init__(self, sequences: torch.Tensor, seed: int = 0, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if len(sequences) < world_size:
            raise ValueError(f"{len(sequences)} sequences cannot feed {world_size} ranks; use a shorter seq_len")
        order = hash_order([str(i) for i in range(len(sequences))], seed)
        per_rank = len(sequences) // world_size
        self.rows = torch.from_numpy(order[rank::world_size][:per_rank])  # [per_rank] indices into sequences
        self.sequences = sequences  # [N, L + 1] int64

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.sequences[self.rows[i]].clone()  # [L + 1]
        return {"input_ids": ids, "loss_mask": torch.ones(len(ids) - 1, dtype=torch.bool)}


def bits_per_byte(nll_nats: float, num_bytes: int) -> float:
    """Loss summed over a text's tokens (nats) -> bits per byte of that text: independent of the
    tokenizer, so models with different vocabularies compare."""
    if num_bytes <= 0:
        raise ValueError(f"num_bytes must be positive, got {num_bytes}")
    return nll_nats / (math.log(2.0) * num_bytes)


class BitsPerByte:
    """Accumulates held-out loss as bits per byte. Targets that stand for no text (special tokens
    such as `<|end|>` between documents) count neither their loss nor bytes."""

    def __init__(self, byte_lengths: torch.Tensor):
        self.byte_lengths = byte_lengths  # [vocab] int64, from tokenizer.token_byte_lengths
        self.totals = torch.zeros(3, dtype=torch.float64)  # nats, bytes, tokens

    def update(self, nll: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """nll: [*] per-target loss in nats (cross-entropy, reduction="none"); targets: [*] ids; mask: [*] bool."""
        nbytes = self.byte_lengths.to(targets.device)[targets]
        keep = nbytes > 0 if mask is None else (nbytes > 0) & mask
        self.totals += torch.stack([nll.detach().double()[keep].sum(), nbytes[keep].double().sum(),
                                    keep.double().sum()]).cpu()

    def all_reduce(self) -> None:
        """Sum the totals over the ranks of the default process group (no-op without one)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.totals)

    @property
    def num_bytes(self) -> int:
        return int(self.totals[1])

    @property
    def value(self) -> float:
        return bits_per_byte(float(self.totals[0]), self.num_bytes)


@dataclass(frozen=True)
class TrainingData:
    """A prepared data directory: the corpus, its tokenizer, and the cached token ids."""

    directory: Path
    corpus: Corpus
    tokenizer: Tokenizer
    tokens: TokenizedCorpus

    @property
    def end_id(self) -> int:
        return self.tokenizer.token_to_id(END)

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / TOKENIZER_DIR

    def split(self, name: str) -> SplitTokens:
        return self.tokens.split(name)

    def pretraining_sequences(self, seq_len: int, split: str = "train", seed: int = 0) -> torch.Tensor:
        """[N, seq_len + 1] int64: the split's documents (order from `seed`) packed into rows."""
        return pack_sequences(document_stream(self.split(split), self.end_id, seed), seq_len)

    def pretraining_dataset(self, seq_len: int, split: str = "train", seed: int = 0, rank: int = 0,
                            world_size: int = 1) -> PackedDataset:
        """This rank's share of the packed split; a new `seed` (e.g. one per epoch) re-packs it."""
        return PackedDataset(self.pretraining_sequences(seq_len, split, seed), seed, rank, world_size)

    def needles(self, split: str = "held_out") -> NeedleGenerator:
        """Needle tasks whose haystacks are code of `split`."""
        return NeedleGenerator(self.split(split), self.tokenizer)

    def bits_per_byte(self) -> BitsPerByte:
        return BitsPerByte(token_byte_lengths(self.tokenizer))

    def save_tokenizer(self, directory: str | Path) -> Path:
        """Write this tokenizer (with the chat template) into `directory`, e.g. a checkpoint."""
        return save_tokenizer(self.tokenizer, directory)


@contextmanager
def directory_lock(directory: str | Path) -> Iterator[Path]:
    """Hold an exclusive lock on `directory` (created if needed; the lock is its file .lock) for the
    block: processes that prepare one directory at once, e.g. MTP stages started side by side with
    --init on a fresh machine, take turns, and the later ones find it ready. A directory this process
    cannot write (a shared, prepared one) is used without a lock."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(directory / ".lock", "a")
    except OSError:  # a read-only directory: read, never prepared, so no process writes there either
        lock = None
    if lock is None:
        yield directory
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield directory


def prepare_data(directory: str | Path, corpus: Corpus | None = None,
                 vocab_size: int = DEFAULT_VOCAB_SIZE, tokenizer: Tokenizer | None = None,
                 tokenizer_source: str = "the tokenizer given") -> TrainingData:
    """Prepare `directory` once and load it afterwards: `manifest.json` (the corpus), `tokenizer/`
    (trained on the train split), `tokens-*.npz` (the cache of ids).

    corpus: default `directory/corpus/` if it holds a snapshot, else this interpreter's stdlib.
    tokenizer: use this one instead of training one (a model's, to train that model further:
    its token ids only mean its own tokens); `tokenizer_source` names it in errors.
    A directory prepared from another corpus, with another vocab_size, or with a tokenizer other
    than `tokenizer`, is refused rather than silently retrained: models trained on it depend on its
    tokenizer."""
    directory = Path(directory)
    with directory_lock(directory):  # another process may be preparing it now
        if corpus is None:
            snapshot = directory / CORPUS_SNAPSHOT
            corpus = Corpus.from_directory(snapshot) if (snapshot / MANIFEST).is_file() else Corpus.from_stdlib()
        manifest = directory / MANIFEST
        if manifest.is_file():
            try:
                corpus.verify(manifest)
            except ValueError as e:
                raise ValueError(f"{directory} was prepared from another corpus: {e}; or prepare a new "
                                 "directory") from None
        else:
            manifest.write_text(json.dumps(corpus.manifest(), indent=1))
        tok_dir = directory / TOKENIZER_DIR
        if (tok_dir / "tokenizer.json").is_file():
            tok = load_tokenizer(tok_dir)
            if tokenizer is not None and fingerprint(tok) != fingerprint(tokenizer):
                raise ValueError(f"{tok_dir} holds another tokenizer than {tokenizer_source} (trained on another "
                                 "corpus or by another version): its token ids would mean other tokens. Prepare a new "
                                 "data directory with that tokenizer (python -m megactx.train.data NEW_DIR --tokenizer "
                                 "MODEL)")
            if tok.get_vocab_size() != vocab_size:
                raise ValueError(f"{tok_dir} holds a tokenizer of {tok.get_vocab_size()} tokens, not vocab_size="
                                 f"{vocab_size}; pass vocab_size={tok.get_vocab_size()} or prepare a new directory")
        elif tokenizer is not None:
            tok = tokenizer
            save_tokenizer(tok, tok_dir)
        else:
            tok = train_tokenizer((f.text for f in corpus.split("train")), vocab_size)
            save_tokenizer(tok, tok_dir)
        return TrainingData(directory, corpus, tok, TokenizedCorpus.load_or_build(corpus, tok, directory))


def needle_generator(tokenizer: Tokenizer | str | Path, split: str = "held_out", corpus: Corpus | None = None,
                     cache_dir: str | Path | None = None) -> NeedleGenerator:
    """Needle tasks for any model: `tokenizer` is a `tokenizers.Tokenizer` or a checkpoint directory
    holding tokenizer.json; haystacks are code of `split` of `corpus` (default: this interpreter's
    stdlib). Haystacks only need code, so no manifest is checked; for the same cases on every machine
    pass the corpus snapshot the model was trained on. Token ids are cached in `cache_dir` if given."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    corpus = corpus or Corpus.from_stdlib()
    tokens = (TokenizedCorpus.load_or_build(corpus, tok, cache_dir) if cache_dir is not None
              else TokenizedCorpus.build(corpus, tok))
    return NeedleGenerator(tokens.split(split), tok)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megactx.train.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write (or find) manifest.json, tokenizer/ and the token cache")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--corpus", metavar="SNAPSHOT",
                        help="read the corpus from this snapshot directory (Corpus.save_snapshot) instead of "
                             "DIR/corpus/ or this interpreter's stdlib")
    parser.add_argument("--snapshot", action="store_true",
                        help="also copy the corpus into DIR/corpus/, so DIR trains the same on any machine")
    parser.add_argument("--tokenizer", metavar="MODEL",
                        help="take this model directory's tokenizer.json instead of training a tokenizer (to train "
                             "that model further: megactx train --init MODEL --data-dir DIR)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        corpus = Corpus.from_directory(args.corpus) if args.corpus else None
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
        data = prepare_data(args.directory, corpus=corpus,
                            vocab_size=tok.get_vocab_size() if tok else args.vocab_size, tokenizer=tok,
                            tokenizer_source=f"{args.tokenizer}'s")
    except (OSError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.snapshot and not (data.directory / CORPUS_SNAPSHOT / MANIFEST).is_file():
        data.corpus.save_snapshot(data.directory / CORPUS_SNAPSHOT)
    print(f"corpus: Python {data.corpus.python_version} stdlib, {len(data.corpus.files)} files, "
          f"sha256 {data.corpus.sha256[:16]}")
    for name in SPLITS:
        split = data.split(name)
        print(f"  {name:8s} {len(split.paths):4d} files {split.num_bytes / 1e6:7.2f} MB {split.num_tokens / 1e6:7.3f}M "
              f"tokens ({split.num_bytes / split.num_tokens:.2f} bytes/token)")
    print(f"tokenizer: {data.tokenizer.get_vocab_size()} tokens in {data.tokenizer_dir}; "
          f"ready in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
