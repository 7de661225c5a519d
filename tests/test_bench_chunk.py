"""`megactx bench chunk`: a CPU run under the Triton interpreter on a small chunk (the engine's call,
the buffers its budget gives, the floor's bytes and FLOPs, reports written and rendered again from
their JSON) and bad arguments refused. Timings are not checked: this is a benchmark's plumbing."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.chunk import chunk_inputs, floor_figures, parse_contexts, parse_size
from megactx.cli import main
from megactx.kernels import reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sizes_and_contexts_parse_or_are_refused():
    assert parse_size("256M") == 256 << 20 and parse_size("1G") == 1 << 30 and parse_size("4KiB") == 4096
    assert parse_contexts("128k,1m,300") == [128 << 10, 1 << 20, 300]
    for bad in ("0", "M", "1.5G", "-4K"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="contexts"):
        parse_contexts("128k,,1m")


def test_inputs_are_the_last_chunk_of_a_causal_prefill_and_the_floor_counts_its_pairs():
    gen = torch.Generator().manual_seed(0)
    args = chunk_inputs(200, 8, 4, 16, torch.device("cpu"), gen)
    assert args["key_len"].tolist() == list(range(193, 201)) and args["key_len_host"].device.type == "cpu"
    assert args["q"].dtype == torch.float8_e4m3fn and tuple(args["q"].shape) == (8, 4, 16)
    # the random keys decode to finite values the twin scores
    logits = reference.indexer_logits(args["q"], args["w"], args["index_cache"], args["block_table"],
                                      args["seq_idx"], args["key_len"], 200)
    assert torch.isfinite(logits[:, :193]).all() and torch.isinf(logits[0, 193:]).all()
    floor = floor_figures(200, 8, 4, 16, 3, torch.device("cpu"), None)
    assert floor["pairs"] == sum(range(193, 201)) and floor["flops"] == 2 * 4 * 16 * floor["pairs"]
    assert floor["floor_ms"] is None  # no ceilings measured (a CPU run)


def test_a_cpu_run_writes_its_reports(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "chunk", "--device", "cpu", "--contexts", "128", "--budgets", "1K,4K", "--rows", "8",
                 "--heads", "4", "--head-dim", "16", "--k", "4", "--reps", "1", "--out", str(out)]) == 0
    results = json.loads((out / "chunk-cpu.json").read_text())
    cases = results["cases"]
    assert [(c["budget"], c["chunk_rows"], c["chunks"]) for c in cases] == [(1024, 2, 4), (4096, 8, 1)]
    assert all(c["wall_ms"] > 0 for c in cases)
    md = (out / "chunk-cpu.md").read_text()
    assert "| 128 | 1 KiB | 2 | 4 |" in md
    if importlib.util.find_spec("matplotlib"):
        assert (out / "chunk-cpu.png").is_file()
    (out / "chunk-cpu.md").unlink()
    assert main(["bench", "chunk", "--from-json", str(out / "chunk-cpu.json"), "--out", str(out)]) == 0
    assert (out / "chunk-cpu.md").read_text() == md


def test_bad_arguments_are_refused(tmp_path, capsys):
    assert main(["bench", "chunk", "--device", "cpu", "--contexts", "64", "--rows", "128",
                 "--out", str(tmp_path)]) == 2
    assert "--rows 128 is more than the context 64" in capsys.readouterr().err
    assert main(["bench", "chunk", "--device", "cpu", "--k", "0", "--out", str(tmp_path)]) == 2
    assert "--k must be at least 1" in capsys.readouterr().err
