"""`megactx serve` against the official `openai` client on loopback: what the server returns equals
what the offline engine (`LLM.generate`) makes for the same prompt and sampling settings —
completions and chat, streamed and not, with stop strings, logprobs, seeds and n concurrent
streams — and bad input, disconnects, overload and SIGTERM behave as documented.

One server runs in-process (uvicorn in a thread) on a random checkpoint, on the CPU; the SIGTERM
test starts `python -m megactx serve` as a subprocess; a GPU test serves through the Triton kernels."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from megactx import LLM, SamplingParams
from megactx.cli import main as cli_main
from megactx.serve.api import RETRY_AFTER_S, build_app
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


@pytest.fixture(scope="module")
def base_url(checkpoint):
    with _serving(build_app(_engine(checkpoint), served_model_name=MODEL, max_queued_requests=MAX_QUEUED)) as url:
        yield url


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
    else:  # the client gives up waiting for the whole response
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT_S, read=0.5))
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


# ---------------------------------------------------------------------------- the command line
def test_serve_flags_are_explained_and_bad_ones_refused(capsys, checkpoint):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--served-model-name", "--host", "--port", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-dtype", "--device", "--dtype",
                 "--max-queued-requests", "--num-speculative-tokens"):
        assert flag in help_text
    assert cli_main(["serve"]) == 2 and "--model PATH is required" in capsys.readouterr().err
    assert cli_main(["serve", "--model", str(checkpoint), "--num-speculative-tokens", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_before_exit(checkpoint, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megactx", "serve", "--model", str(checkpoint), "--port",
                                 str(port), "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu"],
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
