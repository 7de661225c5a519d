"""`megactx bench engine`: percentiles, the offline run of both engines on a random checkpoint (they
must produce the same greedy tokens), the HTTP client against a fake OpenAI server (concurrency,
usage counting, errors) and against the real `megactx serve`, and the targets and reports rendered
from made-up figures."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from benchmarks.common import device_slug
from benchmarks.engine import (
    CLOSED,
    CLOSED_LOOP,
    MEGACTX,
    ONLINE_PROCESS,
    ONLINE_SATURATED,
    SERVE,
    TRANSFORMERS,
    RunFigures,
    ServeProcess,
    Settings,
    client_round,
    completion_bodies,
    evaluate_targets,
    interleaved,
    median_interval,
    online_figures,
    percentile,
    render_markdown,
    run_closed_loop,
    run_online,
    write_reports,
)
from megactx.cli import main
from megactx.testing import make_random_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny", seed=2)


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------ figures
@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_equals_torch_quantile(n):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values.tolist(), q) == pytest.approx(float(torch.quantile(values, q / 100)))
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


# ------------------------------------------------------------------------------ offline, CPU
def test_offline_run_of_both_engines_writes_the_reports(ckpt, tmp_path, capsys):
    batches, prompt_len, output_len = (1, 3), 8, 4
    code = main(["bench", "engine", "--device", "cpu", "--model", str(ckpt), "--batches", "1,3", "--prompt-len",
                 str(prompt_len), "--output-len", str(output_len), "--no-online", "--out", str(tmp_path)])
    assert code == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in written] == ["engine-cpu.json", "engine-cpu.md", "engine-cpu.png"]
    results = json.loads((tmp_path / "engine-cpu.json").read_text())
    assert results["skipped"] == [] and results["online"] is None
    runs = {(d["engine"], d["batch"]): RunFigures.from_dict(d) for d in results["offline"]}
    assert set(runs) == {(e, b) for e in (MEGACTX, TRANSFORMERS) for b in batches}
    reps = results["settings"]["reps"]
    for (engine, batch), f in runs.items():
        assert f.output_tokens == batch * output_len and f.requests == batch
        assert len(f.detail["walls_s"]) == reps and f.wall_s == sorted(f.detail["walls_s"])[reps // 2]
        assert f.tokens_per_s == pytest.approx(f.output_tokens / f.wall_s)
        assert f.ttft_s["n"] == batch * reps and f.itl_s["n"] == batch * (output_len - 1) * reps
        assert 0 < f.ttft_s["p50"] <= f.ttft_s["p99"] <= f.latency_s["p99"] <= max(f.detail["walls_s"])
        assert f.detail["steps"] == output_len  # one token a request a decoding step, the first from the prefill
        if engine == MEGACTX:  # every step of the timed runs, from the step log
            st = f.detail["engine_steps"]
            assert (st["steps"], st["prefill_steps"]) == (reps * output_len, reps)
            assert st["decode_steps"] == reps * (output_len - 1)
    for batch in batches:  # fp32, greedy, same prompts: the peer computes the same tokens
        assert runs[TRANSFORMERS, batch].detail["same_tokens_as_megactx"] == batch
    md = (tmp_path / "engine-cpu.md").read_text()
    assert "**CPU run**" in md and "| 3 | megactx |" in md and "| 3 | transformers |" in md
    assert "batch 64 not in this run" in md and "disabled (--no-online)" in md
    assert (tmp_path / "engine-cpu.png").stat().st_size > 0


def test_interleaved_alternates_the_engines_timed_runs():
    order = []

    def runs(name: str, n: int):
        for i in range(n):
            order.append((name, i))
            yield
        return name

    assert interleaved([runs("megactx", 3), runs("transformers", 2)]) == ["megactx", "transformers"]
    assert order == [("megactx", 0), ("transformers", 0), ("megactx", 1), ("transformers", 1), ("megactx", 2)]


@pytest.mark.parametrize("flags,named", [(["--batches", "0"], "--batches"), (["--output-len", "0"], "--output-len"),
                                         (["--threads", "0"], "--threads"),
                                         (["--saturated-clients", "-1"], "--saturated-clients")])
def test_bad_sizes_fail_with_the_flag_named(ckpt, tmp_path, flags, named, capsys):
    assert main(["bench", "engine", "--device", "cpu", "--model", str(ckpt), "--out", str(tmp_path), *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert main(["bench", "engine", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


# ------------------------------------------------------------------------------ online client
class _FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/completions streaming one chunk a token. Every request waits at a barrier of
    `concurrency` parties, so a round only completes if the client keeps that many in flight."""

    barrier: threading.Barrier
    model = "fake"

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["model"] != self.model:
            self._json(404, {"error": {"message": f"model {body['model']!r} not found"}})
            return
        try:
            self.barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            self._json(500, {"error": {"message": "fewer clients in flight than the barrier expects"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self._event({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
        if body.get("stream_options", {}).get("include_usage"):
            self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                  "completion_tokens": body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_server():
    def start(concurrency: int):
        handler = type("Handler", (_FakeOpenAI,), {"barrier": threading.Barrier(concurrency)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server.server_address

    servers: list[ThreadingHTTPServer] = []
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("usage", [True, False])
def test_clients_keep_the_concurrency_and_count_the_tokens(fake_server, usage):
    concurrency, requests, max_tokens = 4, 8, 5
    host, port = fake_server(concurrency)
    prompts = [[1, 2, 3]] * requests
    bodies = completion_bodies("fake", prompts, max_tokens)
    if not usage:
        for body in bodies:
            del body["stream_options"]
    results, wall = client_round(host, port, bodies, concurrency, timeout_s=60)
    assert len(results) == requests
    for r in results:
        assert r.chunks == max_tokens and 0 < r.ttft_s <= r.latency_s <= wall
        assert r.completion_tokens == (max_tokens if usage else None)
    s = Settings("cpu", [concurrency], prompt_len=3, output_len=max_tokens, concurrency=concurrency)
    f = online_figures(results, wall, s)
    assert (f.engine, f.batch, f.requests, f.output_tokens) == (SERVE, concurrency, requests, requests * max_tokens)
    assert f.detail["tokens_counted_from"] == ("usage" if usage else "max_tokens")
    assert f.requests_per_s == pytest.approx(requests / wall)


def test_an_http_error_is_raised_with_the_servers_words(fake_server):
    host, port = fake_server(1)
    with pytest.raises(RuntimeError, match="HTTP 404.*'other' not found"):
        client_round(host, port, completion_bodies("other", [[1]], 2), 1, timeout_s=60)


@pytest.mark.parametrize("extra_args,clients", [
    (["--no-engine-process"], None), (["--engine-process"], None),
    (["--engine-process", "--max-num-seqs", "2"], 4),  # the batch kept full: 4 clients, room for 2
], ids=["engine-thread", "engine-process", "saturated"])
def test_online_run_through_megactx_serve(ckpt, extra_args, clients):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    s = Settings("cpu", [2], prompt_len=8, output_len=4, warmup_len=2, concurrency=2, requests=8, rounds=2,
                 threads=1, server_timeout_s=120, request_timeout_s=120)
    said: list[str] = []
    between = []  # before round 1 and after each round, untimed (the bench runs the offline engine there)
    f = run_online(ckpt, s, vocab_size=256, log=said.append, extra_args=extra_args,
                   between=lambda: between.append(time.perf_counter()), clients=clients)
    assert any("megactx serve is up" in line for line in said) and len(between) == 3
    assert f.wall_s < between[-1] - between[0]
    assert (f.engine, f.batch, f.requests, f.detail["clients"]) == (SERVE, 2, 8, clients or 2)
    assert f.output_tokens == 8 * 4 and f.detail["tokens_counted_from"] == "usage"
    assert f.ttft_s["n"] == 8 and f.ttft_s["p99"] <= f.latency_s["p99"] <= f.wall_s
    steps = f.detail["engine_steps"]  # the server's step log, the timed round's steps only
    assert steps["steps"] >= 4 * 4 and steps["decode_steps"] >= 1 and steps["busy_s"] <= f.wall_s
    if clients:  # more clients than room: the rest wait in the server's queue, and the batch stays full
        assert steps["mean_seqs"] <= 2 and steps["steps"] >= 8 * 4 / 2
    # the server's own TTFT (its /metrics, the timed round's requests) is within the clients'
    assert 0 < f.detail["server_ttft_mean_s"] <= f.detail["client_ttft_mean_s"] <= f.ttft_s["p99"]
    lag = f.detail["loop_lag_s"]  # its event loop's lag during the rounds, from /metrics
    assert 0 <= lag["mean"] <= lag["p99"] and lag["p90"] <= lag["p99"]
    pauses = f.detail["server_gc_pauses"]  # its collector's pauses during the rounds (often none: frozen)
    assert pauses["count"] >= 0 and pauses["total_s"] >= 0


def test_a_scraped_histogram_gives_what_was_observed_between_scrapes_and_its_quantiles():
    from benchmarks.engine import Histogram

    before = Histogram([(0.001, 2.0), (0.01, 3.0), (math.inf, 3.0)], 0.004, 3.0)
    after = Histogram([(0.001, 10.0), (0.01, 19.0), (math.inf, 20.0)], 0.104, 20.0)
    seen = after - before  # 8 under 1 ms, 8 in (1, 10] ms, 1 above
    assert seen.buckets == [(0.001, 8.0), (0.01, 16.0), (math.inf, 17.0)] and seen.count == 17
    assert seen.mean == pytest.approx(0.1 / 17)
    assert (seen.quantile(0.4), seen.quantile(0.9), seen.quantile(0.99)) == (0.001, 0.01, math.inf)
    assert (seen + seen).count == 34 and Histogram([], 0.0, 0.0).quantile(0.5) is None


def test_the_closed_loop_keeps_the_clients_in_flight_and_gets_its_row(ckpt, tmp_path):
    """The online workload on the offline engine, in-process: R requests of M tokens, never more
    than C at once, the clients starting one a step, the next sent as one ends; the report shows it
    above the server runs."""
    from megactx import LLM

    s = Settings("cpu", [2], prompt_len=8, output_len=4, warmup_len=2, concurrency=3, requests=7, threads=1)
    llm = LLM(ckpt, device="cpu", max_model_len=12, max_num_seqs=3)
    in_flight = []
    step = llm.step
    llm.step = lambda: (in_flight.append(llm.scheduler.num_running + llm.scheduler.num_waiting), step())[1]
    f = run_closed_loop(llm, s)
    assert (f.engine, f.batch, f.requests, f.output_tokens) == (CLOSED, 3, 7, 7 * 4)
    assert max(in_flight) == 3 and in_flight.count(3) > len(in_flight) // 2
    assert in_flight[2:5] == [1, 2, 3]  # after the warm-up's 2 steps the clients start one a step
    assert f.ttft_s["n"] == f.latency_s["n"] == 7 and f.ttft_s["p99"] <= f.latency_s["p99"] <= f.wall_s
    assert f.detail["engine_steps"]["steps"] == len(in_flight) - 2  # the warm-up's 2 steps are not logged
    results = _fake_results("cuda", 6000.0, 500.0, 5700.0) | {CLOSED_LOOP: _run(CLOSED, 64, 5900.0, requests=256)}
    md = write_reports(results, tmp_path)[1].read_text()
    assert "| engine alone, in-process (no HTTP) | 64 | 256 |" in md and "| 1.7% |" in md


def test_the_server_runs_the_offline_engines_configuration(tmp_path):
    """Online and offline must differ only by the HTTP layer: the same context, batch room, and no
    speculative decoding (serve drafts γ = 7 by default for a checkpoint with an MTP layer)."""
    s = Settings("cpu", [1, 16], prompt_len=32, output_len=16, concurrency=16, requests=32, serve_args=["--x=1"])
    cmd = ServeProcess(tmp_path, s).command
    i = cmd.index("--num-speculative-tokens")
    assert cmd[i + 1] == "0" and cmd[cmd.index("--max-model-len") + 1] == "48" and cmd[-1] == "--x=1"


def test_a_server_that_cannot_start_is_reported_with_its_output(tmp_path):
    s = Settings("cpu", [1], prompt_len=4, output_len=2, concurrency=1, requests=1, server_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with code 2.*--model"):
        run_online(tmp_path / "no-such-checkpoint", s, vocab_size=16, log=lambda _: None)


# ------------------------------------------------------------------------------ reports
def _run(engine: str, batch: int, tokens_per_s: float, requests: int | None = None) -> dict:
    requests = requests or batch
    output_len = 128
    wall = requests * output_len / tokens_per_s
    lat = {"p50": 0.01 * batch, "p99": 0.02 * batch, "mean": 0.015 * batch, "n": requests}
    return RunFigures(engine, batch, requests, 128, output_len, requests * output_len, wall, lat,
                      None if engine == SERVE else {k: v / 10 for k, v in lat.items()} | {"n": requests * 127},
                      lat | {"p50": wall / 2, "p99": wall}).to_dict()


def _fake_results(device: str, ours_64: float, peer_64: float, online_64: float | None,
                  closed_64: float | None = None) -> dict:
    """online_64: the saturated run's tokens/s (the target's; None: it failed), closed_64: the default
    server's at 64 closed-loop clients (None: not in the results)."""
    machine = {"device": device, "gpu": "Fake GPU 2" if device == "cuda" else None, "date": "2026-01-01T00:00:00",
               "torch": "2.11", "triton": "3.6", "python": "3.11", "cpu": "x86_64"}
    offline = [_run(MEGACTX, 1, 100.0), _run(TRANSFORMERS, 1, 50.0), _run(MEGACTX, 16, 1500.0),
               _run(TRANSFORMERS, 16, 400.0), _run(MEGACTX, 64, ours_64), _run(TRANSFORMERS, 64, peer_64)]
    settings = Settings(device).to_dict()
    return {"schema": "megactx-bench-engine/1", "machine": machine, "settings": settings,
            "model": {"path": "/models/tiny", "random_weights": True, "model_type": "glm_moe_dsa", "layers": 8,
                      "hidden_size": 256, "vocab_size": 4096, "params": 10_200_000, "transformers": "5.24.0"},
            "offline": offline, "online": None, ONLINE_PROCESS: closed_64 and _run(SERVE, 64, closed_64, requests=256),
            ONLINE_SATURATED: online_64 and _saturated(_run(SERVE, 64, online_64, requests=256)),
            "skipped": [] if online_64 else [{"step": ONLINE_SATURATED,
                                              "reason": "RuntimeError: the server fell over"}]}


def _saturated(run: dict) -> dict:
    run["detail"]["clients"] = 128
    return run


@pytest.mark.parametrize("ours,peer,online,speedup_ok,overhead_ok", [
    (6000.0, 500.0, 5700.0, True, True),  # 12x; 5% overhead
    (6000.0, 1000.0, 4800.0, False, False),  # 6x; 20% overhead
])
def test_targets_compare_the_right_figures(ours, peer, online, speedup_ok, overhead_ok):
    speedup, overhead = evaluate_targets(_fake_results("cuda", ours, peer, online))
    assert speedup["passed"] is speedup_ok and f"{ours / peer:.3g}x" in speedup["figure"]
    assert overhead["passed"] is overhead_ok and f"{1 - online / ours:.1%}" in overhead["figure"]


def test_the_target_is_the_default_server_with_its_batch_full_and_the_closed_loops_are_shown_beside_it():
    results = _fake_results("cuda", 6000.0, 500.0, 5820.0, closed_64=5100.0)
    results["online"] = _run(SERVE, 64, 4800.0, requests=256)  # --no-engine-process: 20% overhead
    speedup, target = evaluate_targets(results)
    assert target["passed"] is True and "3.0%" in target["figure"] and "128 clients" in target["figure"]
    assert "batch kept full" in target["target"] and "64 closed-loop clients: 15.0%" in target["note"]
    md = render_markdown(results, [speedup, target])
    assert "| engine thread (--no-engine-process) | 64 | 256 |" in md and "| 20.0% |" in md
    assert "| engine process (default) | 64 | 256 |" in md and "| 15.0% |" in md
    assert "| engine process (default), batch kept full | 128 | 256 |" in md and "| 3.0% |" in md
    results.pop(ONLINE_SATURATED)
    results["skipped"].append({"step": ONLINE_SATURATED, "reason": "EngineFailed: out of memory"})
    assert "out of memory" in evaluate_targets(results)[1]["note"]  # asked for and failed: said so
    results["settings"]["saturated_clients"] = 0
    results["skipped"].pop()
    assert "--saturated-clients 0" in evaluate_targets(results)[1]["note"]


def test_the_overhead_is_taken_against_the_offline_runs_around_the_online_run():
    """An online run with offline runs just before and after it compares with their mean, not
    with the offline table's figure from another part of the run (the host's speed drifts)."""
    results = _fake_results("cuda", 6000.0, 500.0, 5700.0)  # 5% against the offline table's 6000
    results[ONLINE_SATURATED]["detail"] |= {"offline_tokens_per_s_around": [6200.0, 6400.0, 6600.0],
                                            "offline_tokens_per_s": 6400.0}
    _, overhead = evaluate_targets(results)
    assert overhead["passed"] is False and f"{1 - 5700 / 6400:.1%}" in overhead["figure"]
    md = render_markdown(results, [overhead])
    assert "| 6,400 (6,200 – 6,600) | 10.9% |" in md
    # references further apart than the 10% to be measured: the run cannot decide, and says why
    results[ONLINE_SATURATED]["detail"]["offline_tokens_per_s_around"] = [5000.0, 6400.0, 7800.0]
    _, overhead = evaluate_targets(results)
    assert overhead["passed"] is None and f"{1 - 5700 / 6400:.1%}" in overhead["figure"]
    assert "undecided" in overhead["note"] and "5,000 - 7,800" in overhead["note"] and "44%" in overhead["note"]
    results[ONLINE_SATURATED]["detail"]["host_probe_ms_around"] = [12.4, 21.3, 12.6]  # the host's speed beside them
    assert "a fixed Python loop took 12.4 - 21.3 ms" in evaluate_targets(results)[1]["note"]


def test_the_offline_engine_runs_between_the_rounds_and_gives_the_reference(ckpt):
    from benchmarks.engine import EngineBench, offline_engine, split_rounds

    assert split_rounds(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    s = Settings("cpu", [2], prompt_len=8, output_len=4, warmup_len=2, concurrency=2, requests=5, rounds=2,
                 threads=1, reps=1)
    bench = EngineBench(ckpt, True, s)
    assert bench.referenced(lambda between: RunFigures.from_dict(_run(SERVE, 2, 50.0))).detail.get(
        "offline_tokens_per_s") is None  # no offline engine: nothing to measure between the rounds
    bench.llm = offline_engine(ckpt, s)
    order = []
    add = bench.llm.add_request
    bench.llm.add_request = lambda *a, **k: (order.append(len(a[0])), add(*a, **k))[1]
    f = bench.referenced(lambda between: run_closed_loop(bench.llm, s, between))
    assert (f.requests, f.output_tokens) == (5, 5 * 4)
    around = f.detail["offline_tokens_per_s_around"]
    assert len(around) == 3 and min(around) > 0 and f.detail["offline_tokens_per_s"] == pytest.approx(
        sum(around) / 3)  # before round 1, after round 1, after round 2
    assert len(f.detail["host_probe_ms_around"]) == 3 and min(f.detail["host_probe_ms_around"]) > 0
    # the prompts added, in order: warm-up (2), then reference runs (2 prompts each: warm-up + 8 timed)
    # between the rounds of 3 and 2 closed-loop requests
    reference = [8] * 2 * 9
    assert order == [8] * 2 + reference + [8] * 3 + reference + [8] * 2 + reference
    rates = f.detail["round_tokens_per_s"]  # each round's own tokens over its own time
    assert len(rates) == 2 and min(rates) > 0 and min(rates) <= f.tokens_per_s <= max(rates)


def test_median_interval_is_the_binomial_order_statistics():
    assert median_interval([1, 2, 3, 4, 5]) is None  # below 6 values no interval reaches 95%
    assert median_interval([3, 1, 2, 6, 5, 4]) == (3.5, 1, 6)  # 1 - 2/64 = 96.9%
    assert median_interval(list(range(16))) == (7.5, 3, 12)  # the 4th and 13th: 97.9%
    # it holds the median of what it samples at least 95% of the time, for a skewed distribution too
    gen = torch.Generator().manual_seed(0)
    draws = -torch.log(torch.rand(2000, 16, generator=gen, dtype=torch.float64))  # Exponential(1)
    true_median = math.log(2)
    held = [lo <= true_median <= hi for _, lo, hi in (median_interval(row.tolist()) for row in draws)]
    assert sum(held) / len(held) >= 0.95


@pytest.mark.parametrize("ratio,passed", [(0.95, True), (0.80, False), (0.90, None)])
def test_the_overhead_target_is_judged_on_the_rounds_median(ratio, passed):
    """16 rounds, each at `ratio` of the offline runs just before and after it (within +-2%), while
    the host's speed swings by 1.7x from one part of the run to another: the rounds decide where
    the reference sets' spread alone would not."""
    results = _fake_results("cuda", 6000.0, 500.0, 5700.0)
    around = [6000.0 * (1.7 if i % 3 == 0 else 1.0) for i in range(17)]
    wobble = [1 + 0.02 * ((i * 7) % 5 - 2) / 2 for i in range(16)]
    rates = [ratio * (a + b) / 2 * w for a, b, w in zip(around, around[1:], wobble)]
    results[ONLINE_SATURATED]["detail"] |= {"offline_tokens_per_s_around": around, "round_tokens_per_s": rates,
                                            "offline_tokens_per_s": sum(around) / 17}
    _, overhead = evaluate_targets(results)
    assert overhead["passed"] is passed and "median of 16 rounds" in overhead["figure"]
    assert f"{1 - ratio:.1%}" in overhead["figure"]
    assert ("undecided" in overhead["note"] and "holds 10%" in overhead["note"]) == (passed is None)


def test_runs_of_one_workload_pool_their_rounds(tmp_path, capsys):
    """Two runs whose 8 rounds each leave the interval holding 10% decide together (16 pairs); a
    run of another workload is refused, naming what differs, and the pooled JSON renders alike."""
    from benchmarks.engine import pool_rounds
    from benchmarks.engine import run as run_bench

    def with_rounds(ratios):
        results = _fake_results("cuda", 6000.0, 500.0, 5700.0)
        around = [6000.0] * (len(ratios) + 1)
        results[ONLINE_SATURATED]["detail"] |= {"offline_tokens_per_s_around": around,
                                                "round_tokens_per_s": [r * 6000.0 for r in ratios]}
        return results

    first = with_rounds([0.96, 0.95, 0.97, 0.94, 0.80, 0.95, 0.96, 0.93])  # 4th lowest of 8: 0.93 (7%)
    second = with_rounds([0.95, 0.97, 0.96, 0.94, 0.95, 0.96, 0.94, 0.95]) | {
        "machine": first["machine"] | {"date": "2026-01-02T00:00:00"}}
    alone = evaluate_targets(first)[1]
    assert alone["passed"] is None and "median of 8 rounds" in alone["figure"]  # interval 0.80 .. 0.97
    pooled = pool_rounds([("a.json", first), ("b.json", second)])
    assert first[ONLINE_SATURATED]["detail"].get("pooled_runs") is None  # the inputs are left as they were
    _, target = evaluate_targets(pooled)
    assert target["passed"] is True and "median of 16 rounds of 2 runs" in target["figure"]
    assert "2026-01-02T00:00:00" in target["figure"]
    other = second | {"settings": second["settings"] | {"output_len": 256}}
    with pytest.raises(ValueError, match="settings output_len differs"):
        pool_rounds([("a.json", first), ("c.json", other)])
    # through the CLI: the pooled JSON written is a run of its own that renders the same target
    for name, results in (("a.json", first), ("b.json", second), ("c.json", other)):
        (tmp_path / name).write_text(json.dumps(results))
    args = argparse.Namespace(from_json=[tmp_path / "a.json", tmp_path / "b.json"], out=tmp_path / "pooled")
    assert run_bench(args) == 0
    again = json.loads(next((tmp_path / "pooled").glob("engine-*.json")).read_text())
    assert evaluate_targets(again)[1]["figure"] == target["figure"]
    args.from_json = [tmp_path / "a.json", tmp_path / "c.json"]
    assert run_bench(args) == 2 and "output_len differs" in capsys.readouterr().err


def test_targets_are_undecided_on_a_cpu_or_without_the_figures():
    speedup, overhead = evaluate_targets(_fake_results("cpu", 6000.0, 500.0, None))
    assert speedup["passed"] is None and "12x" in speedup["figure"] and "GPU target" in speedup["note"]
    assert overhead["passed"] is None and "the server fell over" in overhead["note"]


def test_reports_render_from_fake_figures_and_again_from_the_json(tmp_path, capsys):
    results = _fake_results("cuda", 6000.0, 500.0, 5700.0)
    paths = write_reports(results, tmp_path)
    assert [p.name for p in paths] == ["engine-fake-gpu-2.json", "engine-fake-gpu-2.md", "engine-fake-gpu-2.png"]
    saved = json.loads(paths[0].read_text())
    assert [t["passed"] for t in saved["targets"]] == [True, True]
    md = paths[1].read_text()
    assert "# megactx engine benchmark: Fake GPU 2" in md and "**Random weights**" in md
    assert "| 64 | megactx | 6,000 | 12x |" in md  # tokens/s and the ratio to transformers at that batch
    assert "| 128 | 256 |" in md and "5.0%" in md  # the online row: clients, requests, overhead
    assert md.count("| pass") == 2 and "FAIL" not in md
    assert paths[2].stat().st_size > 0
    again = tmp_path / "again"
    assert main(["bench", "engine", "--from-json", str(paths[0]), "--out", str(again)]) == 0
    assert (again / "engine-fake-gpu-2.md").read_text() == md


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_the_whole_benchmark_runs_on_a_gpu(ckpt, tmp_path):
    from benchmarks.engine import EngineBench

    s = Settings("cuda", [1, 4], prompt_len=32, output_len=8, warmup_len=2, concurrency=4, requests=8)
    results = EngineBench(ckpt, True, s).run()
    assert results["skipped"] == [], results["skipped"]
    assert {(d["engine"], d["batch"]) for d in results["offline"]} == {
        (e, b) for e in (MEGACTX, TRANSFORMERS) for b in (1, 4)}
    assert all(d["output_tokens"] == d["batch"] * 8 for d in results["offline"])
    assert results["online"]["output_tokens"] == results[CLOSED_LOOP]["output_tokens"] == 8 * 8
    assert results["online_engine_process"]["output_tokens"] == 8 * 8  # the server with its engine in a process
    assert results[ONLINE_SATURATED]["output_tokens"] == 8 * 8 and results[ONLINE_SATURATED]["detail"]["clients"] == 8
    assert write_reports(results, tmp_path)[0].name == f"engine-{device_slug(results['machine'])}.json"
