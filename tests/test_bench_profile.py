"""`megactx bench profile`: the per-step breakdown of profiler events (kernels, runtime calls, host
ops, the rows past --top folded into one), and a CPU run of a random MTP checkpoint without and
with speculation: step counts that the engine's bookkeeping fixes, host ops found, reports written
and rendered again from their JSON, bad arguments refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from benchmarks.profile import breakdown
from megactx.cli import main
from megactx.engine.steplog import DEVICE_WAIT
from megactx.testing import make_random_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class FakeEvent:
    name: str
    device: str  # "CPU" or "CUDA"
    us: float  # span (kernels, runtime calls) or self CPU time (ops)
    is_user_annotation: bool = False  # a record_function range (on the GPU timeline too, with CUDA kernels)
    start: float = 0.0  # µs on the profile's clock

    @property
    def device_type(self):
        return SimpleNamespace(name=self.device)

    @property
    def time_range(self):
        return SimpleNamespace(elapsed_us=lambda: self.us, start=self.start, end=self.start + self.us)

    @property
    def self_cpu_time_total(self):
        return self.us


def test_breakdown_sorts_kernels_calls_and_ops_per_step_and_folds_the_rest():
    events = ([FakeEvent("gemm", "CUDA", 10.0)] * 4 + [FakeEvent("topk", "CUDA", 30.0)] * 2
              + [FakeEvent("norm", "CUDA", 1.0)] * 6 + [FakeEvent("cudaLaunchKernel", "CPU", 2.0)] * 8
              + [FakeEvent("cuLaunchKernel", "CPU", 3.0)] * 2 + [FakeEvent("cudaGraphLaunch", "CPU", 5.0)] * 2
              + [FakeEvent("aten::mm", "CPU", 7.0)] * 2 + [FakeEvent("aten::cudaish", "CPU", 1.0)]
              + [FakeEvent("megactx::verify", "CPU", 50.0, True), FakeEvent("megactx::emit", "CPU", 4.0, True)] * 2
              + [FakeEvent("megactx::verify", "CUDA", 45.0, True)] * 2)  # its GPU shadow: not a kernel
    b = breakdown(events, steps=2, top=2)
    # the engine's named parts of a step, in step order, apart from the ops
    assert [{k: r[k] for k in ("name", "calls_per_step", "us_per_step")} for r in b["phases"]] == [
        {"name": "verify", "calls_per_step": 1.0, "us_per_step": 50.0},
        {"name": "emit", "calls_per_step": 1.0, "us_per_step": 4.0}]
    assert b["device_us_per_step"] == pytest.approx((40 + 60 + 6) / 2)
    assert b["kernels_per_step"] == pytest.approx(12 / 2)
    assert [r["name"] for r in b["kernels"]] == ["topk", "gemm", "other (1)"]  # by device time, not calls
    assert b["kernels"][0] == {"name": "topk", "calls_per_step": 1.0, "us_per_step": 30.0}
    assert b["kernels"][2]["calls_per_step"] == 3.0 and b["kernels"][2]["us_per_step"] == 3.0
    # runtime and driver calls (cudaX, cuX) apart from the ops; "aten::..." never is one
    assert {r["name"] for r in b["runtime_calls"]} >= {"cudaLaunchKernel", "cudaGraphLaunch"}
    assert sum(r["calls_per_step"] for r in b["runtime_calls"]) == pytest.approx(12 / 2)
    assert [r["name"] for r in b["host_ops"]] == ["aten::mm", "aten::cudaish"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny", seed=3, vocab_size=512,
                                  num_hidden_layers=2, first_k_dense_replace=5, index_topk=16)


def test_device_idle_is_split_by_the_step_part_the_host_was_in():
    """Two steps 100 µs apart, each: schedule 0-10, forward 10-40 (a kernel 15-35), verify 40-60 (a
    kernel 45-65, past the part's end), emit 60-70. The span starts with the first part."""
    def step(t0):
        return [FakeEvent("megactx::schedule", "CPU", 10.0, True, t0), FakeEvent("megactx::forward", "CPU", 30.0,
                                                                                 True, t0 + 10),
                FakeEvent("megactx::verify", "CPU", 20.0, True, t0 + 40),
                FakeEvent("megactx::emit", "CPU", 10.0, True, t0 + 60),
                FakeEvent("gemm", "CUDA", 20.0, False, t0 + 15), FakeEvent("topk", "CUDA", 20.0, False, t0 + 45),
                FakeEvent("megactx::verify", "CUDA", 18.0, True, t0 + 42)]  # a shadow: neither busy nor a part
    b = breakdown(step(0.0) + step(100.0), steps=2, top=5)
    idle = {r["name"]: r["device_idle_us_per_step"] for r in b["phases"]}
    # schedule 0-10 all idle; forward 10-15 and 35-40; verify 40-45; emit 65-70
    assert idle == {"schedule": 10.0, "forward": 10.0, "verify": 5.0, "emit": 5.0}
    # 70-100 is in no part (once: the span ends with the second step's emit)
    assert b["device_idle_between_steps_us_per_step"] == pytest.approx(30 / 2)
    assert b["device_idle_us_per_step"] == pytest.approx(30 + 30 / 2)
    # a CPU run (no kernels): no idle figures at all
    cpu = breakdown([e for e in step(0.0) if e.device == "CPU"], steps=1, top=5)
    assert "device_idle_us_per_step" not in cpu and "device_idle_us_per_step" not in cpu["phases"][0]


def test_timed_replays_time_each_graph_kind_and_give_the_graphs_back():
    from benchmarks.profile import timed_replays
    from megactx.engine.model_runner import Graph

    calls = []
    graphs = SimpleNamespace(graphs={("verify", 1, 64): Graph(lambda: calls.append("v"), None, lambda: None),
                                     ("draft", 1, 64, "loop"): Graph(lambda: calls.append("d"), None, lambda: None)})
    own = {key: graph.replay for key, graph in graphs.graphs.items()}
    with timed_replays(graphs) as times:
        for _ in range(3):
            graphs.graphs[("verify", 1, 64)].replay()
        graphs.graphs[("draft", 1, 64, "loop")].replay()
    assert calls == ["v", "v", "v", "d"]  # the graphs ran, each replay timed under its kind
    assert {kind: n for kind, (n, _) in times.items()} == {"verify": 3, "draft": 1}
    assert all(us > 0 for _, us in times.values())
    assert all(graph.replay is own[key] for key, graph in graphs.graphs.items())
    with timed_replays(None) as none:  # an engine without graphs (a CPU)
        pass
    assert not none


def _args(ckpt, out, *extra):
    return ["bench", "profile", "--device", "cpu", "--model", str(ckpt), "--prompt-len", "12", "--output-len", "9",
            "--top", "5", "--out", str(out), *extra]


def test_profile_runs_the_engines_and_writes_the_reports(ckpt, tmp_path, capsys):
    assert main(_args(ckpt, tmp_path, "--num-speculative-tokens", "0,2", "--temperature", "0")) == 0
    results = json.loads((tmp_path / "profile-cpu.json").read_text())
    plain, spec = results["engines"]
    # no speculation: the prefill step emits the first token, one decode step each after it
    assert (plain["gamma"], plain["steps"], plain["output_tokens"]) == (0, 9, 9)
    assert plain["mean_acceptance_length"] is None
    # γ = 2: a verify emits 1 to 3 tokens, so 8 tokens after the prefill's take 3 to 8 steps
    assert spec["gamma"] == 2 and spec["output_tokens"] == 9 and 1 + 3 <= spec["steps"] <= 1 + 8
    assert 1.0 <= spec["mean_acceptance_length"] <= 3.0
    # every step schedules, computes and emits; a speculative one verifies and drafts instead of sampling
    assert [p["name"] for p in plain["phases"]] == ["schedule", "forward", "sample", "emit"]
    assert [p["name"] for p in spec["phases"]] == ["schedule", "forward", "verify", "propose", "emit"]
    for e in results["engines"]:
        assert e["profiled_steps"] == e["steps"]  # the same prompts and seeds: the same steps
        assert {p["name"]: p["calls_per_step"] for p in e["phases"]}["forward"] == 1.0
        assert e["kernels"] == [] and e["device_us_per_step"] == 0  # a CPU has no device side
        assert len(e["host_ops"]) == 6 and e["host_ops"][-1]["name"].startswith("other")
        assert any(r["name"] == "aten::mm" for r in e["host_ops"])
        # the timed run beyond its median: its steps' own time within its wall, none captured (no CUDA),
        # the slowest steps most first
        assert 0 < e["steps_ms"] <= 1e3 * e["wall_s"] and e["outside_steps_ms"] >= 0 and e["graphs_captured"] == 0
        slow = e["slowest_steps"]
        assert len(slow) == 5 and [r["ms"] for r in slow] == sorted((r["ms"] for r in slow), reverse=True)
        assert slow[0]["ms"] <= e["steps_ms"] and all(0 <= r["step"] < e["steps"] for r in slow)
        assert e["graph_replays"] == [] and e["graphs_alone"] == []  # no CUDA graphs on a CPU
        # the timed run's parts, timed on the host without a profiler: every part once a step, and the
        # host's waits for the device's tokens inside them (on a CPU: copies of finished tensors)
        parts = {r["name"]: r for r in e["host_parts"]}
        assert set(parts) == {p["name"] for p in e["phases"]} | {DEVICE_WAIT}
        assert parts["forward"]["calls_per_step"] == 1.0 and parts[DEVICE_WAIT]["calls_per_step"] >= 1.0
        inside = "verify" if e["gamma"] else "emit"
        assert parts[DEVICE_WAIT]["us_per_step"] < parts[inside]["us_per_step"]
        in_parts = sum(r["us_per_step"] for r in e["host_parts"] if r["name"] != DEVICE_WAIT)
        assert in_parts <= 1e3 * e["steps_ms"] / e["steps"]
    md = (tmp_path / "profile-cpu.md").read_text()
    assert "the host works " in md and f"| `{DEVICE_WAIT}` |" in md
    assert "## γ = 2" in md and "`aten::mm`" in md and "Slowest steps: step " in md
    assert (tmp_path / "profile-cpu.png").is_file()
    assert results["ceilings"] is None  # a CPU run measures none; a GPU's are shown beside its kernels:
    from benchmarks.common import Ceilings
    from benchmarks.profile import render_markdown

    gpu = results | {"ceilings": Ceilings(680.0, 1200.0, 4100.0, {"matmul_n": 8192, "copy_bytes": 1 << 30}).to_dict()}
    assert "## Ceilings (measured in this run)" in render_markdown(gpu) and "4,100 GB/s" in render_markdown(gpu)
    gpu["engines"][1] = spec | {"graph_replays": [{"kind": "verify", "replays_per_step": 1.0,
                                                   "host_us_per_replay": 250.0}],
                                "graphs_alone": [{"graph": "('verify', 1, 4096)", "host_us": 17.0,
                                                  "device_us": 1200.0}]}
    assert "| `verify` | 1 | 250 |" in render_markdown(gpu)
    assert "| `('verify', 1, 4096)` | 17 | 1,200 | – | – |" in render_markdown(gpu)  # a JSON from before the kernels
    gpu["engines"][0] = plain | {"graphs_alone": [  # the plain engine's decode graph, the verify's base
        {"graph": "('decode', 1, 4096)", "kind": "decode", "batch": 1, "keys": 4096, "host_us": 15.0,
         "device_us": 900.0, "kernels": 2, "by_kernel": {"gemm": [1, 500.0], "norm": [1, 300.0]}}]}
    gpu["engines"][1]["graphs_alone"] = [
        {"graph": "('verify', 1, 4096)", "kind": "verify", "batch": 1, "keys": 4096, "host_us": 17.0,
         "device_us": 1200.0, "kernels": 3, "by_kernel": {"gemm": [1, 600.0], "norm": [1, 300.0], "sgemm": [1, 200.0]}}]
    md = render_markdown(gpu)
    assert "| `('verify', 1, 4096)` | 17 | 1,200 | 3 | 1,100 |" in md
    assert "What `('verify', 1, 4096)` runs beyond `('decode', 1, 4096)`" in md and "300 µs added in all" in md
    assert "| `sgemm` | 0 | 0 | 1 | 200 | 200 |" in md
    again = tmp_path / "again"
    assert main(["bench", "profile", "--from-json", str(tmp_path / "profile-cpu.json"), "--out", str(again)]) == 0
    assert (again / "profile-cpu.md").read_text() == (tmp_path / "profile-cpu.md").read_text()


def test_profile_of_a_prefill(ckpt, tmp_path):
    # 150 tokens: two full KV blocks, which a prefix cache would hand the timed and profiled runs
    assert main(_args(ckpt, tmp_path, "--prefill", "150", "--max-num-batched-tokens", "64", "--no-cuda-graphs",
                      "--no-fuse", "--python-profile")) == 0
    results = json.loads((tmp_path / "profile-cpu.json").read_text())
    (engine,) = results["engines"]
    # --python-profile: the functions by own host time a step, most first, the engine's among them
    functions = engine["python_functions"]
    assert [r["own_us_per_step"] for r in functions] == sorted((r["own_us_per_step"] for r in functions), reverse=True)
    assert all(r["cum_us_per_step"] >= r["own_us_per_step"] > 0 for r in functions)
    assert any(".py:" in r["function"] for r in functions)
    assert "under cProfile" in (tmp_path / "profile-cpu.md").read_text()
    assert results["workload"].endswith("no CUDA graphs, unfused (LLM(fuse=False))")
    # every run computes the whole prompt, in chunks of 64, as the warm-up did (no kernel meets a new shape)
    assert engine["steps"] == engine["profiled_steps"] == 3 and engine["output_tokens"] == 1
    assert "no prefix cache" in (tmp_path / "profile-cpu.md").read_text()


def test_a_prefill_prompt_is_held_out_code_around_again():
    """With a tokenizer, a prefill's prompt is held-out code from a line start, around the split again
    past its end (a needle haystack's text, on which the indexers' top-k costs what it costs there)."""
    from pathlib import Path

    from benchmarks.profile import Workload, prompts_for
    from benchmarks.spec import stdlib_held_out

    model = Path(__file__).resolve().parents[1] / "models" / "megactx-tiny"
    split, _ = stdlib_held_out(model, 4096)
    n = split.num_tokens
    (ids,), what = prompts_for(model, 4096, Workload(prefill=n + 1000, seed=3))
    assert len(ids) == n + 1000 and "held-out code" in what and "times over" in what
    first = int(split.line_starts[3])
    assert ids[: n - first] == split.tokens[first:].tolist() and ids[n - first: n] == split.tokens[:first].tolist()
    assert ids[n:] == ids[: 1000]
    (short,), what = prompts_for(model, 4096, Workload(prefill=100))
    assert short == split.tokens[: 100].tolist() and "times over" not in what  # seed 0: the first line


@pytest.mark.parametrize("extra, says", [(("--num-speculative-tokens", "-1"), "γ >= 0"),
                                         (("--prefill", "64", "--num-speculative-tokens", "2"), "without speculation"),
                                         (("--batch", "0"), "--batch must be at least 1")])
def test_profile_refuses_bad_arguments(ckpt, tmp_path, capsys, extra, says):
    assert main(_args(ckpt, tmp_path, *extra)) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "profile-cpu.json").exists()


def test_kernels_beyond_the_decode_graph():
    """A verify graph's kernels against the decode graph of its batch and nearest key bucket: the
    kernels by the device time they add, most first, the rest in one row, the total added."""
    from benchmarks.profile import kernels_beyond

    def row(kind, batch, keys, by_kernel):
        return {"graph": str((kind, batch, keys)), "kind": kind, "batch": batch, "keys": keys, "by_kernel": by_kernel}

    rows = [row("decode", 1, 321, {"gemm": [16, 100.0], "norm": [32, 50.0], "topk": [4, 20.0]}),
            row("decode", 1, 1024, {"gemm": [16, 999.0]}),  # a farther key bucket
            row("decode", 2, 321, {"gemm": [16, 0.0]}),  # another batch
            row("verify", 1, 324, {"gemm": [16, 130.0], "norm": [32, 50.0], "sgemm": [16, 60.0]}),
            row("draft", 1, 324, {"gemm": [3, 10.0]})]
    (d,) = kernels_beyond(rows, rows, top=1)
    assert d["graph"] == "('verify', 1, 324)" and d["base"] == "('decode', 1, 321)"
    assert d["rows"] == [{"kernel": "sgemm", "base_calls": 0, "base_us": 0.0, "calls": 16, "us": 60.0},
                         {"kernel": "other (3)", "base_calls": 52, "base_us": 170.0, "calls": 48, "us": 180.0}]
    assert d["added_us"] == 70.0
    assert kernels_beyond(rows[3:4], rows[:3], top=1) == [d]  # the decode graphs of another engine
    assert kernels_beyond(rows[1:3] + rows[4:], rows) == []  # no verify graph


@pytest.mark.gpu
def test_profile_on_a_gpu_lists_each_graphs_kernels(ckpt, tmp_path):
    """On CUDA every graph replayed alone lists the kernels of one replay, and the report shows
    what the verify graph runs beyond the decode graph of its batch."""
    args = _args(ckpt, tmp_path, "--num-speculative-tokens", "0,2", "--temperature", "0")
    args[args.index("--device") + 1] = "cuda"
    assert main(args) == 0
    (path,) = tmp_path.glob("profile-*.json")
    plain, spec = json.loads(path.read_text())["engines"]
    for e in (plain, spec):
        assert e["graphs_alone"] and all(r["kernels"] > 0 and r["by_kernel"] for r in e["graphs_alone"])
        for r in e["graphs_alone"]:
            assert sum(n for n, _ in r["by_kernel"].values()) == pytest.approx(r["kernels"])
    assert {r["kind"] for r in spec["graphs_alone"]} >= {"verify", "draft"}
    assert "runs beyond `('decode', 1," in path.with_suffix(".md").read_text()  # the plain engine's graph
