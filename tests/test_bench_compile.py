"""`megactx bench compile`: the launches recorded under the interpreter are the JIT's, and compiling
them for sm_90 on a CPU catches what the interpreter lets through."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import compile as bc
from megactx.config import ModelConfig
from megactx.kernels.common import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="records launches of the Triton interpreter (CPU runs)")
needs_compile_api = pytest.mark.skipif(bool(bc.compile_api_missing()),
                                       reason=f"this Triton lacks {bc.compile_api_missing()} (benchmarks/compile.py)")

BAD_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def good(out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, i * 2, mask=i < n)


@triton.jit
def bad(out_ptr, n):
    acc = 0
    for _ in range(n):
        acc = acc + 0.5  # a loop-carried int32 that becomes fp32: Python's rules, not Triton's
    tl.store(out_ptr, acc)
'''


def test_stand_ins_keep_the_specialization():
    assert [bc._stand_in(v) for v in (1, 0, 32, 48, 7, -1)] == [1, 16, 16, 16, 17, 17]
    assert bc._stand_in(1 << 33) == 16 + (1 << 32) and bc._stand_in((1 << 33) + 3) == 17 + (1 << 32)


def test_programs_per_sm_follow_registers_warps_and_shared_memory():
    def programs(registers, warps, shared_kib, arch=90):
        return bc.Compiled("k", "", registers, 0, shared_kib * 1024, None, warps).programs_per_sm(arch)

    assert programs(172, 8, 16) == 1 and programs(128, 8, 16) == 2  # 5,632 / 4,096 registers a warp
    assert programs(40, 4, 4) == 12 and programs(20, 4, 0) == 16  # registers, then warps (64 a multiprocessor)
    assert programs(255, 8, 216.8) == 1 and programs(64, 4, 100) == 2  # shared memory (228 KiB, 1 KiB a block)
    assert programs(64, 4, 100, arch=86) == 0  # more than sm_86's 100 KiB a multiprocessor
    assert bc.Compiled("k", "", error="x").programs_per_sm(90) is None


def test_launches_take_the_gpus_choices():
    dot = bc.Launch("megactx.kernels.sparse_mla:_sparse_mla_fwd",
                    {"q_ptr": {"tensor": "bfloat16", "aligned": True}, "DOT_F32": True})
    assert bc.as_on_gpu(dot).args["DOT_F32"] is False
    fp32 = bc.Launch(dot.kernel, {"q_ptr": {"tensor": "float32", "aligned": True}, "DOT_F32": True})
    assert bc.as_on_gpu(fp32).args["DOT_F32"] is True
    assert bc.as_on_gpu(bc.Launch("megactx.kernels.topk:_select_kernel", {"TILE_PIVOTS": 64})).args["TILE_PIVOTS"] == 1


@needs_interpreter
@needs_compile_api
def test_a_kernel_the_interpreter_runs_but_the_compiler_refuses_is_reported(tmp_path, monkeypatch):
    (tmp_path / "bad_kernels.py").write_text(BAD_KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the compile step's process
    import bad_kernels

    out = torch.zeros(8)
    with bc.recording() as recorder:
        bad_kernels.good[(1,)](out, 5, BLOCK=8)
        bad_kernels.good[(1,)](out, 6, BLOCK=8)  # the same specialization: one launch
        bad_kernels.good[(1,)](out[1:], 32, BLOCK=8)  # unaligned, n divisible by 16: another
        bad_kernels.bad[(1,)](out, 3)
    assert out[0] == 1.5  # the interpreter ran it
    launches = list(recorder.launches.values())
    assert [x.kernel for x in launches] == ["bad_kernels:good"] * 2 + ["bad_kernels:bad"]
    assert launches[1].args == {"out_ptr": {"tensor": "float32", "aligned": False}, "n": 16, "BLOCK": 8}

    rows, _ = bc.compile_all(launches, 90, sys.executable)
    assert [r.error is None for r in rows] == [True, True, False]
    assert rows[2].error.startswith("CompilationError") and "Loop-carried variable acc" in rows[2].error
    assert rows[0].registers and rows[0].shared_bytes is not None
    assert bc.problems(rows, 90) == [f"bad []: {rows[2].error}"]


@needs_interpreter
@needs_compile_api
@pytest.mark.slow
def test_every_engine_launch_compiles_for_sm90(tmp_path):
    # tiny's geometry with a 128-wide latent (the FP8 KV layout too): the engine's launches (prefill
    # chunks, MTP drafts, verify) and the direct calls, each compiled as a GPU run would make it.
    ModelConfig.from_pretrained("tiny").replace(kv_lora_rank=128).save(tmp_path / "model")
    launches = bc.record(str(tmp_path / "model"), prompt_tokens=16, gamma=2, log=lambda _: None)
    rows, _ = bc.compile_all(launches, 90, sys.executable)
    assert bc.problems(rows, 90) == []
    kernels = {r.kernel for r in rows}
    assert {"_rope_kernel", "_write_kv_kernel", "_index_queries_kernel", "_indexer_logits_kernel",
            "_topk_fused_kernel", "_group_max_kernel", "_threshold_kernel", "_collect_kernel", "_select_kernel",
            "_sparse_mla_fwd", "_route_kernel", "_race_kernel", "_emit_kernel", "_row_random_kernel",
            "_one_row_kernel", "_norm_rows_kernel", "_linear_rows_kernel", "_swiglu_weighted_kernel"} <= kernels
    fp8 = [x for x in launches if x.kernel.endswith(":_write_kv_kernel") and x.args["FP8"]]
    assert fp8, "no launch wrote the FP8 KV cache"


def test_bad_inputs_are_refused_with_a_message(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    bc.add_arguments(parser)
    assert bc.run(parser.parse_args(["--launches", str(tmp_path / "none.json")])) == 2
    assert "not the JSON of an earlier run" in capsys.readouterr().err
    saved = tmp_path / "saved.json"
    saved.write_text('{"model": "m", "kv_cache_dtypes": ["bf16"], "triton_record": "3.9.0", "launches": []}')
    args = ["--launches", str(saved), "--python", str(tmp_path / "no-python"), "--out", str(tmp_path)]
    assert bc.run(parser.parse_args(args)) == 2
    assert "no-python" in capsys.readouterr().err
    assert bc.run(parser.parse_args(["--model", str(tmp_path / "no-model")])) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err
