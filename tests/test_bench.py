"""`megactx bench kernels`: FLOP counting, the synthetic top-k, row sampling and extrapolation, the
derived group figures and targets, the report writers, the command line, and one run of the whole
harness on tiny shapes (Triton interpreter on a CPU, compiled kernels on a GPU)."""

import json

import pytest
import torch

from benchmarks.common import (
    EXTRAPOLATED,
    MEASURED,
    SAMPLED,
    SAMPLED_REPS,
    Ceilings,
    Measurement,
    Timing,
    device_slug,
    extrapolate,
    machine_info,
    systematic_pick,
    time_row_chunks,
)
from benchmarks.inputs import LOCAL_FRACTION, NEIGHBOURS, realistic_topk
from benchmarks.kernels import Geometry, causal_pairs, sparse_keys
from benchmarks.kernels_report import (
    DECODE_COPY_FRACTION,
    DECODE_TFLOPS,
    evaluate_targets,
    layer_groups,
    write_reports,
)
from megactx.cli import main
from megactx.config import ModelConfig
from megactx.kernels.reference import mla_fp8_bytes

K_ = 1024


@pytest.fixture(scope="module")
def glm() -> Geometry:
    return Geometry.from_config(ModelConfig.from_pretrained("glm-5.2"))


# ------------------------------------------------------------------------------ counting
@pytest.mark.parametrize("start,end,k", [(0, 1, 4), (0, 37, 8), (5, 37, 8), (9, 30, 8), (3, 6, 8), (40, 41, 8)])
def test_pair_and_key_counts_match_a_brute_force_count(start, end, k):
    rows = range(start, end)
    assert causal_pairs(start, end) == sum(t + 1 for t in rows)
    assert sparse_keys(start, end, k) == sum(min(t + 1, k) for t in rows)


def test_geometry_is_read_from_the_glm_5_2_config(glm):
    assert (glm.heads, glm.kv_lora_rank, glm.rope_dim, glm.qk_head_dim, glm.v_head_dim) == (64, 512, 64, 256, 256)
    assert (glm.index_heads, glm.index_dim, glm.topk) == (32, 128, 2048)
    assert glm.group_layers == 4  # 1 full + 3 shared
    assert glm.kv_row_bytes(fp8=False) == 1152 and glm.kv_row_bytes(fp8=True) == mla_fp8_bytes(512, 64) == 656
    assert glm.index_row_bytes == 132


@pytest.mark.parametrize("figure,seconds,tflops", [
    # FACTS.md, one H200, GLM-5.2 geometry, 8K: dense SDPA 3.2 ms at 697 TFLOP/s, plain indexer +
    # top-k 13.9 ms at 20 TFLOP/s: our accounting gives the rates that were published with the times
    ("sdpa", 3.2e-3, 697), ("indexer", 13.9e-3, 20),
])
def test_flop_accounting_agrees_with_the_reference_measurements(glm, figure, seconds, tflops):
    pairs = causal_pairs(0, 8 * K_)
    flops = glm.sdpa_flops(pairs) if figure == "sdpa" else glm.indexer_flops(pairs)
    assert flops / seconds / 1e12 == pytest.approx(tflops, rel=0.05)


# ------------------------------------------------------------------------------ inputs
def test_realistic_topk_rows_are_causal_distinct_and_overlap_their_neighbours():
    k, gen = 64, torch.Generator().manual_seed(0)
    positions = torch.arange(0, 700)
    top = realistic_topk(positions, k, NEIGHBOURS, gen)
    valid = top >= 0
    assert torch.equal(valid.sum(1), (positions + 1).clamp_max(k))  # min(t + 1, k) keys a row
    assert bool((top <= positions[:, None]).all())  # causal
    for row in top:
        kept = row[row >= 0]
        assert kept.unique().numel() == kept.numel()  # distinct
    t = 640  # a group start: rows t .. t + NEIGHBOURS - 1 share their far picks
    same = set(top[t].tolist()) & set(top[t + 1].tolist())
    assert len(same) >= k - k // LOCAL_FRACTION
    assert t in top[t].tolist() and t - 1 in top[t].tolist()  # the local window
    far = top[t, : k - k // LOCAL_FRACTION]
    assert int(far.min()) < t // 4 and int(far.max()) > t // 2  # spread over the past


# ------------------------------------------------------------------------------ sampling
def test_systematic_pick_spreads_distinct_indices():
    assert systematic_pick(8, 8) == list(range(8))
    picks = systematic_pick(100, 7)
    assert len(set(picks)) == 7 and picks[0] < 100 / 7 and picks[-1] >= 100 - 100 / 7
    with pytest.raises(ValueError, match="cannot pick"):
        systematic_pick(3, 4)


class _ModelClock:
    """A clock whose 'runs' return their modelled duration: work / rate."""

    warmup = 0

    def time(self, fn, *, budget_s, min_reps=1, max_reps=100):
        seconds = fn()
        return Timing(seconds, [seconds])


def test_sampled_chunks_scale_to_the_whole_prefill_by_the_flop_ratio():
    rate, L, chunk = 1e6, 4096, 64
    chunks = [(s, s + chunk) for s in range(0, L, chunk)]
    flops_of = causal_pairs  # any exact per-chunk cost

    def prepare(picked):
        return lambda: sum(flops_of(s, e) for s, e in picked) / rate

    whole = causal_pairs(0, L) / rate  # 8.4 s if run whole
    budget = 4.0  # one warm-up + SAMPLED_REPS runs of the sample: about 1 s a run
    timing, sample = time_row_chunks(_ModelClock(), chunks, flops_of, prepare, budget_s=budget, max_rows=L)
    assert not sample.full and 1 < len(sample.picked) < len(chunks)
    assert timing.median_s <= budget / (1 + SAMPLED_REPS) * 1.2  # the sample fits the budget
    assert timing.median_s * sample.scale == pytest.approx(whole)
    starts = [s for s, _ in sample.picked]
    assert starts[0] < L / 4 and starts[-1] > 3 * L / 4  # taken from the whole sequence

    timing, sample = time_row_chunks(_ModelClock(), chunks, flops_of, prepare, budget_s=100.0, max_rows=L)
    assert sample.full and timing.median_s == pytest.approx(whole)


def test_extrapolation_keeps_the_rate_quadratic_for_causal_prefill(glm):
    base = Measurement("sdpa.prefill", 8 * K_, 3.2e-3, glm.sdpa_flops(causal_pairs(0, 8 * K_)), None, MEASURED,
                       "bf16_mm")
    far = extrapolate(base, 32 * K_, glm.sdpa_flops(causal_pairs(0, 32 * K_)), reason="too long")
    assert far.method == EXTRAPOLATED and far.detail["from_context"] == 8 * K_
    assert far.tflops == pytest.approx(base.tflops)
    assert far.time_s == pytest.approx(16 * base.time_s, rel=1e-3)  # 4x the context, 16x the time


# ------------------------------------------------------------------------------ derived figures
def _results(glm, contexts):
    """Fake results of a run: a sparse group that gains on dense quadratically and on every-layer
    indexers as the indexer's share grows."""
    ceilings = Ceilings(800.0, 1400.0, 4000.0, {"matmul_n": 8192, "copy_bytes": 1 << 31})
    ms = []
    for i, L in enumerate(contexts):
        pairs = causal_pairs(0, L)
        idx_t = pairs * 4e-12  # the indexer grows quadratically
        ms += [
            Measurement("indexer.logits", L, idx_t, glm.indexer_flops(pairs), None, SAMPLED, "fp8_mm"),
            Measurement("indexer.logits+topk", L, 1.2 * idx_t, glm.indexer_flops(pairs), None, SAMPLED, "fp8_mm"),
            Measurement("sparse_mla.prefill.bf16", L, L * 1e-6, glm.sparse_flops(sparse_keys(0, L, glm.topk)),
                        None, MEASURED, "bf16_mm"),
            Measurement("plain.indexer+topk", L, 50 * idx_t, glm.indexer_flops(pairs), None, SAMPLED, "bf16_mm"),
            Measurement("plain.sparse.prefill", L, L * 5e-6, 1.0, None, SAMPLED, "bf16_mm"),
            Measurement("sdpa.prefill", L, pairs * 3e-10, glm.sdpa_flops(pairs), None,
                        MEASURED if i == 0 else EXTRAPOLATED, "bf16_mm",
                        {} if i == 0 else {"from_context": contexts[0]}),
        ]
        keys = 64 * glm.topk
        # bf16 decode: memory-bound at 75% of copy; FP8 decode: compute-bound at 150 TFLOP/s
        bf16_bytes, fp8_flops = keys * glm.kv_row_bytes(False), glm.sparse_flops(keys)
        ms += [Measurement("sparse_mla.decode.bf16", L, bf16_bytes / (0.75 * 4000e9), glm.sparse_flops(keys),
                           bf16_bytes, MEASURED, "bf16_mm"),
               Measurement("sparse_mla.decode.fp8", L, fp8_flops / 150e12, fp8_flops, keys * glm.kv_row_bytes(True),
                           MEASURED, "bf16_mm")]
    return {"schema": "megactx-bench-kernels/1",
            "machine": {"device": "cuda", "gpu": "Fake GPU 1", "date": "2026-01-01T00:00:00+00:00",
                        "torch": "2.11", "triton": "3.6", "cuda": "13.0"},
            "settings": {"contexts": contexts, "model": "glm-5.2", "budget_s": 2.0, "batch": 64},
            "geometry": glm.to_dict(), "ceilings": ceilings.to_dict(),
            "measurements": [m.to_dict() for m in ms], "skipped": []}


def test_layer_group_is_one_indexer_and_four_sparse_attentions(glm):
    results = _results(glm, [128 * K_, 1024 * K_])
    groups = layer_groups(results)
    by = {(m["name"], m["context"]): m["time_s"] for m in results["measurements"]}
    for g in groups:
        L = g["context"]
        idx, sp = by["indexer.logits+topk", L], by["sparse_mla.prefill.bf16", L]
        assert g["group_s"] == pytest.approx(idx + 4 * sp)
        assert g["every_layer_s"] == pytest.approx(4 * (idx + sp))
        assert g["dense_s"] == pytest.approx(4 * by["sdpa.prefill", L])
        assert g["method"] == SAMPLED  # the indexer was sampled
    assert groups[0]["dense_method"] == MEASURED and groups[1]["dense_method"] == EXTRAPOLATED


def test_targets_apply_the_bound_that_limits_each_decode(glm):
    results = _results(glm, [128 * K_, 1024 * K_])
    targets = evaluate_targets(results, layer_groups(results))
    decode = [t for t in targets if t["target"].startswith("sparse decode")]
    bf16 = [t for t in decode if "bf16" in t["target"]]
    fp8 = [t for t in decode if "fp8" in t["target"]]
    # bf16: 1152 B a key at 121 FLOP/B is below the 200 FLOP/B ridge: memory-bound, 75% >= 70% of copy
    assert all("memory-bound" in t["needs"] and t["passed"] for t in bf16)
    assert f"{DECODE_COPY_FRACTION * 4000:.0f} GB/s" in bf16[0]["needs"]
    # FP8: 656 B a key, 212 FLOP/B: compute-bound, 150 < 200 TFLOP/s
    assert all("compute-bound" in t["needs"] and t["passed"] is False for t in fp8)
    assert f"{DECODE_TFLOPS:.0f} TFLOP/s" in fp8[0]["needs"]
    topk = [t for t in targets if "within" in t["target"]]
    assert [t["passed"] for t in topk] == [True, True]  # 1.2x <= 1.5x
    grows = [t for t in targets if t["target"].startswith("ratio")]
    assert len(grows) == 2 and all(t["passed"] for t in grows)


def test_failed_group_targets_say_what_bounds_them(glm):
    # A missed group target carries its bound by FLOPs against the run's ceilings: with I and S the
    # indexer's and one sparse MLA's times at their ceilings, every-layer / group at equal efficiency
    # is 4 (I + S) / (I + 4 S); dense / group needs the group at R x dense's efficiency x its share.
    results = _results(glm, [128 * K_])
    for m in results["measurements"]:
        if m["name"] == "sdpa.prefill":
            m["time_s"] /= 20  # a dense SDPA fast enough that the fake group misses 10x too
    (g,) = layer_groups(results)
    every, dense = [t for t in evaluate_targets(results, [g]) if t["target"].startswith("layer group")]
    assert "every layer" in every["target"] and "dense" in dense["target"]
    assert every["passed"] is False and dense["passed"] is False
    by = {m["name"]: m for m in results["measurements"]}
    i_min = by["indexer.logits"]["flops"] / 1400e12
    s_min = by["sparse_mla.prefill.bf16"]["flops"] / 800e12
    assert f"{i_min / s_min:.2f} at their ceilings" in every["note"]
    assert f"so {4 * (i_min + s_min) / (i_min + 4 * s_min):.2f}x" in every["note"]
    assert "needs the indexer 4x as slow" in every["note"]
    dense_min = 4 * by["sdpa.prefill"]["flops"] / 800e12
    group_min = i_min + 4 * s_min
    dense_eff = dense_min / g["dense_s"]
    assert f"takes {dense_min / group_min:.1f}x the group's time" in dense["note"]
    assert f"group at {100 * 10 * dense_eff * group_min / dense_min:.0f}% of its ceilings" in dense["note"]
    assert f"it runs at {100 * group_min / g['group_s']:.0f}%" in dense["note"]


def test_targets_without_a_long_context_say_so(glm):
    results = _results(glm, [8 * K_])
    targets = evaluate_targets(results, layer_groups(results))
    group = [t for t in targets if t["target"].startswith("layer group")]
    assert group and all(t["passed"] is None and "no context >= 128K" in t["note"] for t in group)


# ------------------------------------------------------------------------------ reports
def test_reports_mark_extrapolated_figures_and_rewrite_from_json(glm, tmp_path):
    results = _results(glm, [32 * K_, 128 * K_])
    paths = write_reports(results, tmp_path)
    names = {p.name for p in paths}
    assert {"kernels-fake-gpu-1.json", "kernels-fake-gpu-1.md"} <= names
    saved = json.loads((tmp_path / "kernels-fake-gpu-1.json").read_text())
    assert saved["groups"] and saved["targets"] and len(saved["measurements"]) == len(results["measurements"])
    md = (tmp_path / "kernels-fake-gpu-1.md").read_text()
    assert "(extrapolated)" in md and "(sampled)" in md and "**FAIL**" in md and "| pass" in md
    assert "## Ceilings" in md and "1,400 TFLOP/s" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "kernels-fake-gpu-1.png").stat().st_size > 0

    again = tmp_path / "again"
    assert main(["bench", "kernels", "--from-json", str(tmp_path / "kernels-fake-gpu-1.json"),
                 "--out", str(again)]) == 0
    assert (again / "kernels-fake-gpu-1.md").read_text() == md


# ------------------------------------------------------------------------------ command line
def test_bench_is_a_command_with_suites(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "kernels", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--contexts" in out and "--quick" in out and "--out" in out
    assert main(["bench"]) == 0 and "kernels" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_a_gpu_the_benchmark_explains_and_fails(capsys):
    assert main(["bench", "kernels", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("argv,needle", [(["--contexts", "8k"], "--contexts"), (["--batch", "0"], "--batch"),
                                         (["--contexts", "x1"], "bad context")])
def test_bad_cpu_arguments_are_refused_by_name(argv, needle, capsys):
    assert main(["bench", "kernels", "--device", "cpu", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_the_read_bound_reads_exactly_the_selected_rows():
    # benchmarks.bounds.read_rows: each program's checksum is the wrapping int32 sum of its rows'
    # words; -1 slots add nothing. Rows of 288 words (GLM's bf16 576) take the head + tail path.
    from benchmarks.bounds import ROWS, read_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randn(50, 576, generator=gen, device=dev).to(torch.bfloat16)
    slots = torch.randint(0, 50, (3, 7), generator=gen, device=dev, dtype=torch.int32)
    slots[1, 2:4] = -1
    got = read_rows(rows, slots)
    words = rows.view(torch.int32).long()  # [50, 288]
    flat = slots.flatten().long()
    per_row = torch.where(flat >= 0, words[flat.clamp_min(0)].sum(1), 0)
    per_row = torch.nn.functional.pad(per_row, (0, got.numel() * ROWS - flat.numel()))
    want = per_row.view(-1, ROWS).sum(1)
    wrapped = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert torch.equal(got, wrapped)
    with pytest.raises(ValueError, match="int32"):
        read_rows(rows, slots.long())


# ------------------------------------------------------------------------------ whole runs
def _check_run(out_dir, device_slug, contexts, fp8):
    results = json.loads((out_dir / f"kernels-{device_slug}.json").read_text())
    got = {(m["name"], m["context"]) for m in results["measurements"]}
    names = ["write_kv.bf16", "write_kv.bf16.keys", "indexer.logits", "indexer.logits+topk", "indexer.decode.logits",
             "indexer.decode.logits+topk", "sparse_mla.prefill.bf16", "sparse_mla.decode.bf16",
             "plain.indexer+topk", "plain.sparse.prefill", "plain.indexer.decode+topk", "plain.sparse.decode",
             "sdpa.prefill", "bound.read.decode"]
    if fp8:
        names += ["write_kv.fp8", "sparse_mla.prefill.fp8", "sparse_mla.decode.fp8"]
    assert {(n, L) for n in names for L in contexts} <= got
    assert all(m["time_s"] > 0 for m in results["measurements"])
    assert results["ceilings"]["bf16_mm"] > 0 and results["ceilings"]["copy"] > 0
    assert [g["context"] for g in results["groups"]] == contexts
    # the sparse MLA figures say which kernel ran them, and the report says it too
    ran = {m["detail"].get("kernel") for m in results["measurements"] if m["name"].startswith("sparse_mla.")}
    assert ran and ran <= {"triton", "sm90", "sm90ws"}
    assert all(f"`{k}`" in (out_dir / f"kernels-{device_slug}.md").read_text() for k in ran)
    return results


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's smoke test")
def test_the_whole_harness_runs_on_a_cpu_under_the_interpreter(tmp_path):
    # tiny's latent is 64 wide; 128 gives the FP8 cache layout (a scale per 128 values) too
    ModelConfig.from_pretrained("tiny").replace(kv_lora_rank=128).save(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["bench", "kernels", "--device", "cpu", "--model", str(tmp_path / "model"), "--contexts", "64",
                 "--batch", "2", "--out", str(out)]) == 0
    results = _check_run(out, "cpu", [64], fp8=True)
    assert any(m["method"] == SAMPLED for m in results["measurements"])
    assert {m["detail"]["kernel"] for m in results["measurements"] if m["name"].startswith("sparse_mla.")} == {"triton"}


@pytest.mark.gpu
def test_the_whole_harness_runs_on_a_gpu(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "kernels", "--contexts", "4k", "--budget", "0.05", "--out", str(out)]) == 0
    results = _check_run(out, device_slug(machine_info("cuda")), [4096], fp8=True)
    assert results["ceilings"]["fp8_mm"] > results["ceilings"]["bf16_mm"]
