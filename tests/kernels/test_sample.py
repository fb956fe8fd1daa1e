"""`kernels.sample.gumbel_argmax` (Triton interpreter on the CPU, the kernel itself on CUDA):
the law of its draws, blocks of the vocabulary, per-row determinism; and the sampler's CUDA
path built on it."""

from __future__ import annotations

import math
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels.sample import gumbel_argmax  # noqa: E402
from moestream.sampling.sampler import Sampler, SamplingBatch  # noqa: E402
from moestream.types import SamplingParams  # noqa: E402


def _seeds(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=DEVICE) * 0x9E3779B97F4A7C1


def test_draws_follow_the_softmax():
    """300 rows with p = (0.3, 0.7), one draw each: the count of token 0 lies within 4 sigma
    of 90 (an argmax would give 0, a uniform draw ~150)."""
    n = 300
    x = torch.log(torch.tensor([0.3, 0.7], device=DEVICE)).expand(n, 2).contiguous()
    tokens = gumbel_argmax(x, _seeds(n))
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    zeros = int((tokens == 0).sum())
    assert abs(zeros - 0.3 * n) < 4 * math.sqrt(n * 0.21), zeros


def test_vocabulary_blocks_and_masked_tokens():
    """The token in the last of several blocks, the only one not masked, is drawn every time;
    two equal survivors in different blocks are both drawn."""
    x = torch.full((40, 40), -math.inf, device=DEVICE)
    x[:, 37] = 0.0
    assert torch.equal(gumbel_argmax(x, _seeds(40), block_v=16), torch.full_like(_seeds(40), 37))
    x[:, 5] = 0.0
    drawn = set(gumbel_argmax(x, _seeds(40), block_v=16).tolist())
    assert drawn == {5, 37}


def test_a_rows_draw_depends_on_its_seed_and_logits_alone():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(DEVICE)
    seeds = _seeds(6, 11)
    batch = gumbel_argmax(x, seeds, block_v=16)
    alone = [int(gumbel_argmax(x[i : i + 1], seeds[i : i + 1], block_v=16)) for i in range(6)]
    assert batch.tolist() == alone
    assert torch.equal(gumbel_argmax(x, seeds, block_v=16), batch)  # again: the same
    other = gumbel_argmax(x, seeds + 1, block_v=16)
    assert not torch.equal(other, batch)  # other seeds, other draws (6 rows of 64 tokens)


def test_bad_arguments_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="seeds"):
        gumbel_argmax(x, torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="x must be"):
        gumbel_argmax(x.t(), _seeds(8))


def test_row_seeds_are_the_rows_seeds_or_fresh_draws():
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
    batch = SamplingBatch.from_params(params, [[], []], [[1], [1]], "cpu")
    a, b = Sampler(seed=1), Sampler(seed=1)
    first = a.row_seeds(batch, torch.device("cpu"))
    assert first[0] == batch.generator_seeds[0]
    assert torch.equal(first, b.row_seeds(batch, torch.device("cpu")))  # the sampler's seed
    assert a.row_seeds(batch, torch.device("cpu"))[1] != first[1]  # unseeded: fresh each step


@pytest.mark.skipif(DEVICE != "cuda", reason="the sampler takes this path on CUDA only")
def test_cuda_sampler_draws_are_seeded_and_batch_invariant():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 1000, generator=g).to(DEVICE)
    params = [SamplingParams(temperature=0.8, seed=s, top_p=0.9) for s in (1, 2, 3)]
    batch = SamplingBatch.from_params(params, [[], [], []], [[1]] * 3, DEVICE)
    sampler = Sampler()
    together = sampler.sample(logits, batch, logprobs=False).token_ids
    assert torch.equal(sampler.sample(logits, batch, logprobs=False).token_ids, together)
    for i in range(3):
        one = SamplingBatch.from_params(params[i : i + 1], [[]], [[1]], DEVICE)
        alone = sampler.sample(logits[i : i + 1], one, logprobs=False).token_ids
        assert int(alone) == int(together[i])
