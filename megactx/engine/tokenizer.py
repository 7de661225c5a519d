"""The checkpoint's tokenizer: `tokenizer.json` through `tokenizers`, the chat template from
`tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2, as transformers does.

`IncrementalDetokenizer` turns a growing list of output ids into text deltas for streaming: it
decodes a short window behind the last emitted text and holds back a trailing U+FFFD (a multi-byte
character whose bytes are not all out yet). `CompletionText` is one completion's text on top of it:
stop strings applied, the characters that could start one held back. `LLM` runs it for its own
requests; `megactx serve` runs it in the server process, so the engine's loop handles token ids
only (as vLLM's engine core does)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json; pass prompts as token ids instead of text")
        self._tok = HFTokenizer.from_file(str(path))
        config = {}
        if (directory / "tokenizer_config.json").is_file():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens = {k: v for k, v in config.items()
                               if k in ("bos_token", "eos_token", "pad_token") and isinstance(v, str)}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style messages [{"role": ..., "content": ...}] into the prompt text."""
        if self.chat_template is None:
            raise ValueError("this checkpoint's tokenizer has no chat template; use /v1/completions with a prompt")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(message):
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)


class IncrementalDetokenizer:
    """Text deltas of a growing output, decoded with a little context so merges at token edges
    (e.g. a leading space, a multi-byte character) come out right.

    Each token goes through `tokenizers`' DecodeStream (one call into Rust a token: a decode step
    is on the engine's host path, once per sequence a step). Where the stream refuses a token (it
    raises when the decoded text does not extend what it has emitted, which some decoders'
    normalisations do), this detokenizer decodes the same window itself from then on."""

    CONTEXT = 6  # prompt tokens decoded before the first new ones
    CHUNK = 4  # add() decodes this many ids or more together (the window); fewer go one by one

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded before
        self.read_offset = len(self.ids)
        self._stream: DecodeStream | None = DecodeStream(self.ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the new text (possibly empty while a character is incomplete).
        Several at once (a server's hand-over) are decoded together, two decodes of the window
        whatever their number, instead of a DecodeStream call each (1.8x less a token in chunks
        of 32 on a CPU); the window then goes on for this detokenizer's later ids."""
        if len(token_ids) < self.CHUNK:
            return "".join(map(self.add_one, token_ids))
        self.ids.extend(token_ids)
        self._stream = None
        return self._window()

    def add_one(self, token: int) -> str:
        """Append one generated id; return the new text (the engine calls this for every sequence
        every step)."""
        self.ids.append(token)
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer._tok, token)
            except Exception:  # DecodeStream's InvalidPrefix: the window decode, from here on
                self._stream = None
            else:
                if piece is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return piece
        return self._window()

    def _window(self) -> str:
        """The text of the ids after read_offset, decoded after the ones before it ("" while a
        character is incomplete)."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if after.endswith(_REPLACEMENT) or len(after) < len(before):
            return ""  # wait for the rest of the character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]


class CompletionText:
    """The text of one completion as its tokens come: decoded incrementally, cut before the first
    stop string, and the characters that could still start a stop string held back until the next
    tokens show whether they do. Its text lives in two bounded parts: `unsent` (decoded, not given
    out yet: at most the held-back characters and the last call's) and `tail`, its last `hold`
    characters, in which a stop string that ends in the next token's text must start.

    The token rules (stop and EOS ids, max_tokens, the context's end) are the engine's; this adds
    the text rules on top (vLLM's): a stop string ends the completion with "stop" at the token whose
    text completes it, none counts before `min_tokens` tokens exist, and the text of a stop token
    is not part of the output."""

    __slots__ = ("detok", "stop", "min_tokens", "hold", "unsent", "tail", "num_tokens", "finished")

    def __init__(self, detok: IncrementalDetokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        """detok: the completion's detokenizer (anything with add_one, add and flush)."""
        self.detok = detok
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # could start a stop string: held back
        self.unsent = ""
        self.tail = ""
        self.num_tokens = 0  # tokens added so far
        self.finished = False

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, prompt_ids: list[int], params) -> CompletionText | None:
        """The text of a completion of `prompt_ids` under SamplingParams `params`; None without a
        tokenizer (token ids only)."""
        return cls(IncrementalDetokenizer(tokenizer, prompt_ids), params.stop, params.min_tokens) if tokenizer else None

    def add(self, tokens: Sequence[int], finish_reason: str | None = None) -> tuple[str, int, str | None]:
        """The completion's next tokens, in order, and the engine's finish reason when the last of
        them ended it ("stop": a stop token, whose text is dropped; "length"; "abort") -> (the text
        that is now final, how many of the tokens stand, the finish reason: the engine's, or "stop"
        where a stop string ended the completion at an earlier token, then the tokens after that
        one do not stand). Once finished, whatever comes is dropped: ("", 0, None)."""
        if self.finished:
            return "", 0, None
        if not self.stop:  # nothing to look for: the tokens' text in one piece, nothing held back
            return self._add_plain(tokens, finish_reason)
        detok, stop, hold = self.detok, self.stop, self.hold
        reason = finish_reason
        taken, cut = 0, None  # cut: characters of unsent that stay when a stop string ends the text
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            taken += 1
            self.num_tokens += 1
            if i == last and finish_reason == "stop":
                break  # a stop token: its text is not part of the output
            piece = detok.add_one(token)
            window = self.tail + piece  # the text a stop string ending in the new characters lies in
            if piece and self.num_tokens >= self.min_tokens:
                at = find_stop_string(window, len(piece), stop)
                if at is not None:
                    cut = len(self.unsent) - len(self.tail) + at
                    self.unsent += piece
                    reason = "stop"
                    break
            self.unsent += piece
            self.tail = window[max(0, len(window) - hold):]
        if reason is None:
            visible = max(0, len(self.unsent) - hold)
            text, self.unsent = self.unsent[:visible], self.unsent[visible:]
            return text, taken, None
        self.finished = True
        text, self.unsent, self.tail = self.unsent, "", ""
        if cut is not None:
            text = text[:cut]
        elif reason == "length":  # nothing is coming to complete a character
            text += detok.flush()
        return text, taken, reason

    def _add_plain(self, tokens: Sequence[int], finish_reason: str | None) -> tuple[str, int, str | None]:
        """add() without stop strings: every token stands; a stop token's text is dropped."""
        self.num_tokens += len(tokens)
        text = self.detok.add(tokens[:-1] if finish_reason == "stop" else tokens)
        if finish_reason is not None:
            self.finished = True
            if finish_reason == "length":  # nothing is coming to complete a character
                text += self.detok.flush()
        return text, len(tokens), finish_reason


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str]) -> int | None:
    """Index in `text` of the earliest stop string that ends inside its last num_new_chars
    characters, or None. Matches that end in older text were seen by an earlier call, so only new
    endings are searched for."""
    first_new = len(text) - num_new_chars
    found = [i for s in stops if (i := text.find(s, max(0, first_new - len(s) + 1))) >= 0]
    return min(found) if found else None
