"""IncrementalDetokenizer: streamed pieces add up to the full decode, whatever the chunking, with
multi-byte characters split across tokens, through DecodeStream and through its fallback."""

import random
from pathlib import Path

import pytest

from megactx.engine.tokenizer import IncrementalDetokenizer, Tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "megactx-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    if not (SHIPPED / "tokenizer.json").is_file():
        pytest.skip("the shipped megactx-tiny tokenizer is not there")
    return Tokenizer(SHIPPED)


TEXT = "def f(x):\n    return x  # é 中文 ✓ naïve\n    print('𝔘nicode')\n"


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, flush: bool) -> str:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(detok.add(ids[i : i + n]))
        assert not out[-1].endswith("\ufffd"), "an incomplete character was emitted"
        i += n
    if flush:
        out.append(detok.flush())
    return "".join(out)


@pytest.mark.parametrize("fallback", [False, True], ids=["decode-stream", "window"])
def test_pieces_add_up_to_the_decode(tokenizer, fallback):
    rng = random.Random(0)
    ids = tokenizer.encode(TEXT)
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        if tokenizer.decode(prompt).endswith("\ufffd"):
            continue  # the prompt ends inside a character: its text is the prompt's
        detok = IncrementalDetokenizer(tokenizer, prompt)
        if fallback:
            detok._stream = None
        context = prompt[-IncrementalDetokenizer.CONTEXT:]
        streamed = _stream(detok, output, rng, flush=False)
        assert tokenizer.decode(context) + streamed == tokenizer.decode(context + output), cut
    # random ids (any bytes, incomplete characters included): everything once flushed
    vocab, trials = tokenizer.vocab_size, 0
    while trials < 20:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        context = prompt[-IncrementalDetokenizer.CONTEXT:]
        if tokenizer.decode(context).endswith("\ufffd"):
            continue
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        if fallback:
            detok._stream = None
        full = tokenizer.decode(context + output)
        assert tokenizer.decode(context) + _stream(detok, output, rng, flush=True) == full, trials
        trials += 1


def test_a_refusing_stream_hands_over_to_the_window(tokenizer):
    """A DecodeStream that raises mid-way (InvalidPrefix) loses no text."""

    class Refusing:
        def __init__(self, inner, after):
            self.inner, self.after = inner, after

        def step(self, tok, token):
            self.after -= 1
            if self.after < 0:
                raise Exception("InvalidPrefix")
            return self.inner.step(tok, token)

    ids = tokenizer.encode(TEXT)
    for after in range(0, len(ids) - 3, 3):
        detok = IncrementalDetokenizer(tokenizer, ids[:3])
        detok._stream = Refusing(detok._stream, after)
        assert _stream(detok, ids[3:], random.Random(after), flush=False) == tokenizer.decode(ids[3:]), after
        assert detok._stream is None
