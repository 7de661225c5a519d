"""`megactx serve` against the official `openai` client on loopback: what the server returns equals
what the offline engine (`LLM.generate`) makes for the same prompt and sampling settings —
completions and chat, streamed and not, with stop strings, logprobs, seeds and n concurrent
streams — a stream that falls behind (here: a server with a tiny event budget) gets the same text,
logprobs, finish reasons and usage in fewer events, and bad input, disconnects, overload and
SIGTERM behave as documented.

One server runs in-process (uvicorn in a thread) on a random checkpoint, on the CPU; the SIGTERM
test starts `python -m megactx serve` as a subprocess; a GPU test serves through the Triton kernels."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from megactx import LLM, SamplingParams
from megactx.cli import main as cli_main
from megactx.engine.outputs import Delta, EngineStats, TokenLogprobs
from megactx.serve.api import RETRY_AFTER_S, ChunkEncoder, _sse, build_app
from megactx.serve.async_engine import AsyncEngine, EngineDead, merge_deltas
from megactx.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from megactx.testing import make_random_checkpoint

MODEL = "tiny-random"  # the checkpoint directory's name, which `megactx serve` serves it as
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_QUEUED = 4
NUM_BLOCKS = 64  # 4096 tokens: room for MAX_NUM_SEQS full contexts, small enough for two engines on a GPU
PROMPT = "def dumps(obj, *, skipkeys=False):"
TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL)


def _engine(checkpoint, device: str = "cpu") -> LLM:
    # The comparisons run on a CPU in fp32 even on a GPU machine: a random model's logits are nearly
    # tied, and bf16 results that depend on the batch's shape would flip some of its tokens.
    return LLM(checkpoint, device=device, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The engine alone, the reference for what the server must return."""
    return _engine(checkpoint)


@contextmanager
def _serving(app):
    """Run `app` with uvicorn in a thread on a free loopback port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the server takes the bound socket: no race for a free port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def base_url(checkpoint, request):
    """The server, its engine in a thread of its own, or in a process of its own (`--engine-process`):
    every test that talks to it runs against both."""
    if request.param == "engine-process":
        from megactx.serve.engine_process import EngineProcess

        engine = EngineProcess(dict(model=str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=MAX_NUM_SEQS, num_blocks=NUM_BLOCKS))
    else:
        engine = _engine(checkpoint)
    with _serving(build_app(engine, served_model_name=MODEL, max_queued_requests=MAX_QUEUED)) as url:
        yield url
    if request.param == "engine-process":
        assert not engine.is_alive, "the engine process outlived its server"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def _generate(llm: LLM, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def _metrics(base_url) -> dict[str, float]:
    """Every sample of /metrics as {name{label=value,...}: value}, the model_name label left out."""
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _wait_for(base_url, condition, what: str) -> dict[str, float]:
    """Poll /metrics until condition(metrics) holds: the engine thread updates its gauges after
    each step, a moment after the HTTP side has seen a request's effect."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        m = _metrics(base_url)
        if condition(m):
            return m
        assert time.monotonic() < deadline, f"{what} did not happen: {m}"
        time.sleep(0.05)


def _wait_idle(base_url) -> dict[str, float]:
    """Wait until the engine runs nothing and holds no blocks (aborts reach it asynchronously)."""
    return _wait_for(base_url, lambda m: m["megactx_num_requests_running"] == m["megactx_num_requests_waiting"]
                     == m["megactx_kv_blocks_used"] == 0, "going idle")


# ---------------------------------------------------------------------------- completions
def test_models_health_and_metrics_routes(base_url, client):
    assert httpx.get(f"{base_url}/health").status_code == 200
    [card] = client.models.list().data
    assert card.id == MODEL and card.max_model_len == MAX_MODEL_LEN
    m = _metrics(base_url)
    assert m["megactx_kv_blocks_used"] + m["megactx_kv_blocks_free"] == NUM_BLOCKS
    for name in ("megactx_num_requests_running", "megactx_num_requests_waiting", "megactx_prefix_cache_hit_rate",
                 "megactx_prompt_tokens_total", "megactx_generation_tokens_total",
                 "megactx_time_to_first_token_seconds_count", "megactx_inter_token_latency_seconds_count"):
        assert name in m
    # the event loop's lag is probed every 10 ms from the start: a running server has observations
    assert m["megactx_event_loop_lag_seconds_count"] >= 1 and m["megactx_event_loop_lag_seconds_sum"] >= 0
    assert "megactx_gc_pause_seconds_count" in m  # the server process's collector pauses


def test_gc_pauses_are_observed_outside_the_collector_and_a_gone_servers_watch_is_dropped():
    import gc

    from megactx.serve.metrics import ServerMetrics

    def count(metrics) -> float:
        return next(s.value for f in metrics.registry.collect() if f.name == "megactx_gc_pause_seconds"
                    for s in f.samples if s.name.endswith("_count"))

    first = ServerMetrics("m")
    gc.collect()
    assert first._gc_pauses and count(first) == 0  # noted by the callback, not yet observed
    first.flush_gc_pauses()
    assert not first._gc_pauses and count(first) >= 1
    watching = len(gc.callbacks)
    del first
    gc.collect()
    second = ServerMetrics("m")  # installs its own watch and drops the gone server's
    assert len(gc.callbacks) == watching
    gc.collect()
    assert b"megactx_gc_pause_seconds_count" in second.render() and count(second) >= 1


def test_a_settled_heap_is_given_back_at_exit_so_triton_reports_no_leaks():
    """settle_heap freezes every object; a process that exits frozen (the engine process) never frees
    Triton's, and its nanobind bindings print "leaked instances" at every server shutdown."""
    code = "import megactx.kernels.indexer; from megactx.serve import settle_heap; settle_heap(); settle_heap()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and "leaked" not in done.stderr, done.stderr[-2000:]


def test_a_server_sets_its_collectors_threshold_while_it_serves_and_restores_it(checkpoint, offline):
    import gc

    before = gc.get_threshold()
    llm = LLM(offline.model, tokenizer=checkpoint, device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS)
    with _serving(build_app(llm, served_model_name=MODEL, gc_threshold=12345)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        assert gc.get_threshold() == (12345, *before[1:]) and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_completion_with_logprobs_equals_the_offline_engine(base_url, client, offline):
    before = _metrics(base_url)
    want = _generate(offline, PROMPT, temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    [choice] = got.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT)) and got.usage.completion_tokens == 8

    def text(t):
        return offline.tokenizer.decode([t], skip_special_tokens=False)

    lp = choice.logprobs
    assert lp.tokens == [text(t) for t in want.token_ids]
    for i, ref in enumerate(want.outputs[0].logprobs):
        assert abs(lp.token_logprobs[i] - ref.logprob) < 1e-5
        top = {text(t): v for t, v in ref.top.items()} | {text(ref.token_id): ref.logprob}  # sampled one included
        assert lp.top_logprobs[i].keys() == top.keys()
        assert max(abs(lp.top_logprobs[i][k] - top[k]) for k in top) < 1e-5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]

    after = _metrics(base_url)  # the request is counted in the Prometheus counters
    assert after["megactx_prompt_tokens_total"] - before["megactx_prompt_tokens_total"] == got.usage.prompt_tokens
    assert after["megactx_generation_tokens_total"] - before["megactx_generation_tokens_total"] == 8
    assert after["megactx_time_to_first_token_seconds_count"] == before["megactx_time_to_first_token_seconds_count"] + 1
    assert after["megactx_inter_token_latency_seconds_count"] == before["megactx_inter_token_latency_seconds_count"] + 7


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_prompt_forms_token_ids_and_batches(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    other = "class JSONDecoder(object):"
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == text
    single = [text, client.completions.create(prompt=other, **kwargs).choices[0].text]
    batch = client.completions.create(prompt=[PROMPT, other], **kwargs)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == single
    batch = client.completions.create(prompt=[ids, offline.tokenizer.encode(other)], n=2, **kwargs)
    # choice index = prompt index * n + completion index; greedy completions of one prompt agree
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [text, text, single[1], single[1]]
    assert batch.usage.completion_tokens == 4 * 4


def test_stop_strings_cut_the_text(client, offline):
    free = _generate(offline, PROMPT, temperature=0, max_tokens=20, ignore_eos=True).text
    stop = free[5:8]
    assert stop.strip(), "the random model produced too little text for this test"
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == free[: free.index(stop)] and whole.finish_reason == "stop"
    streamed = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_the_engines_and_completion_i_uses_seed_plus_i(client, offline):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    want = [_generate(offline, PROMPT, temperature=1.0, max_tokens=8, ignore_eos=True, seed=s).text for s in (7, 8)]
    assert want[0] != want[1]
    assert client.completions.create(seed=7, **kwargs).choices[0].text == want[0]
    pair = client.completions.create(seed=7, n=2, **kwargs).choices
    assert [c.text for c in sorted(pair, key=lambda c: c.index)] == want


def test_concurrent_streams_each_get_their_own_output(base_url, offline):
    seeds = list(range(MAX_NUM_SEQS))
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=s) for s in seeds]
    want = [o.text for o in offline.generate([PROMPT] * len(seeds), params, use_tqdm=False)]

    async def one(client, seed):
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                                 seed=seed, stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT_S) as client:
            return await asyncio.gather(*(one(client, s) for s in seeds))

    assert asyncio.run(all_at_once()) == want


# ---------------------------------------------------------------------------- chat
def test_chat_renders_the_checkpoint_template_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    prompt = offline.tokenizer.apply_chat_template(messages)
    assert prompt == "<|system|>\nbe brief<|end|>\n<|user|>\nhello there<|end|>\n<|assistant|>\n"
    want = _generate(offline, prompt, temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode(prompt)) and whole.usage.completion_tokens == 6
    for got, ref in zip(choice.logprobs.content, want.outputs[0].logprobs, strict=True):
        assert abs(got.logprob - ref.logprob) < 1e-5
        assert len(got.top_logprobs) == 2
        assert all(abs(t.logprob - v) < 1e-5 for t, v in zip(got.top_logprobs, ref.top.values(), strict=True))

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_n_streams_every_choice_to_its_end(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=1, stream=True,
        extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


# ---------------------------------------------------------------------------- coalescing
@pytest.fixture(scope="module")
def paced_client(checkpoint):
    """A second server with an event budget of one hand-over a second: a stream's deltas between
    its first and its last go out about once a second, as they do to a consumer slower than the
    engine, so its events carry several tokens each."""
    app = build_app(_engine(checkpoint), served_model_name=MODEL, max_queued_requests=MAX_QUEUED,
                    max_handovers_per_s=1)
    with _serving(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def _choice_chunks(chunks, index=0):
    return [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]


def test_a_slow_stream_gets_fewer_completion_events_with_the_same_text_logprobs_and_usage(client, paced_client):
    num_tokens = 24
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=num_tokens, temperature=0, logprobs=2, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    per_token, coalesced = (list(c.completions.create(**kwargs)) for c in (client, paced_client))
    fast, slow = _choice_chunks(per_token), _choice_chunks(coalesced)
    assert len(slow) <= num_tokens // 2 < len(fast)
    assert "".join(c.text for c in slow) == "".join(c.text for c in fast)

    def joined(chunks, field):
        return sum((getattr(c.logprobs, field) for c in chunks), [])

    for field in ("tokens", "text_offset"):  # offsets continue across merged deltas
        assert joined(slow, field) == joined(fast, field)
    # the same tokens and alternatives; two engines' log-probabilities may round apart in the last bits
    got_top, want_top = joined(slow, "top_logprobs"), joined(fast, "top_logprobs")
    assert [sorted(t) for t in got_top] == [sorted(t) for t in want_top]
    got = joined(slow, "token_logprobs") + [t[k] for t in got_top for k in sorted(t)]
    want = joined(fast, "token_logprobs") + [t[k] for t in want_top for k in sorted(t)]
    assert len(got_top) == num_tokens and max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert [c.finish_reason for c in slow] == [None] * (len(slow) - 1) + ["length"]
    assert not coalesced[-1].choices and coalesced[-1].usage == per_token[-1].usage
    assert coalesced[-1].usage.completion_tokens == num_tokens


def test_a_slow_chat_stream_gets_fewer_events_with_the_same_content_and_logprobs_per_choice(client, paced_client):
    num_tokens, n = 16, 2
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=num_tokens, n=n,
                  temperature=0, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True})
    per_token, coalesced = (list(c.chat.completions.create(**kwargs)) for c in (client, paced_client))
    assert [c.choices[i].delta.role for c in coalesced[:1] for i in range(n)] == ["assistant"] * n  # the role chunk
    for index in range(n):
        fast, slow = _choice_chunks(per_token[1:], index), _choice_chunks(coalesced[1:], index)
        assert len(slow) <= num_tokens // 2 < len(fast)
        assert "".join(c.delta.content for c in slow) == "".join(c.delta.content for c in fast)
        got, want = (sum((c.logprobs.content for c in cs), []) for cs in (slow, fast))
        assert len(got) == num_tokens and [t.token for t in got] == [t.token for t in want]
        assert [t.bytes for t in got] == [t.bytes for t in want]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-5
        assert [len(t.top_logprobs) for t in got] == [2] * num_tokens
        assert [c.finish_reason for c in slow] == [None] * (len(slow) - 1) + ["length"]
    assert coalesced[-1].usage.completion_tokens == per_token[-1].usage.completion_tokens == n * num_tokens


def _delta(i: int, index: int = 0, finish: str | None = None, logprobs: bool = True) -> Delta:
    lps = [TokenLogprobs(i, -0.5 * i, {i: -0.5 * i, i + 1: -9.0})] if logprobs else None
    return Delta("r", index, f"t{i} ", [i], lps, finish)


def test_merge_deltas_makes_one_delta_a_completion_in_order():
    batch = [(0, _delta(0)), (0, _delta(1, index=1)), (0, _delta(2)), (1, _delta(3)), (0, _delta(4, finish="stop")),
             (0, _delta(5, index=1))]
    merged = merge_deltas(batch)
    assert [(p, d.index) for p, d in merged] == [(0, 0), (0, 1), (1, 0)]  # each completion's first delta's place
    first = merged[0][1]
    assert first.text == "t0 t2 t4 " and first.token_ids == [0, 2, 4] and first.finish_reason == "stop"
    assert [lp.token_id for lp in first.logprobs] == [0, 2, 4]
    assert merged[1][1].text == "t1 t5 " and merged[1][1].finish_reason is None
    assert merged[2][1] is batch[3][1]  # alone: passed through as it is
    assert merge_deltas(batch[:1]) == batch[:1]
    no_logprobs = merge_deltas([(0, _delta(0, logprobs=False)), (0, _delta(1, logprobs=False))])
    assert no_logprobs[0][1].logprobs is None and no_logprobs[0][1].token_ids == [0, 1]


class _IdleLLM:
    """An LLM that admits every request and never steps: a test hands the AsyncEngine its steps."""

    max_num_seqs = 4
    tokenizer = None  # token ids only: the deltas' text is the test's

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.aborted: list[tuple[str, int | None]] = []
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0)
        self.block_manager = SimpleNamespace(num_used_blocks=0, num_free_blocks=8, prefix_cache_hit_rate=0.0)
        self.stats = EngineStats()
        self.requests: dict[str, SamplingParams] = {}

    def add_request(self, prompt_token_ids, params, request_id, detokenize=True):
        self.requests[request_id] = params

    def abort(self, request_id, index=None):
        self.aborted.append((request_id, index))
        if index is None:
            self.requests.pop(request_id, None)

    def has_unfinished(self):
        return False


async def _idle_engine_stream(max_handovers_per_s: float):
    """An AsyncEngine over an _IdleLLM, the stream of its one request "r", and a function that
    makes a step: step(*deltas) routes them as if the engine thread had made them."""
    engine = AsyncEngine(_IdleLLM(), max_queued_requests=0, max_handovers_per_s=max_handovers_per_s)
    engine.start()
    stream = engine.submit([[1, 2, 3]], [SamplingParams(max_tokens=8)], "r")
    await stream.admitted()

    def step(*deltas):
        engine._dispatch(list(deltas), time.perf_counter())

    return engine, stream, step


def _token_ids(batch):
    return [d.token_ids for _, d in batch]


def test_the_server_makes_the_text_and_a_stop_string_it_finds_stops_that_completion_in_the_engine():
    """The engine sends token ids only; the stream decodes them at each hand-over. A stop string
    cuts its completion's text, tokens and logprobs, finishes it with "stop" at once, tells the
    engine to stop that completion alone, and drops the tokens the engine made meanwhile; the
    request's other completion runs on."""
    from megactx.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(Path(__file__).resolve().parents[1] / "models" / "megactx-tiny")
    words = [tokenizer.encode(w) for w in ("alpha", " beta", " STOP", " gamma", " delta")]

    async def scenario():
        from megactx.serve.metrics import ServerMetrics

        llm = _IdleLLM(tokenizer)
        metrics = ServerMetrics("m")
        engine = AsyncEngine(llm, max_queued_requests=0, max_handovers_per_s=0, metrics=metrics)
        engine.start()
        stream = engine.submit([[1, 2, 3]], [SamplingParams(max_tokens=40, n=2, stop=["STOP"], logprobs=0)], "r")
        await stream.admitted()
        batches = stream.batches()

        def step(index, ids, finish=None):
            lps = [TokenLogprobs(t, -1.0, {}) for t in ids]
            engine._dispatch([Delta("r", index, "", ids, lps, finish)], time.perf_counter())

        step(0, words[0] + words[1])
        step(1, words[0])
        first = {d.index: d for _, d in await anext(batches)}
        assert first[0].text == "alpha b" and first[1].text == "al"  # len("STOP") - 1 characters held back
        step(0, words[2] + words[3])  # " STOP gamma": the stop string, and a token after it
        (_, cut), = await anext(batches)
        assert cut.index == 0 and cut.text == "eta " and cut.finish_reason == "stop"
        assert cut.token_ids == words[2] and len(cut.logprobs) == len(words[2])
        step(0, words[4])  # made by the engine before it heard: dropped
        step(1, words[3], "length")
        (_, last), = await anext(batches)
        assert last.index == 1 and last.text == "pha gamma" and last.finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await anext(batches)
        for _ in range(100):  # the abort reaches the engine thread
            if llm.aborted:
                break
            await asyncio.sleep(0.01)
        assert llm.aborted == [("r", 0)]
        finished = {r: metrics.registry.get_sample_value("megactx_completions_finished_total",
                                                         {"model_name": "m", "finish_reason": r})
                    for r in ("stop", "length")}
        assert finished == {"stop": 1.0, "length": 1.0}  # each completion's final reason, once
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_stream_hands_over_what_waited_at_once_and_paces_the_rest_by_its_budget():
    async def scenario():
        # 5 hand-overs a second for steps of one sequence: 200 ms between a stream's hand-overs
        engine, stream, step = await _idle_engine_stream(max_handovers_per_s=5)
        loop = asyncio.get_running_loop()
        batches = stream.batches()
        for i in range(3):  # the consumer is elsewhere (slow): the deltas wait for it
            step(_delta(i))
        assert _token_ids(await anext(batches)) == [[0, 1, 2]]  # merged: one delta a completion
        handed_over = loop.time()

        later = asyncio.ensure_future(anext(batches))
        for i in (3, 4):
            await asyncio.sleep(0)
            step(_delta(i))
        await asyncio.sleep(0.02)
        assert not later.done()  # not due; and as no step comes, the engine's timer hands them over
        assert _token_ids(await asyncio.wait_for(later, TIMEOUT_S)) == [[3, 4]]
        assert loop.time() - handed_over >= 0.19
        handed_over = loop.time()

        later = asyncio.ensure_future(anext(batches))
        token = 5
        while not later.done():  # a step every 20 ms: the first one after the hand-over is due brings it
            await asyncio.sleep(0.02)
            step(_delta(token))
            token += 1
            await asyncio.sleep(0)
        assert _token_ids(later.result()) == [list(range(5, token))] and token - 5 >= 2
        assert loop.time() - handed_over >= 0.19

        later = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0)
        step(_delta(token, finish="length"))  # a finishing delta goes at once
        await asyncio.sleep(0)
        assert later.done() and _token_ids(later.result()) == [[token]]
        with pytest.raises(StopAsyncIteration):  # and it was the request's last
            await anext(batches)
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_failing_engine_ends_a_stream_after_the_deltas_it_made():
    async def scenario():
        engine, stream, step = await _idle_engine_stream(max_handovers_per_s=0)
        step(_delta(0))
        engine._fail_all(RuntimeError("simulated device failure"))
        got = []
        with pytest.raises(EngineDead, match="simulated device failure"):
            async for item in stream:
                got.append(item)
        assert _token_ids(got) == [[0]]
        await engine.shutdown()

    asyncio.run(scenario())


def test_streamed_chunks_are_the_response_models_json_byte_for_byte():
    logprobs = {"tokens": ["a", "é"], "token_logprobs": [-0.25, -1.5], "top_logprobs": [{"a": -0.25}, {"é": -1.5}],
                "text_offset": [0, 1]}
    completion = ChunkEncoder(CompletionResponse, "cmpl-1", 1700000000, 'm"x')
    for index, text, lps, finish in ((0, 'a "quoted"\nline é \u2028', None, None), (3, "aé", logprobs, "length")):
        model = CompletionResponse(id="cmpl-1", created=1700000000, model='m"x', choices=[
            CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish)])
        assert completion.event(index, text, lps, finish) == _sse(model)
    chat_logprobs = {"content": [{"token": "é", "logprob": -1.5, "bytes": [195, 169],
                                  "top_logprobs": [{"token": "é", "logprob": -1.5, "bytes": [195, 169]}]}]}
    chat = ChunkEncoder(ChatCompletionChunk, "chatcmpl-1", 1700000000, "m")
    for index, text, lps, finish in ((0, "hi", None, None), (1, "", chat_logprobs, "stop")):
        model = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="m", choices=[
            ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=lps, finish_reason=finish)])
        assert chat.event(index, text, lps, finish) == _sse(model)


def test_the_step_histogram_renders_as_prometheus_clients_own():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from megactx.serve.metrics import ITL_BUCKETS_S, CountedHistogram

    name, doc = "megactx_inter_token_latency_seconds", "Between consecutive tokens of one completion"
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram(name, doc, ["model_name"], buckets=ITL_BUCKETS_S, registry=theirs).labels("m")
    counted = CountedHistogram(name, doc, ITL_BUCKETS_S, "m")
    ours.register(counted)
    for value, count in ((0.004, 3), (0.001, 2), (0.0011, 1), (7.0, 1), (0.0, 4)):  # on, between, past the edges
        for _ in range(count):
            histogram.observe(value)
        counted.observe(value, count)
    created = f"{name}_created"
    want, got = (generate_latest(r).decode().splitlines() for r in (theirs, ours))
    assert [line for line in got if created not in line] == [line for line in want if created not in line]
    assert sum(created in line for line in got) == sum(created in line for line in want) > 0


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n must be"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens 5000 does not fit"),
    ({"prompt": list(range(2 * MAX_MODEL_LEN))}, 400, f"context is {MAX_MODEL_LEN}"),
    ({"prompt": "x", "echo": True}, 400, "echo is not supported"),
    ({"prompt": "x", "max_token": 3}, 400, "max_token: unknown parameter"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "n": MAX_NUM_SEQS + MAX_QUEUED + 1}, 400, "at most"),
    ({"prompt": 5}, 400, "prompt: Input should be a valid string"),
    ({}, 400, "prompt: this field is required"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist"),
], ids=["temperature", "top_p", "n", "logprobs", "max_tokens", "long-prompt", "echo", "unknown-field",
        "stream_options", "too-many-seqs", "prompt-type", "no-prompt", "unknown-model"])
def test_bad_completion_requests_get_openai_errors(base_url, body, status, words):
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, **body}, timeout=TIMEOUT_S)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"]


def test_bad_json_and_bad_chat_get_openai_errors_and_the_server_keeps_serving(base_url, client):
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b'{"model": ', timeout=TIMEOUT_S,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0\.type"):
        client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4000)
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


# ---------------------------------------------------------------------------- disconnects, overload
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_frees_its_request(base_url, stream):
    aborted = _wait_idle(base_url).get("megactx_completions_finished_total{finish_reason=abort}", 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 100, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (a discarded iterator would close the connection at once)
            next(lines)
            _wait_for(base_url, lambda m: m["megactx_num_requests_running"] == 1 and m["megactx_kv_blocks_used"] > 0,
                      "running the request")
    else:  # the client gives up waiting for the whole response: it closes its connection mid-request
        # (once the request runs: a client gone before the server read its request leaves nothing to abort)
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        data = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            _wait_for(base_url, lambda m: m["megactx_num_requests_running"] == 1 and m["megactx_kv_blocks_used"] > 0,
                      "running the request")
    m = _wait_idle(base_url)  # long before its ~900 tokens could have been made
    assert m["megactx_completions_finished_total{finish_reason=abort}"] == aborted + 1


def test_overload_queues_to_the_limit_then_answers_503_with_retry_after(base_url):
    _wait_idle(base_url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 100, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT_S) as http, ExitStack() as streams:
        for _ in range(MAX_NUM_SEQS + MAX_QUEUED):  # the batch, then the queue
            r = streams.enter_context(http.stream("POST", f"{base_url}/v1/completions", json=body))
            assert r.status_code == 200
        r = http.post(f"{base_url}/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "retry" in r.json()["error"]["message"]
        _wait_for(base_url, lambda m: m["megactx_num_requests_running"] == MAX_NUM_SEQS
                  and m["megactx_num_requests_waiting"] == MAX_QUEUED, "a full batch and a full queue")
    _wait_idle(base_url)  # the streams were closed: their requests were aborted
    ok = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=TIMEOUT_S)
    assert ok.status_code == 200


def test_a_failing_engine_fails_its_requests_and_health(checkpoint, offline, monkeypatch):
    llm = LLM(offline.model, tokenizer=checkpoint, device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS)

    def broken_step():
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(llm, "step", broken_step)
    with _serving(build_app(llm, served_model_name=MODEL)) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT_S)
        assert r.status_code == 503 and "simulated device failure" in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "restart the server" in health.json()["error"]["message"]


def test_an_engine_process_that_dies_fails_its_requests_and_health_and_one_that_cannot_load_says_why(checkpoint):
    from megactx.serve.engine_process import EngineFailed, EngineProcess

    engine = EngineProcess(dict(model=str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=8))
    with _serving(build_app(engine, served_model_name=MODEL)) as url:
        long = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT_S)
        assert long.status_code == 200
        engine.process.kill()  # a crash: out of memory, a device fault
        _wait = time.monotonic() + TIMEOUT_S
        while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < _wait:
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "restart the server" in health.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT_S)
        assert r.status_code == 503
    with pytest.raises(EngineFailed, match="max_model_len"):  # the engine's own reason, from the child
        EngineProcess(dict(model=str(checkpoint), device="cpu", max_model_len=1 << 40, num_blocks=8))


def test_the_servers_pipe_reader_hands_the_loop_what_came_together_in_one_call():
    """The engine process writes a message an iteration; the server's reader gives the loop every
    iteration that had come in one callback, in order, then a failure after them, or EngineDead
    when the pipe ends without one."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from megactx.serve.async_engine import AsyncEngine, EngineDead

    def read(messages, close):
        read_end, write_end = mp.Pipe(duplex=False)
        for m in messages:
            write_end.send(m)
        if close:
            write_end.close()
        calls = []
        engine = AsyncEngine.__new__(AsyncEngine)
        engine._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: calls.append((fn.__name__, args)))
        engine.llm, engine._stopping = SimpleNamespace(outputs=read_end), False
        engine._receive_outputs()  # returns at a failure or at the pipe's end
        return calls

    gauges = (1, 0, 2, 6, 0.0)
    steps = [("step", ([("r", None)] if i == 0 else [], [("r", 0, "", [i], None, None)], float(i), gauges, None))
             for i in range(3)]
    calls = read([*steps, ("failed", "RuntimeError: boom")], close=False)
    assert [name for name, _ in calls] == ["_on_engine_outputs", "_fail_all"]
    (handed,), (error,) = calls[0][1], calls[1][1]
    assert [(admissions, [d.token_ids for d in deltas], now) for admissions, deltas, now, _, _ in handed] == [
        ([("r", None)], [[0]], 0.0), ([], [[1]], 1.0), ([], [[2]], 2.0)]
    assert isinstance(error, RuntimeError) and str(error) == "RuntimeError: boom"

    calls = read(steps[:1], close=True)
    assert [name for name, _ in calls] == ["_on_engine_outputs", "_fail_all"]
    assert isinstance(calls[1][1][0], EngineDead)


# ---------------------------------------------------------------------------- the command line
def test_serve_flags_are_explained_and_bad_ones_refused(capsys, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("megactx.models.SHIPPED_MODEL_DIR", tmp_path / "absent")  # else `serve` serves it
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--served-model-name", "--host", "--port", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-dtype", "--device", "--dtype",
                 "--max-queued-requests", "--max-handovers-per-s", "--num-speculative-tokens", "--async-scheduling",
                 "--engine-process", "--gc-threshold"):
        assert flag in help_text
    assert cli_main(["serve"]) == 2 and "--model PATH is required" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(checkpoint), "--num-speculative-tokens", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(checkpoint), "--max-handovers-per-s", "-5"]) == 2
    assert "--max-handovers-per-s must be >= 0" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(checkpoint), "--gc-threshold", "-1"]) == 2
    assert "--gc-threshold must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--no-engine-process"], []], ids=["engine-thread", "engine-process"])
def test_sigterm_drains_in_flight_requests_before_exit(checkpoint, tmp_path, flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megactx", "serve", "--model", str(checkpoint), "--port",
                                 str(port), "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu", *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base_url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start:\n" + log.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        num_tokens = 24
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=num_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)  # mid-stream
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == num_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # uvicorn re-raises the signal after its graceful shutdown, so a supervisor sees it
        assert proc.wait(TIMEOUT_S) in (0, -signal.SIGTERM)
        assert f"prompt tokens, {num_tokens} output tokens" in log.read_text()
        if "--no-engine-process" not in flags:  # the engine process went with the server (its log lines show it ran)
            assert "[engine]" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.gpu
def test_serves_through_the_gpu_kernels(checkpoint):
    llm = _engine(checkpoint, device="cuda")
    with _serving(build_app(llm, served_model_name=MODEL, max_queued_requests=MAX_QUEUED)) as url:
        # the first request compiles the Triton kernels
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10 * TIMEOUT_S)
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(logprobs=2, **kwargs)
        assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
        assert len(whole.choices[0].logprobs.tokens) == 8
        # the same request alone again: the same kernels on the same shapes, so the same text
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == \
            whole.choices[0].text
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                              n=MAX_NUM_SEQS, seed=0, extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in chat.choices] == ["length"] * MAX_NUM_SEQS
        assert chat.usage.completion_tokens == 6 * MAX_NUM_SEQS
        _wait_idle(url)
