"""The fused KV-write kernel against its twin `reference.write_kv`: same bytes in both caches
(the twin always runs on the CPU, where its division is IEEE like the kernel's).

On a CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest), so shapes stay small there;
the `gpu` tests repeat the checks on CUDA at serving sizes and under CUDA-graph capture."""

from __future__ import annotations

import copy

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.kv_write import write_kv
from megactx.model.quant import FP8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GLM = (512, 64, 128)  # kv_lora_rank, qk_rope_head_dim, index_head_dim
GEOMETRIES = [GLM, (256, 32, 64), (128, 32, 64)]


def _inputs(N, geometry, dtype, device, seed=0):
    """c and k_pe as the two slices of one projection output (strided, as the model makes them),
    index_k contiguous; a wide range of magnitudes, a zero token and tiny entries (e4m3 subnormals)."""
    r, dr, DI = geometry
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(N, r + dr, generator=g) * torch.exp(2 * torch.randn(N, 1, generator=g))
    kv[:, :r:5] *= 1e-5
    index_k = torch.randn(N, DI, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    index_k[:, ::7] *= 1e-5
    if N > 3:
        kv[3] = 0
        index_k[3] = 0
    kv, index_k = kv.to(device, dtype), index_k.to(device, dtype)
    c, k_pe = kv.split([r, dr], dim=-1)
    return c, k_pe, index_k


def _slots(N, num_blocks, device, seed=0):
    """N distinct slots shuffled over all blocks, every fifth one -1 (skipped)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * ref.BLOCK_SIZE, generator=g)[:N]
    if N > 1:
        slots[1::5] = -1
    return slots.to(device)


def _check_against_twin(N, geometry, fp8, with_index, dtype, device, num_blocks, slot_dtype=torch.int64):
    r, dr, DI = geometry
    c, k_pe, index_k = _inputs(N, geometry, dtype, device)
    slots = _slots(N, num_blocks, device).to(slot_dtype)
    kv = ref.alloc_kv_cache(num_blocks, r, dr, fp8, device)
    idx = ref.alloc_index_cache(num_blocks, DI, device) if with_index else None
    write_kv(c, k_pe, slots, kv, index_k if with_index else None, idx)

    # The twin runs on the CPU: there its scales are amax / 448 exactly, as in the kernel; on CUDA,
    # PyTorch divides by a Python scalar through its reciprocal, which can move a scale by one ulp.
    c, k_pe, index_k, slots, kv = c.cpu(), k_pe.cpu(), index_k.cpu(), slots.cpu(), kv.cpu()
    kv_twin = ref.alloc_kv_cache(num_blocks, r, dr, fp8)
    idx, idx_twin = (idx.cpu(), ref.alloc_index_cache(num_blocks, DI)) if with_index else (None, None)
    ref.write_kv(c, k_pe, slots, kv_twin, index_k if with_index else None, idx_twin)

    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * ref.BLOCK_SIZE, dtype=torch.bool)
    untouched[written.long()] = False
    untouched = untouched.nonzero()[:, 0]

    # dequantized: equal to the twin's, and within e4m3 / bf16 rounding of the input
    got, want = ref.read_kv(kv, written, r), ref.read_kv(kv_twin, written, r)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = torch.cat([c, k_pe], dim=-1)[slots >= 0].float()
    if fp8:
        group_amax = x[:, :r].abs().unflatten(-1, (r // 128, 128)).amax(-1).repeat_interleave(128, -1)
        # e4m3: half an ulp is 1/16 relative; subnormal steps are 2^-9 of the scale (amax / 448)
        latent_err = (got[:, :r] - x[:, :r]).abs() - (x[:, :r].abs() / 16 + group_amax / 448 * 2**-10)
        assert latent_err.max() <= 1e-30
        torch.testing.assert_close(got[:, r:], x[:, r:], rtol=2**-8, atol=0)
    else:
        torch.testing.assert_close(got, x, rtol=2**-8, atol=0)
    # bytes: identical everywhere, and slots nobody wrote are still zero
    assert torch.equal(kv.view(torch.uint8), kv_twin.view(torch.uint8))
    assert not ref.read_kv(kv, untouched, r).any()

    if with_index:
        (v, s), (v_twin, s_twin) = ref.read_index_k(idx, written, DI), ref.read_index_k(idx_twin, written, DI)
        torch.testing.assert_close(v * s[:, None], v_twin * s_twin[:, None], rtol=0, atol=0)
        k = index_k[slots >= 0].float()
        k_err = (v * s[:, None] - k).abs() - (k.abs() / 16 + k.abs().amax(-1, keepdim=True) / 448 * 2**-10)
        assert k_err.max() <= 1e-30
        assert torch.equal(idx, idx_twin)
        v_untouched, s_untouched = ref.read_index_k(idx, untouched, DI)
        assert not v_untouched.any() and not s_untouched.any()


# ------------------------------------------------------------------------------ small (CPU interpreter too)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "r{}-dr{}-di{}".format(*g))
@pytest.mark.parametrize("with_index", [False, True], ids=["mla-only", "with-index"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_write_kv_matches_twin(fp8, with_index, geometry, dtype):
    _check_against_twin(7, geometry, fp8, with_index, dtype, DEVICE, num_blocks=3)


@pytest.mark.parametrize("N, geometry", [(1, GLM), (1, (128, 32, 64)), (130, GLM), (130, (256, 32, 64))],
                         ids=["1-glm", "1-r128", "130-glm", "130-r256"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_write_kv_matches_twin_token_counts(fp8, N, geometry):
    _check_against_twin(N, geometry, fp8, True, torch.bfloat16, DEVICE, num_blocks=5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_exact_caches_store_the_values(cache_dtype):
    """Exact layouts (an fp32 or bf16 MLA cache, a float indexer cache): each written row holds the
    inputs cast to the cache dtype, the twin writes the same bytes, other slots stay zero."""
    N, num_blocks, (r, dr, DI) = 9, 3, (128, 32, 64)
    c, k_pe, index_k = _inputs(N, (r, dr, DI), torch.float32, DEVICE)
    slots = _slots(N, num_blocks, DEVICE)
    caches = [(ref.alloc_kv_cache(num_blocks, r, dr, False, DEVICE, cache_dtype),
               ref.alloc_index_cache(num_blocks, DI, DEVICE, cache_dtype)) for _ in range(2)]
    write_kv(c, k_pe, slots, *caches[0][:1], index_k, caches[0][1])
    ref.write_kv(c, k_pe, slots, *caches[1][:1], index_k, caches[1][1])
    (kv, idx), (kv_twin, idx_twin) = caches
    assert torch.equal(kv, kv_twin) and torch.equal(idx, idx_twin)
    keep = slots >= 0
    written = slots[keep]
    assert torch.equal(ref.read_kv(kv, written, r), torch.cat([c, k_pe], -1)[keep].to(cache_dtype).float())
    values, scales = ref.read_index_k(idx, written, DI)
    assert torch.equal(values, index_k[keep].to(cache_dtype).float()) and bool((scales == 1).all())
    untouched = torch.ones(num_blocks * ref.BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert not kv.flatten(0, 1)[untouched].any() and not idx.view(-1, DI)[untouched].any()


def test_write_kv_skips_out_of_range_slots_without_a_check():
    """Without check_slots the wrapper does not read slots back: the kernel drops bad ones itself."""
    N, num_blocks, (r, dr, DI) = 6, 2, (128, 32, 64)
    c, k_pe, index_k = _inputs(N, (r, dr, DI), torch.float32, DEVICE)
    slots = torch.tensor([0, num_blocks * ref.BLOCK_SIZE, 5, -7, 10**6, 127], device=DEVICE)
    kv, idx = ref.alloc_kv_cache(num_blocks, r, dr, True, DEVICE), ref.alloc_index_cache(num_blocks, DI, DEVICE)
    write_kv(c, k_pe, slots, kv, index_k, idx)
    keep = torch.tensor([True, False, True, False, False, True], device=DEVICE)
    kv_twin, idx_twin = ref.alloc_kv_cache(num_blocks, r, dr, True), ref.alloc_index_cache(num_blocks, DI)
    ref.write_kv(c[keep].cpu(), k_pe[keep].cpu(), slots[keep].cpu(), kv_twin, index_k[keep].cpu(), idx_twin)
    assert torch.equal(kv.cpu(), kv_twin) and torch.equal(idx.cpu(), idx_twin)


def test_write_kv_takes_fp16_inputs_and_int32_slots():
    _check_against_twin(7, (128, 32, 64), True, True, torch.float16, DEVICE, num_blocks=2, slot_dtype=torch.int32)


# ------------------------------------------------------------------------------ keys made on the way
def _preps(N, geometry, dtype, index_fp8, interleave, seed=0):
    """The paged layer's KeyPreps at random: an RMSNorm of the latent, a LayerNorm of the indexer key
    (weights in the inputs' dtype), cos / sin rows of random angles, the Hadamard rotation for an FP8
    indexer cache; and their fp32 twins (the modules and tables in fp32)."""
    from megactx.model.layers import RMSNorm
    from megactx.model.quant import hadamard

    r, dr, DI = geometry
    g = torch.Generator().manual_seed(seed)
    rms, ln = RMSNorm(r), torch.nn.LayerNorm(DI)
    with torch.no_grad():
        for p in (rms.weight, ln.weight):
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
        ln.bias.copy_(0.2 * torch.randn(DI, generator=g))
    angles = 6.3 * torch.rand(N, dr // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    rotation = hadamard(DI) if index_fp8 else None

    def preps(dt, device):
        norms = [copy.deepcopy(m).to(device, dt) for m in (rms, ln)]
        tables = cos.to(device, dt), sin.to(device, dt)
        return (ref.KeyPrep(norms[0], *tables, interleave),
                ref.KeyPrep(norms[1], *tables, interleave, None if rotation is None else rotation.to(device)))
    return preps(dtype, DEVICE), preps(torch.float32, "cpu")


def _keys_read(kv, idx, written, r, DI):
    """What the caches hold at the written slots, dequantized: [n, r + dr] and [n, DI] fp32 on the CPU."""
    kv, idx, written = kv.cpu(), idx.cpu(), written.cpu()
    values, scales = ref.read_index_k(idx, written, DI)
    return ref.read_kv(kv, written, r), values * scales[:, None]


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp8", [False, True], ids=["exact-caches", "fp8-caches"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[2], GLM], ids=["r128", "glm"])
def test_write_kv_makes_the_keys_from_projections(geometry, fp8, dtype, interleave, monkeypatch):
    """Given the projections and the layer's KeyPreps the kernel normalises, ropes (and, for an FP8
    indexer cache, rotates) in its own program, never through the twin's ops, and stores keys within
    the error rule of the twin doing the same (its ops, then the write), against fp32 keys: exact
    caches of the inputs' dtype, or both caches FP8."""
    _check_preps(9, 3, geometry, fp8, dtype, interleave, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp8", [False, True], ids=["exact-caches", "fp8-caches"])
def test_write_kv_makes_the_keys_from_projections_cuda(fp8, dtype, interleave, monkeypatch):
    _check_preps(130, 5, GLM, fp8, dtype, interleave, monkeypatch)


def _check_preps(N, num_blocks, geometry, fp8, dtype, interleave, monkeypatch):
    import megactx.kernels.kv_write as kv_write

    r, dr, DI = geometry
    c, k_pe, index_k = _inputs(N, geometry, dtype, DEVICE)
    slots = _slots(N, num_blocks, DEVICE)
    (mla, index), (mla32, index32) = _preps(N, geometry, dtype, fp8, interleave)
    cache_dtype = torch.uint8 if fp8 else dtype
    kv = ref.alloc_kv_cache(num_blocks, r, dr, fp8, DEVICE, dtype)
    idx = ref.alloc_index_cache(num_blocks, DI, DEVICE, cache_dtype)
    with monkeypatch.context() as m:
        m.setattr(kv_write, "prepare_keys", lambda *a: pytest.fail("the kernel sent a prep to the twin's ops"))
        write_kv(c, k_pe, slots, kv, index_k, idx, mla_prep=mla, index_prep=index)

    cpu = [t.cpu() for t in (c, k_pe, index_k, slots)]
    kv_twin = ref.alloc_kv_cache(num_blocks, r, dr, fp8, "cpu", dtype)
    idx_twin = ref.alloc_index_cache(num_blocks, DI, "cpu", cache_dtype)
    ref.write_kv(cpu[0], cpu[1], cpu[3], kv_twin, cpu[2], idx_twin,
                 mla_prep=ref.KeyPrep(mla.norm.cpu(), mla.cos.cpu(), mla.sin.cpu(), interleave),
                 index_prep=ref.KeyPrep(index.norm.cpu(), index.cos.cpu(), index.sin.cpu(), interleave,
                                        None if index.rotation is None else index.rotation.cpu()))
    keep = cpu[3] >= 0
    c32, pe32, ik32 = ref.prepare_keys(*(t.float() for t in cpu[:3]), mla32, index32)
    exact = torch.cat([c32, pe32], -1)[keep], ik32[keep]
    got = _keys_read(kv, idx, cpu[3][keep], r, DI)
    twin = _keys_read(kv_twin, idx_twin, cpu[3][keep], r, DI)
    for name, g, t, e in zip(("MLA", "indexer"), got, twin, exact):
        kernel_err, twin_err = (g - e).abs().max().item(), (t - e).abs().max().item()
        assert kernel_err <= 2 * twin_err + 1e-5 * e.abs().max().item(), (name, kernel_err, twin_err)


def test_write_kv_sends_preps_it_does_not_take_to_the_twins_ops():
    """A norm the kernel does not compute (here an Identity) and a rotation over an exact indexer
    cache go through `reference.prepare_keys` first: the same bytes as the twin."""
    N, num_blocks, geometry = 7, 2, GEOMETRIES[2]
    r, dr, DI = geometry
    c, k_pe, index_k = _inputs(N, geometry, torch.float32, DEVICE)
    slots = _slots(N, num_blocks, DEVICE)
    (mla, index), _ = _preps(N, geometry, torch.float32, True, True)
    mla = ref.KeyPrep(torch.nn.Identity(), mla.cos, mla.sin, True)
    caches = [(ref.alloc_kv_cache(num_blocks, r, dr, False, DEVICE, torch.float32),
               ref.alloc_index_cache(num_blocks, DI, DEVICE, torch.float32)) for _ in range(2)]
    write_kv(c, k_pe, slots, caches[0][0], index_k, caches[0][1], mla_prep=mla, index_prep=index)
    ref.write_kv(c, k_pe, slots, caches[1][0], index_k, caches[1][1], mla_prep=mla, index_prep=index)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _rounding_cases():
    """Rows that pin the casts down: every e4m3 value, every midpoint between neighbours (a tie:
    round to even) and the fp32 values either side of it, both signs; each 128-group holds 448 so
    its scale is exactly 1 and these are the values the kernel casts. The rope key gets bf16 ties."""
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(FP8).float()  # 2^-9 .. 448
    mids = (torch.cat([torch.zeros(1), e4m3[:-1]]) + e4m3) / 2
    vals = torch.cat([e4m3, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e3))])
    vals = torch.cat([vals, -vals])
    groups = vals.split(127)
    latent = torch.zeros(len(groups), 128)
    for i, grp in enumerate(groups):
        latent[i, : len(grp)] = grp
        latent[i, 127] = 448.0
    c = latent.view(-1, 512)  # N = groups / 4 rows of r = 512
    N = c.shape[0]
    bf16 = torch.randn(N, 64).bfloat16()
    ulp = (bf16.float().abs() * 2**-7).log2().floor().exp2()  # bf16 ulp at each value (8-bit mantissa)
    k_pe = bf16.float() + ulp.copysign(bf16.float()) / 2  # exact ties: half go down to even, half up
    return c, k_pe


def _check_rounding(device):
    c, k_pe = _rounding_cases()
    index_k = c[:, :128].contiguous()  # 448 in each key too: scale 1
    slots = torch.arange(c.shape[0])
    for fp8 in (True, False):
        kv, idx = ref.alloc_kv_cache(1, 512, 64, fp8, device), ref.alloc_index_cache(1, 128, device)
        write_kv(c.to(device), k_pe.to(device), slots.to(device), kv, index_k.to(device), idx)
        kv_twin, idx_twin = ref.alloc_kv_cache(1, 512, 64, fp8), ref.alloc_index_cache(1, 128)
        ref.write_kv(c, k_pe, slots, kv_twin, index_k, idx_twin)
        assert torch.equal(kv.cpu().view(torch.uint8), kv_twin.view(torch.uint8))
        assert torch.equal(idx.cpu(), idx_twin)


def test_write_kv_rounds_ties_to_even_like_torch():
    _check_rounding(DEVICE)


def test_write_kv_with_no_tokens_is_a_no_op():
    kv = ref.alloc_kv_cache(1, 128, 32, True, DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    write_kv(torch.zeros(0, 128, device=DEVICE), torch.zeros(0, 32, device=DEVICE), empty, kv)
    assert not kv.any()


def _valid_args(fp8=True):
    N, (r, dr, DI) = 3, (128, 32, 64)
    return dict(c=torch.randn(N, r), k_pe=torch.randn(N, dr), slots=torch.tensor([0, 5, -1]),
                kv_cache=ref.alloc_kv_cache(1, r, dr, fp8), index_k=torch.randn(N, DI),
                index_cache=ref.alloc_index_cache(1, DI))


@pytest.mark.parametrize("change, message", [
    (dict(c=torch.randn(4, 128)), "c must be"),
    (dict(k_pe=torch.randn(3, 32, 1)), "k_pe must be"),
    (dict(index_k=torch.randint(0, 9, (3, 64))), "index_k must be"),
    (dict(slots=torch.tensor([0.0, 1.0, 2.0])), "slots must be"),
    (dict(slots=torch.tensor([0, 64, 1])), r"slots must be -1 or in \[0, 64\).*got 64"),
    (dict(slots=torch.tensor([0, -2, 1])), "slots must be -1 or in"),
    (dict(kv_cache=torch.zeros(1, 64, 160, dtype=torch.float16)), "kv_cache must be bfloat16, float32"),
    (dict(kv_cache=ref.alloc_kv_cache(1, 128, 64, True)), r"kv_cache must be \[num_blocks, 64, 196\]"),
    (dict(kv_cache=ref.alloc_kv_cache(1, 128, 32, False)[:, :, :150]), r"kv_cache must be \[num_blocks, 64, 160\]"),
    (dict(kv_cache=torch.zeros(64, 2, 196, dtype=torch.uint8).transpose(0, 1)), "kv_cache must be contiguous"),
    (dict(c=torch.randn(3, 100), kv_cache=torch.zeros(1, 64, 164, dtype=torch.uint8)), "divisible by 128"),
    (dict(k_pe=torch.randn(3, 31)), "even rope dim"),
    (dict(index_cache=None), "index_k and index_cache"),
    (dict(index_cache=ref.alloc_index_cache(1, 128)), "index_cache must be uint8"),
])
def test_write_kv_refuses_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        write_kv(**{name: t.to(DEVICE) if t is not None else None for name, t in (_valid_args() | change).items()},
                 check_slots=True)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "r{}-dr{}-di{}".format(*g))
@pytest.mark.parametrize("with_index", [False, True], ids=["mla-only", "with-index"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_write_kv_matches_twin_cuda(fp8, with_index, geometry, dtype):
    _check_against_twin(4096, geometry, fp8, with_index, dtype, "cuda", num_blocks=96)
    _check_against_twin(7, geometry, fp8, with_index, dtype, "cuda", num_blocks=3, slot_dtype=torch.int32)


@pytest.mark.gpu
def test_write_kv_rounds_ties_to_even_like_torch_cuda():
    _check_rounding("cuda")


@pytest.mark.gpu
def test_write_kv_under_cuda_graph_capture_drops_out_of_range_slots():
    """Decode runs in CUDA graphs: the wrapper cannot read slots back there, so the kernel itself
    must skip bad slots rather than write out of bounds."""
    N, (r, dr, DI), num_blocks = 64, GLM, 4
    c, k_pe, index_k = _inputs(N, GLM, torch.bfloat16, "cuda")
    slots = _slots(N, num_blocks, "cuda")
    kv, idx = ref.alloc_kv_cache(num_blocks, r, dr, True, "cuda"), ref.alloc_index_cache(num_blocks, DI, "cuda")
    write_kv(c, k_pe, slots, kv, index_k, idx)  # warm-up: compiles outside the capture
    kv.zero_()
    idx.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(c, k_pe, slots, kv, index_k, idx)
    slots[0], slots[2] = num_blocks * ref.BLOCK_SIZE, 10**9  # out of range: dropped in the replay
    graph.replay()
    torch.cuda.synchronize()
    kv_twin, idx_twin = ref.alloc_kv_cache(num_blocks, r, dr, True), ref.alloc_index_cache(num_blocks, DI)
    keep = (slots < num_blocks * ref.BLOCK_SIZE).cpu()
    ref.write_kv(c.cpu()[keep], k_pe.cpu()[keep], slots.cpu()[keep], kv_twin, index_k.cpu()[keep], idx_twin)
    assert torch.equal(kv.cpu(), kv_twin) and torch.equal(idx.cpu(), idx_twin)


def test_host_launch_arithmetic_equals_tritons():
    import triton

    from megactx.kernels.common import cdiv, next_power_of_2

    for n in range(-3, 1100):
        assert next_power_of_2(n) == (triton.next_power_of_2(n) if n >= 0 else 0)
        for d in (1, 3, 16, 64):
            assert cdiv(n, d) == triton.cdiv(n, d)
