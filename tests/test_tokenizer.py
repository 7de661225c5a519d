"""IncrementalDetokenizer: streamed pieces add up to the full decode, whatever the chunking, with
multi-byte characters split across tokens, through DecodeStream and through its fallback.
CompletionText: the text rules of a completion (stop strings, held-back characters, stop tokens'
text dropped) over a detokenizer whose tokens' texts are known."""

import random
from pathlib import Path

import pytest

from megactx.engine.tokenizer import CompletionText, IncrementalDetokenizer, Tokenizer

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
        n = rng.randint(1, 12)  # one by one (DecodeStream) below IncrementalDetokenizer.CHUNK, the window above
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


# ----------------------------------------------------------------------------- CompletionText


class _Pieces:
    """A detokenizer whose token t decodes to PIECES[t] ("" for an unknown id); its text never
    depends on its neighbours, so one by one and together are the same."""

    def __init__(self):
        self.flushed = False

    def add_one(self, token: int) -> str:
        return PIECES.get(token, "")

    def add(self, tokens: list[int]) -> str:
        return "".join(map(self.add_one, tokens))

    def flush(self) -> str:
        self.flushed = True
        return "<flush>"


PIECES = {1: "hello", 2: " END", 3: " there", 4: "abc", 5: "#", 6: "##", 7: "!", 8: "###", 9: "x", 10: " b",
          11: " zz", 12: "</s>", 13: "a", 14: "b", 15: "c"}


def _run(text: CompletionText, steps: list[tuple[list[int], str | None]]) -> tuple[str, list[int], str | None]:
    """Feed steps of (tokens, engine finish reason) -> (all text given out, tokens that stood, finish reason)."""
    out, stood, reason = [], [], None
    for tokens, engine_reason in steps:
        piece, kept, reason = text.add(tokens, engine_reason)
        out.append(piece)
        stood += tokens[:kept]
        if reason is not None:
            break
    return "".join(out), stood, reason


def test_a_stop_string_cuts_the_text_before_it_at_the_token_that_completes_it():
    text = CompletionText(_Pieces(), stop=["###", "END"])
    assert _run(text, [([1], None), ([2, 3], None), ([4], None)]) == ("hello ", [1, 2], "stop")


def test_a_stop_string_spanning_tokens_and_steps_is_found_and_what_could_start_one_is_held_back():
    text = CompletionText(_Pieces(), stop=["###"])
    assert text.add([4, 5]) == ("ab", 2, None)  # the last len("###") - 1 characters are held back
    assert text.add([7]) == ("c", 1, None)
    assert text.add([6]) == ("#!", 1, None)
    assert text.add([5, 9]) == ("", 1, "stop")  # "##" + "#" completes it: cut before it, x dropped
    assert text.add([9], "length") == ("", 0, None)  # finished: whatever comes later is dropped


def test_the_earliest_stop_string_wins():
    text = CompletionText(_Pieces(), stop=["zz", "b"])
    assert _run(text, [([13, 10, 11], None)]) == ("a ", [13, 10], "stop")
    # one inside a token's text, after some of it
    assert _run(CompletionText(_Pieces(), stop=["ll"]), [([1], None)]) == ("he", [1], "stop")


def test_a_stop_tokens_text_is_dropped_and_length_flushes_the_detokenizer():
    assert _run(CompletionText(_Pieces()), [([1], None), ([12], "stop")]) == ("hello", [1, 12], "stop")
    detok = _Pieces()
    assert _run(CompletionText(detok), [([1, 3], "length")]) == ("hello there<flush>", [1, 3], "length")
    assert detok.flushed
    # a stop token that also ends in a stop string's text: the token's rule wins, its text is dropped
    assert _run(CompletionText(_Pieces(), stop=["/s"]), [([1, 12], "stop")]) == ("hello", [1, 12], "stop")


def test_stop_strings_wait_for_min_tokens():
    text = CompletionText(_Pieces(), stop=["b"], min_tokens=3)
    assert _run(text, [([13, 14], None), ([15, 14], None)]) == ("abc", [13, 14, 15, 14], "stop")


def test_a_long_stop_string_is_found_while_the_text_is_shorter_than_what_is_held_back():
    text = CompletionText(_Pieces(), stop=["abc#!###x"])  # 8 characters held back
    steps = [([4], None), ([5], None), ([7], None), ([8], None), ([9], None)]
    assert _run(text, steps) == ("", [4, 5, 7, 8, 9], "stop")


def test_without_stop_strings_a_chunk_is_decoded_as_its_tokens_one_by_one(tokenizer):
    """A server hands over several steps' tokens at once: decoded together (the window) they give
    the text they give one by one (DecodeStream), multi-byte characters split across chunks included."""
    ids = tokenizer.encode(TEXT)
    prompt, output = ids[:5], ids[5:]
    context = prompt[-IncrementalDetokenizer.CONTEXT:]
    whole = tokenizer.decode(context + output)[len(tokenizer.decode(context)):]
    for chunk in (1, 3, 4, 9, len(output)):
        text = CompletionText(IncrementalDetokenizer(tokenizer, prompt))
        pieces = [text.add(output[i : i + chunk], "length" if i + chunk >= len(output) else None)
                  for i in range(0, len(output), chunk)]
        assert "".join(p for p, _, _ in pieces) == whole, chunk
        assert sum(kept for _, kept, _ in pieces) == len(output) and pieces[-1][2] == "length"


def test_without_stop_strings_nothing_is_held_back():
    text = CompletionText(_Pieces())
    assert text.add([1, 2]) == ("hello END", 2, None)
    assert text.add([3], "abort") == (" there", 1, "abort")
