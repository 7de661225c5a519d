"""The paged forward (model/paged.py) against the dense reference.

Both kernel backends ("torch" = the twins, "triton" = the kernels, in the interpreter on a CPU)
run the whole model over paged caches: one-shot prompts against transformers on every parity
config, then chunked prefill and token-by-token decode of several sequences sharing one batch,
over shuffled physical blocks, with exact and FP8 caches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hf_models import CASES, hf_model
from megactx import ModelConfig, load_model
from megactx.model import build_model
from megactx.model.paged import (
    PagedBatch,
    PagedLayerCache,
    StagedBuffers,
    alloc_caches,
    copy_from_host_,
    kernel_ops,
    to_device,
    to_device_packed,
)
from megactx.model.quant import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64


# ------------------------------------------------------------------------------ whole prompts
@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_matches_transformers(case, tmp_path):
    """fp32 weights, exact (non-FP8) caches: the Triton path equals transformers and our reference."""
    model_type, overrides = CASES[case]
    theirs = hf_model(model_type, seed=len(case), **overrides)
    theirs.save_pretrained(tmp_path)
    ours = load_model(tmp_path, device=DEVICE, backend="triton")
    torch.manual_seed(1)
    input_ids = torch.randint(0, theirs.config.vocab_size, (2, 20))  # small: the interpreter is slow
    with torch.no_grad():
        want = theirs(input_ids).logits
        got = ours(input_ids.to(DEVICE)).cpu()
        ours.set_backend("torch")
        reference = ours(input_ids.to(DEVICE)).cpu()
    assert (got - want).abs().max().item() <= 1e-3
    assert (got - reference).abs().max().item() <= 1e-3


def test_load_model_refuses_an_unknown_backend(tmp_path):
    theirs = hf_model("glm_moe_dsa")
    theirs.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="backend"):
        load_model(tmp_path, backend="cuda")


# ------------------------------------------------------------------------------ chunks and decode
def _tiny(**overrides):
    # 16 indexer heads: with 4, a key whose ReLU'd dots are all 0 scores exactly 0 often enough
    # that ties at the top-k edge (broken differently for rows of different lengths) show up
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=128, num_hidden_layers=4, index_topk=16,
                                                      index_n_heads=16, **overrides)
    model = build_model(cfg, seed=3, device=DEVICE)
    model.set_attention(absorbed=True)
    return model


def _run_schedule(model, prompts, steps, ops, kv_dtype, index_dtype, seed=0):
    """Run `steps` (each a list of (sequence, tokens to compute)) over shuffled physical blocks, as an
    engine would, and return every sequence's logits [len, vocab] row by row."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-len(p) // BLOCK) for p in prompts]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()  # two spare blocks nobody owns
    tables = [perm[sum(need[:b]) : sum(need[: b + 1])] for b in range(len(prompts))]
    caches = alloc_caches(model.cfg, len(perm), kv_dtype, index_dtype, DEVICE)
    done = [0] * len(prompts)
    logits = [[] for _ in prompts]
    for step in steps:
        seqs = [b for b, _ in step]
        batch = PagedBatch.build([tables[b] for b in seqs], [done[b] for b in seqs], [n for _, n in step], DEVICE)
        ids = torch.cat([torch.as_tensor(prompts[b][done[b] : done[b] + n]) for b, n in step]).to(DEVICE)
        layers = [PagedLayerCache(kv, index, batch, ops) for kv, index in caches[: model.cfg.num_hidden_layers]]
        with torch.no_grad():
            out = model.compute_logits(model.hidden_states(ids[None], batch.positions[None], layers))[0]
        for (b, n), rows in zip(step, out.split([n for _, n in step])):
            logits[b].append(rows)
            done[b] += n
    return [torch.cat(rows) for rows in logits]


# sequence 0: a prompt in chunks across block edges, then decoded token by token while sequence 1
# prefills in pieces beside it; sequence 2 is one token
SCHEDULE = [[(0, 5)], [(0, 60), (1, 3)], [(0, 1), (1, 66)], [(0, 1), (1, 1), (2, 1)], [(1, 1), (0, 3)]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_and_decode_match_the_full_forward(backend):
    model = _tiny()
    lens = [sum(n for step in SCHEDULE for b, n in step if b == seq) for seq in range(3)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (L,), generator=gen).tolist() for L in lens]
    dtype = torch.float32
    got = _run_schedule(model, prompts, SCHEDULE, kernel_ops(backend), dtype, dtype)
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            want = model(torch.tensor([prompt], device=DEVICE))[0]
        assert (logits - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_rows_compute_those_rows_and_write_every_rows_kv(backend):
    """hidden_states(rows=...) gives the hidden states of those rows (or of none) and writes every
    row's KV as the whole forward does; the last layer, full here, runs its indexer over those rows
    alone (a long prompt's chunk samples one row, or none)."""
    model = _tiny(index_topk_pattern="FSSF")
    last = model.cfg.num_hidden_layers - 1
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    batch = PagedBatch.build([[3, 1]], [0], [70], DEVICE)
    ops = kernel_ops(backend)

    def forward(rows):
        """-> (hidden states, caches, rows of the last layer's indexer calls)"""
        caches = alloc_caches(model.cfg, 4, torch.float32, torch.float32, DEVICE)
        seen = []

        def indexer_topk(q, w, index_cache, *args):
            if index_cache is caches[last][1]:
                seen.append(q.shape[0])
            return ops.indexer_topk(q, w, index_cache, *args)

        counting = dataclasses.replace(ops, indexer_topk=indexer_topk)
        layers = [PagedLayerCache(kv, index, batch, counting) for kv, index in caches[: last + 1]]
        with torch.no_grad():
            hidden = model.hidden_states(ids, batch.positions[None], layers,
                                         None if rows is None else batch.output_rows(rows))[0]
        return hidden, caches, seen

    full, want_caches, seen = forward(None)
    assert seen == [70]
    for rows in ([69, 40], []) if backend == "torch" else ([69, 40],):  # (no row: no kernel but the KV write)
        hidden, caches, seen = forward(rows)
        assert seen == ([len(rows)] if rows else [])
        assert hidden.shape == (len(rows), model.cfg.hidden_size)
        if rows:
            assert (hidden - full[rows]).abs().max().item() <= 1e-5
        for (kv, index), (want_kv, want_index) in zip(caches, want_caches):
            assert torch.equal(kv, want_kv) and (index is None or torch.equal(index, want_index))


def test_in_place_layers_add_the_residual_in_their_gemms_and_overwrite_x_only_when_told():
    """DecoderLayer(in_place=True) over a paged cache outside autograd computes what the plain form
    does, its two residual adds inside o_proj's and the MLP's down GEMMs (dense MLP and MoE layers
    here), into x itself; without in_place, or under autograd, x is left as it was."""
    model = _tiny()
    batch = PagedBatch.build([[0]], [0], [9], DEVICE)
    positions = batch.positions[None]
    x0 = torch.randn(1, 9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cos, sin = model.rotary(positions, x0.dtype)

    def run(in_place: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """all layers one after another -> (output, each layer's input after its call)"""
        caches = alloc_caches(model.cfg, 1, torch.float32, torch.float32, DEVICE)
        x, inputs, topk_of = x0.clone(), [], {}
        for i, layer in enumerate(model.model.layers):
            src = model.cfg.topk_source(i)
            cache = PagedLayerCache(*caches[i], batch, kernel_ops("torch"))
            inputs.append(x)
            x, topk_of[src] = layer(x, cos, sin, positions, topk_of.get(src), cache, in_place=in_place)
        return x, inputs

    assert [model.cfg.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    with torch.no_grad():
        want, inputs = run(False)
        assert all(torch.equal(x, x0) for x in inputs[:1])  # the caller's x untouched
        got, inputs_in_place = run(True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(x.data_ptr() == got.data_ptr() for x in inputs_in_place)  # one residual buffer, updated
    with torch.enable_grad():  # autograd: the plain form, in_place or not
        x = x0.clone()
        caches = alloc_caches(model.cfg, 1, torch.float32, torch.float32, DEVICE)
        model.model.layers[0](x, cos, sin, positions, None, PagedLayerCache(*caches[0], batch, kernel_ops("torch")),
                              in_place=True)
        assert torch.equal(x, x0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_indexer_cache_matches_the_simulated_fp8_indexer(backend):
    """An FP8 indexer cache selects what the reference's FP8 simulation selects (same rotation,
    same per-row scales), so logits agree as closely as with exact caches; with the Triton kernels
    too (the queries' rope, rotation and quantization in one kernel, the keys' in the KV write)."""
    model = _tiny()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (L,), generator=gen).tolist() for L in (70, 9)]
    steps = [[(0, 40), (1, 9)], [(0, 30)]]
    got = _run_schedule(model, prompts, steps, kernel_ops(backend), torch.float32, torch.uint8)
    model.set_attention(indexer_fp8=True)
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            want = model(torch.tensor([prompt], device=DEVICE))[0]
        assert (logits - want).abs().max().item() <= 1e-4


def test_fp8_mla_cache_equals_the_reference_on_rounded_latents():
    """With an FP8 MLA cache the model computes what the reference computes when its latent is
    rounded to e4m3 per 128 values and its rope key to bf16 (the cache's layout), nothing else."""
    model = _tiny(kv_lora_rank=128)  # the FP8 MLA layout groups the latent by 128
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (80,), generator=gen).tolist()
    got = _run_schedule(model, [prompt], [[(0, 50)], [(0, 30)]], kernel_ops("torch"), torch.uint8, torch.float32)[0]

    def rounded(project_kv):
        def project(x, cos, sin):
            c, k_pe = project_kv(x, cos, sin)
            values, scales = quantize_rows(c.unflatten(-1, (-1, 128)))
            return (values.float() * scales[..., None]).flatten(-2), k_pe.bfloat16().float()
        return project

    with torch.no_grad():
        exact = model(torch.tensor([prompt], device=DEVICE))[0]
        for attn in model.attention_modules():
            attn.project_kv = rounded(attn.project_kv)
        want = model(torch.tensor([prompt], device=DEVICE))[0]
    # 2e-3, not 1e-5: a latent an ulp from an e4m3 rounding edge may round the other way when a
    # chunk's matmul sums in another order, or the residual stream was summed in another (the paged
    # path adds it inside the GEMMs: 1.2e-3 here); without the rounding the gap is 25x larger
    assert (got - want).abs().max().item() <= 2e-3
    assert (got - exact).abs().max().item() > 5e-2


def test_paged_batch_refuses_positions_beyond_its_blocks():
    with pytest.raises(ValueError, match="need 2 blocks"):
        PagedBatch.build([[0]], [60], [10])
    with pytest.raises(ValueError, match="one entry per sequence"):
        PagedBatch.build([[0], [1]], [0], [1, 1])


def test_paged_forward_needs_positions():
    model = _tiny()
    batch = PagedBatch.build([[0]], [0], [3], DEVICE)
    caches = alloc_caches(model.cfg, 1, torch.float32, torch.float32, DEVICE)
    layers = [PagedLayerCache(kv, index, batch, kernel_ops("torch")) for kv, index in caches[:4]]
    with pytest.raises(ValueError, match="positions"):
        model.hidden_states(torch.zeros(1, 3, dtype=torch.long, device=DEVICE), caches=layers)


# ------------------------------------------------------------------------------ GPU, bf16
@pytest.mark.gpu
def test_triton_backend_bf16_within_the_error_rule():
    """bf16 weights and caches: the Triton path's error against the fp32 reference is at most twice
    the error of the torch reference run in bf16 (plus a small atol), the DESIGN.md rule."""
    cfg = ModelConfig.from_pretrained("tiny").replace(index_topk=64)
    fp32 = build_model(cfg, seed=4, device="cuda")
    bf16 = build_model(cfg, seed=4, device="cuda", dtype=torch.bfloat16)
    for m in (fp32, bf16):
        m.set_attention(absorbed=True)
    input_ids = torch.randint(0, cfg.vocab_size, (4, 300), device="cuda")
    with torch.no_grad():
        want = fp32(input_ids)
        torch_err = (bf16(input_ids) - want).abs().max().item()
        bf16.set_backend("triton", kv_cache_dtype="bf16", index_cache_dtype="bf16")
        triton_err = (bf16(input_ids) - want).abs().max().item()
    assert triton_err <= 2 * torch_err + 1e-2, (triton_err, torch_err)


def test_host_copies_land_intact():
    t = torch.arange(1000)
    assert torch.equal(to_device(t, "cpu"), t)
    dst = torch.zeros(1000, dtype=torch.long)
    assert torch.equal(copy_from_host_(dst, t), t)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_host_arrays_land_intact(device):
    """One copy of arrays of mixed dtypes and shapes (empty ones too) gives each back as it was."""
    arrays = [np.arange(5, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros(0, np.int64),
              np.array([[0.5, -1.0]], dtype=np.float32), np.array([-1, 2**40], dtype=np.int64)]
    got = to_device_packed(arrays, device)
    assert [t.dtype for t in got] == [torch.int64, torch.int32, torch.int64, torch.float32, torch.int64]
    assert all(t.device.type == device and t.tolist() == a.tolist() for t, a in zip(got, arrays))


def test_staged_buffers_send_what_the_host_twin_holds():
    buffers = StagedBuffers({"a": ((2, 3), torch.long), "b": ((5,), torch.int32)}, "cpu")
    host = buffers.host()
    host["a"][:] = [[1, 2, 3], [4, 5, 6]]
    host["b"][1:3] = -7
    buffers.send()
    assert buffers.device["a"].tolist() == [[1, 2, 3], [4, 5, 6]] and buffers.device["b"].tolist() == [0, -7, -7, 0, 0]
    assert buffers.device["b"].dtype == torch.int32
    buffers.host()["b"][0] = 9  # the device keeps what was sent until the next send
    assert buffers.device["b"].tolist() == [0, -7, -7, 0, 0]


@pytest.mark.gpu
def test_staged_buffers_are_not_overwritten_before_their_copy_runs():
    """send() queues the copy without waiting; host() waits for it before the twin may change."""
    buffers = StagedBuffers({"x": ((1000,), torch.long)}, "cuda")
    buffers.host()["x"][:] = 1
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a kernel that spins for a few hundred ms
    buffers.send()  # queued behind the spin
    assert not torch.cuda.current_stream().query()  # send() did not wait for it
    buffers.host()["x"][:] = 2  # waits for the copy
    assert buffers.device["x"].tolist() == [1] * 1000


@pytest.mark.gpu
def test_host_copies_do_not_wait_for_queued_kernels():
    """The engine's host-to-device copies are staged in pinned memory: the host goes on while the
    GPU still runs earlier work (a pageable copy first waits for the stream to drain)."""
    src = torch.arange(1000)
    dst = torch.zeros(1000, dtype=torch.long, device="cuda")
    to_device(src, "cuda")  # warm the pinned-memory cache: allocating pinned memory may sync
    copy_from_host_(dst, src)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a kernel that spins for a few hundred ms
    out = to_device(src, "cuda")
    dst = copy_from_host_(dst.zero_(), src)
    assert not torch.cuda.current_stream().query()  # the spin is still running: nothing waited for it
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src) and torch.equal(dst.cpu(), src)
    torch.cuda._sleep(500_000_000)
    src.to("cuda")  # what to_device replaces
    assert torch.cuda.current_stream().query()  # it waited for the spin
