"""Sampler: greedy, truncation, penalties, seeded batch invariance, logprobs."""

import math

import pytest
import torch

from moestream.sampling import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    argmax_only,
    process_logits,
    step_seed,
)
from moestream.sampling.sampler import apply_min_p, apply_top_k_top_p
from moestream.types import SamplingParams as SP


def make_batch(params, outputs=None, prompts=None, steps=None):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    return SamplingBatch.from_params(params, outputs, prompts, "cpu", steps)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 3, 30]] = 100.0  # three-way tie: lowest id wins
    out = Sampler(seed=0).sample(logits, make_batch([SP(temperature=0)] * 6))
    expected = logits.argmax(dim=-1)
    assert out.token_ids[0] == 3
    assert torch.equal(out.token_ids, expected)


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1)
    sampler = Sampler(seed=1)
    top_k = sampler.sample(logits, make_batch([SP(temperature=1.5, top_k=1)] * 16))
    top_p = sampler.sample(
        logits, make_batch([SP(temperature=1.5, top_p=1e-6, seed=i) for i in range(16)])
    )
    assert torch.equal(top_k.token_ids, expected)
    assert torch.equal(top_p.token_ids, expected)
    # The truncation itself (not the greedy shortcut) keeps only the best token at k = 1.
    kept = apply_top_k_top_p(logits, torch.ones(16, dtype=torch.int64), torch.ones(16), 1, False)
    assert torch.equal(kept.isfinite().sum(dim=-1), torch.ones(16, dtype=torch.int64))
    assert torch.equal(kept.argmax(dim=-1), expected)


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.05, 0.4, 0.1, 0.3, 0.15]]))
    # Row 0: top-k 2 -> {1, 3}. Row 1: top-p 0.75 -> {1, 3, 4} (0.4 + 0.3 < 0.75 <= 0.85).
    top_k = torch.tensor([2, 0])
    top_p = torch.tensor([1.0, 0.75])
    for any_top_p in (False, True):  # the topk path and the sort path must agree on row 0
        kept = apply_top_k_top_p(logits, top_k, top_p, 2, any_top_p).isfinite()
        assert kept[0].nonzero().flatten().tolist() == [1, 3]
    assert kept[1].nonzero().flatten().tolist() == [1, 3, 4]


def test_min_p_filters_below_fraction_of_max():
    probs = torch.tensor([[0.5, 0.2, 0.04, 0.26], [0.5, 0.2, 0.04, 0.26]])
    kept = apply_min_p(torch.log(probs), torch.tensor([0.1, 0.5])).isfinite()
    assert kept[0].tolist() == [True, True, False, True]  # 0.04 < 0.05
    assert kept[1].tolist() == [True, False, False, True]  # 0.2 < 0.25 <= 0.26
    # Sampling never draws a filtered token.
    n = 2000
    out = Sampler(seed=2).sample(torch.log(probs[:1]).expand(n, 4), make_batch([SP(min_p=0.1)] * n))
    counts = torch.bincount(out.token_ids, minlength=4)
    assert counts[2] == 0 and (counts[[0, 1, 3]] > 0).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_known_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    out = Sampler(seed=3).sample(logits.expand(n, 4), make_batch([SP(temperature=temperature)] * n))
    counts = torch.bincount(out.token_ids, minlength=4).float()
    expected = torch.softmax(logits / temperature, dim=-1)
    assert total_variation(counts, expected) < 0.015
    # The wrong temperature is far away: the test can fail.
    assert total_variation(counts, torch.softmax(logits, dim=-1)) > 0.05 or temperature == 1.0


def test_penalties_change_exactly_the_right_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 3)
    params = [
        SP(repetition_penalty=2.0),
        SP(presence_penalty=0.5, frequency_penalty=0.25),
        SP(),  # off: untouched
    ]
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[2, 3, 3], [2, 3, 3], [2, 3, 3]]
    out = apply_penalties(logits, make_batch(params, outputs, prompts))
    rep = logits[0].clone()
    rep[[0, 2]] /= 2.0  # positive logits seen in prompt or output
    rep[[1, 3]] *= 2.0  # negative ones
    assert torch.equal(out[0], rep)
    freq = logits[1].clone()
    freq[2] -= 0.5 + 0.25  # output once: presence + 1 x frequency; prompt tokens not penalised
    freq[3] -= 0.5 + 0.5  # output twice
    assert torch.equal(out[1], freq)
    assert torch.equal(out[2], logits[2])


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = Sampler().sample(logits, make_batch([SP(temperature=0)], [[0]], [[]]))
    penalised = Sampler().sample(
        logits, make_batch([SP(temperature=0, frequency_penalty=0.5)], [[0]], [[]])
    )
    assert plain.token_ids.item() == 0 and penalised.token_ids.item() == 1


def test_seeded_row_is_batch_invariant():
    gen = torch.Generator().manual_seed(4)
    target = SP(temperature=0.9, top_p=0.95, seed=1234)
    others = [
        SP(temperature=1.3, top_k=5),  # unseeded
        SP(temperature=0),
        SP(temperature=0.7, min_p=0.05, seed=99),
        SP(temperature=1.0, repetition_penalty=1.2, seed=1234),  # same seed, other params
    ]
    alone_tokens, batched_tokens = [], []
    sampler = Sampler(seed=5)
    output: list[int] = []
    for _ in range(30):
        logits = torch.randn(5, 64, generator=gen)
        alone = sampler.sample(logits[2:3], make_batch([target], [output], [[1, 2]]))
        params = [others[0], others[1], target, others[2], others[3]]
        outs = [[7], [], output, [3, 3], [5]]
        batched = sampler.sample(logits, make_batch(params, outs, [[1, 2]] * 5))
        alone_tokens.append(alone.token_ids.item())
        batched_tokens.append(batched.token_ids[2].item())
        output = output + [alone_tokens[-1]]
    assert alone_tokens == batched_tokens
    assert len(set(alone_tokens)) > 5  # it really sampled


def test_seed_and_step_determine_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: the draw is the noise's argmax

    def draw(seed, step):
        batch = make_batch([SP(seed=seed)], steps=[step])
        return Sampler().sample(logits, batch).token_ids.item()

    assert draw(7, 3) == draw(7, 3)
    assert len({draw(7, s) for s in range(8)}) > 4
    assert len({draw(s, 3) for s in range(8)}) > 4
    assert step_seed(7, 3) != step_seed(3, 7) and 0 <= step_seed(-1, 0) < 2**63


@pytest.mark.parametrize("mode", ["raw", "penalized", "processed"])
def test_logprobs_match_log_softmax(mode):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    params = [
        SP(temperature=0, logprobs=3, repetition_penalty=1.5),
        SP(temperature=0.8, top_k=10, logprobs=5, seed=1),
        SP(temperature=1.2, top_p=0.8, seed=2),
        SP(logprobs=0, presence_penalty=1.0),
    ]
    outputs = [[1, 2], [3], [], [int(logits[3].argmax())]]
    batch = make_batch(params, outputs, [[4]] * 4)
    out = Sampler(logprobs_mode=mode, seed=7).sample(logits, batch)
    penalised = apply_penalties(logits, batch)
    source = {"raw": logits, "penalized": penalised, "processed": process_logits(penalised, batch)}
    expected = torch.log_softmax(source[mode], dim=-1)
    sampled = expected.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, sampled)
    assert out.logprobs.isfinite().all()
    values, ids = out.top_logprobs
    assert values.shape == (4, 5)
    torch.testing.assert_close(values, expected.topk(5, dim=-1).values)
    torch.testing.assert_close(expected.gather(1, ids), values)
    assert torch.equal(out.ranks, (expected > sampled.unsqueeze(1)).sum(dim=-1) + 1)
    assert out.ranks[0] == 1  # greedy row takes the top token of the penalised distribution
    if mode == "raw":
        assert not torch.allclose(penalised[0], logits[0])  # penalties do not leak into raw


def test_rows_with_features_off_are_untouched():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(8))
    params = [
        SP(),  # everything off
        SP(temperature=0.5, top_k=3, min_p=0.2, repetition_penalty=1.3, frequency_penalty=1.0),
        SP(top_p=0.5, presence_penalty=-1.0),
        SP(temperature=0),
    ]
    batch = make_batch(params, [[1, 2, 3]] * 4, [[4, 5]] * 4)
    penalised = apply_penalties(logits, batch)
    processed = process_logits(penalised, batch)
    for row in (0, 3):
        assert torch.equal(penalised[row], logits[row])
        assert torch.equal(processed[row], logits[row])
    assert processed[1].isfinite().sum() <= 3
    assert not torch.equal(processed[2], penalised[2])


def test_all_rows_drawn_with_no_row_loop_over_math():
    # Large mixed batch: every row's token is in its own kept set.
    n, v = 64, 32
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(9))
    params = [
        SP(temperature=0.3 + (i % 5) * 0.4, top_k=i % 7, seed=i if i % 2 else None)
        for i in range(n)
    ]
    batch = make_batch(params)
    out = Sampler(seed=10).sample(logits, batch)
    kept = process_logits(logits, batch).isfinite()
    assert kept.gather(1, out.token_ids.unsqueeze(1)).all()
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_bad_shapes_and_token_ids_are_reported():
    batch = make_batch([SP(repetition_penalty=1.1)], [[50]], [[]])
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler().sample(torch.zeros(1, 10), batch)
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(2, 60), batch)
    assert math.isfinite(Sampler().sample(torch.zeros(1, 60), batch).logprobs.item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_matches_cpu_and_never_synchronises():
    from moestream.sampling import rejection_sample

    gen = torch.Generator().manual_seed(11)
    v, k = 1000, 3
    params = [
        SP(temperature=0, repetition_penalty=1.4, logprobs=2),
        SP(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=5, frequency_penalty=0.3),
        SP(temperature=1.1, seed=6, logprobs=4),
        SP(top_p=0.7),
    ]
    outputs, prompts = [[1, 2], [3, 3], [], [9]], [[4], [5, 6], [7], [8]]
    logits = torch.randn(4, v, generator=gen)
    target = torch.randn(4, k + 1, v, generator=gen)
    drafts = torch.randint(0, v, (4, k), generator=gen)
    draft_probs = torch.softmax(torch.randn(4, k, v, generator=gen), dim=-1)
    batch = SamplingBatch.from_params(params, outputs, prompts, "cuda")
    alone = SamplingBatch.from_params(params[1:2], outputs[1:2], prompts[1:2], "cuda")
    sampler = Sampler(seed=0, logprobs_mode="processed")
    logits_d, target_d = logits.cuda(), target.cuda()
    drafts_d, draft_probs_d = drafts.cuda(), draft_probs.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits_d, batch)
        out_alone = sampler.sample(logits_d[1:2], alone)
        rej, acc = rejection_sample(drafts_d, draft_probs_d, target_d, batch)
        rej_alone, acc_alone = rejection_sample(
            drafts_d[1:2], draft_probs_d[1:2], target_d[1:2], alone
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu_batch = make_batch(params, outputs, prompts)
    cpu = Sampler(seed=0, logprobs_mode="processed").sample(logits, cpu_batch)
    assert out.token_ids[0].item() == cpu.token_ids[0].item()
    assert out.token_ids[1].item() == out_alone.token_ids[0].item()
    assert torch.equal(rej[1], rej_alone[0]) and acc[1].item() == acc_alone.item()
    cpu_rej, _ = rejection_sample(drafts, None, target, cpu_batch)
    assert torch.equal(rej[0].cpu(), cpu_rej[0])  # greedy rows agree across devices
    torch.testing.assert_close(out.logprobs[0].cpu(), cpu.logprobs[0])


def test_argmax_only_rows_and_the_argmax_path():
    """`argmax_only` holds exactly for greedy rows that ask for nothing else, and for those
    `Sampler.argmax` gives what `sample` gives (ties to the lowest id; bf16 upcast)."""
    assert argmax_only(SP(temperature=0)) and argmax_only(SP(temperature=0.7, top_k=1))
    for p in (
        SP(temperature=0.7),
        SP(temperature=0, logprobs=0),
        SP(temperature=0, repetition_penalty=1.1),
        SP(temperature=0, presence_penalty=0.5),
        SP(temperature=0, frequency_penalty=-0.5),
    ):
        assert not argmax_only(p), p
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    logits[1, [9, 2, 40]] = 50.0
    params = [SP(temperature=0)] * 5
    for x in (logits, logits.to(torch.bfloat16)):
        expected = Sampler(seed=0).sample(x, make_batch(params)).token_ids
        got = Sampler(seed=0).argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert Sampler().argmax(logits)[1] == 2


def test_sample_without_logprobs_draws_the_same_tokens():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(5))
    params = [
        SP(temperature=0.9, seed=i, top_k=5 * (i % 3), frequency_penalty=0.2 * (i % 2))
        for i in range(8)
    ]
    batch = make_batch(params, [[1, 2, i] for i in range(8)])
    full = Sampler(seed=1).sample(logits, batch)
    lean = Sampler(seed=1).sample(logits, batch, logprobs=False)
    assert torch.equal(full.token_ids, lean.token_ids)
    assert full.logprobs is not None and lean.logprobs is None and lean.ranks is None


def test_batch_fields_per_row():
    """The per-row values `from_params` packs into one tensor per dtype come out per field."""
    params = [
        SP(temperature=0),
        SP(temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, repetition_penalty=1.2),
        SP(temperature=1.5, presence_penalty=0.25, frequency_penalty=-0.5),
    ]
    b = make_batch(params, [[4], [5, 6], [7]], [[1], [2, 3], [8]])
    assert b.greedy.tolist() == [True, False, False]
    assert b.temperature.tolist() == [1.0, 0.5, 1.5]
    assert b.top_k.tolist() == [0, 7, 0] and b.top_k.dtype == torch.int64
    assert b.top_p.tolist() == pytest.approx([1.0, 0.8, 1.0])
    assert b.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert b.repetition_penalty.tolist() == pytest.approx([1.0, 1.2, 1.0])
    assert b.presence_penalty.tolist() == [0.0, 0.0, 0.25]
    assert b.frequency_penalty.tolist() == [0.0, 0.0, -0.5]
    assert b.output_token_rows.tolist() == [1, 1, 2] and b.output_token_ids.tolist() == [5, 6, 7]
    assert b.prompt_token_rows.tolist() == [1, 1] and b.prompt_token_ids.tolist() == [2, 3]


def test_reseeded_batch_equals_a_fresh_one():
    from dataclasses import fields

    params = [SP(temperature=0.7, seed=4, top_k=5), SP(temperature=0), SP(temperature=1.0)]
    outs = [[1, 2], [3], []]
    prompts = [[5], [6], [7]]
    a = SamplingBatch.from_params(params, outs, prompts, "cpu", [2, 1, 0])
    b = SamplingBatch.from_params(params, outs, prompts, "cpu", [7, 3, 9])
    r = a.reseeded(params, [7, 3, 9])
    assert r.generator_seeds == b.generator_seeds != a.generator_seeds
    for f in fields(SamplingBatch):
        x, y = getattr(r, f.name), getattr(b, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name
    assert a.reseeded(params, [2, 1, 0]) is a
    pen = SamplingBatch.from_params([SP(presence_penalty=0.5)], [[1]], [[2]], "cpu")
    with pytest.raises(ValueError, match="penalties"):
        pen.reseeded([SP(presence_penalty=0.5)], [3])
