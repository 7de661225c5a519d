"""The counter-based streams of seeded sampling (`megactx.kernels.rng`) against their twin
`reference.row_random` and against the definition computed with Python integers.

Uniforms are the same bits in the kernel and the twin (integer hashing, one exact conversion);
exponentials are -log of them, equal up to log's rounding. Without a GPU the kernel runs in the
Triton interpreter (set by conftest)."""

from __future__ import annotations

import math

import pytest
import torch

from megactx.kernels import reference as ref
from megactx.kernels.rng import one_row_random, row_random

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = (0, 1, 12345, 2**63 + 5, -7)


def _streams(offsets: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.tensor([ref.stream_key(s) for s in SEEDS], dtype=torch.int64)
    return keys, torch.tensor(offsets, dtype=torch.int64)


def _by_definition(seed: int, n: int) -> float:
    """The n-th value (n >= 1) of seed's stream, with Python integers."""
    key = ref.mix64(seed % 2**64)
    z = ref.mix64((key + n * ref.GOLDEN) % 2**64)
    return (2 * (z >> 41) + 1) / 2**24


def test_twin_follows_the_definition():
    keys, offsets = _streams((0, 7, 100, 2**40, 3))
    u = ref.row_random(keys, offsets, 300, exponential=False)
    for r, seed in enumerate(SEEDS):
        for j in (0, 1, 299):
            assert u[r, j].item() == _by_definition(seed, offsets[r].item() + 1 + j)
    e = ref.row_random(keys, offsets, 300, exponential=True)
    torch.testing.assert_close(e, -u.log(), rtol=0, atol=0)


@pytest.mark.parametrize("width", [1, 1000, 2500])
def test_kernel_matches_twin(width):
    keys, offsets = _streams((0, 7, 100, 2**40, 3))
    for exponential in (False, True):
        got = row_random(keys.to(DEVICE), offsets.to(DEVICE), width, exponential).cpu()
        want = ref.row_random(keys, offsets, width, exponential)
        if exponential:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:
            assert torch.equal(got, want)


def test_a_draw_continues_the_stream():
    """Drawing 10 values, or 4 and then 6 with the counter advanced by 4, gives the same values."""
    keys, offsets = _streams((5, 0, 9, 1, 2))
    whole = ref.row_random(keys, offsets, 10, False)
    first = ref.row_random(keys, offsets, 4, False)
    rest = ref.row_random(keys, offsets + 4, 6, False)
    assert torch.equal(whole, torch.cat([first, rest], dim=1))


def test_values_are_uniform_and_exponential():
    """Moments of 200K values: a stream's and, across streams, the first value of each of 200K."""
    keys, offsets = _streams((0,) * len(SEEDS))
    u = ref.row_random(keys[:1], offsets[:1], 200_000, False)[0]
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 3 / math.sqrt(12 * 200_000) * 2
    assert abs(u.var().item() - 1 / 12) < 0.002
    across = torch.tensor([ref.stream_key(s) for s in range(200_000)], dtype=torch.int64)
    first = ref.row_random(across, torch.zeros_like(across), 1, True)[:, 0]
    assert abs(first.mean().item() - 1) < 0.01 and abs(first.var().item() - 1) < 0.03
    # neighbouring values of one stream are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01


def test_out_and_strided_state():
    """Writing into a given out, from keys and offsets that are columns of one state tensor (as the
    sampler sends them: key, offset, row), gives the same values."""
    keys, offsets = _streams((3, 1, 4, 1, 5))
    state = torch.stack([keys, offsets, torch.arange(len(SEEDS))], dim=1).to(DEVICE)  # [S, 3]
    out = torch.full((len(SEEDS), 700), -1.0, device=DEVICE)
    got = row_random(state[:, 0], state[:, 1], 700, True, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), ref.row_random(keys, offsets, 700, True), rtol=1e-6, atol=0)


def test_one_row_from_host_arguments():
    """One stream with its key and offset as kernel arguments (a batch of one seeded request) gives
    the values of the batched kernel, for offsets and keys of every size."""
    for seed, offset in ((0, 0), (12345, 7), (2**63 + 5, 2**40 + 3), (-7, 1)):
        key = ref.stream_key(seed)
        out = torch.empty(2100, device=DEVICE)
        one_row_random(key, offset, 2100, True, out)
        want = ref.row_random(torch.tensor([key]), torch.tensor([offset]), 2100, True)[0]
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=0)


def test_bad_arguments():
    keys, offsets = _streams((0,) * len(SEEDS))
    with pytest.raises(ValueError, match="int64"):
        row_random(keys.int().to(DEVICE), offsets.to(DEVICE), 4, False)
    with pytest.raises(ValueError, match="int64"):
        row_random(keys[:2].to(DEVICE), offsets.to(DEVICE), 4, False)
    with pytest.raises(ValueError, match="out must be"):
        row_random(keys.to(DEVICE), offsets.to(DEVICE), 4, False, out=torch.empty(len(SEEDS), 5, device=DEVICE))


@pytest.mark.gpu
def test_cuda_kernel_bits_equal_the_cpu_twin():
    keys, offsets = _streams((0, 1 << 33, 17, 2**50, 999))
    got = row_random(keys.cuda(), offsets.cuda(), 151_552, False).cpu()
    assert torch.equal(got, ref.row_random(keys, offsets, 151_552, False))
