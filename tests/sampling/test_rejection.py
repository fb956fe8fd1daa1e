"""Rejection sampling: emitted tokens follow the target distribution; greedy is exact."""

import pytest
import torch

from moestream.sampling import Sampler, SamplingBatch, process_logits, rejection_sample
from moestream.types import SamplingParams as SP


def make_batch(params, outputs=None, prompts=None):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    return SamplingBatch.from_params(params, outputs, prompts, "cpu")


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).float()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


TARGET = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.3, 1.5, -0.2, 0.1, 0.9, -0.7]])
DRAFT = torch.tensor([[0.05, 0.4, 0.3, 0.05, 0.1, 0.1], [0.3, 0.1, 0.1, 0.2, 0.1, 0.2]])


@pytest.mark.parametrize("params", [SP(), SP(temperature=0.7, top_k=4, top_p=0.95)])
def test_emitted_tokens_follow_target_distribution(params):
    n, k, v = 40000, 1, TARGET.shape[1]
    gen = torch.Generator().manual_seed(0)
    draft_probs = DRAFT[:k].expand(n, k, v).contiguous()
    draft_ids = torch.multinomial(DRAFT[0], n, replacement=True, generator=gen).view(n, k)
    target_logits = TARGET.expand(n, k + 1, v)
    batch = make_batch([params] * n)
    out, accepted = rejection_sample(draft_ids, draft_probs, target_logits, batch, gen)

    p = process_logits(TARGET, make_batch([params] * 2)).softmax(dim=-1)  # [k+1, V]
    assert total_variation(out[:, 0], p[0]) < 0.015
    assert total_variation(out[:, 0], DRAFT[0]) > 0.1  # q alone would fail
    # Given the draft was accepted, the bonus token follows p at the next position.
    bonus = out[accepted == 1, 1]
    assert total_variation(bonus, p[1]) < 0.02
    assert (out[accepted == 0, 1] == -1).all()
    # Acceptance rate is sum_x min(p(x), q(x)) = 1 - TV(p, q).
    expected_rate = torch.minimum(p[0], DRAFT[0]).sum().item()
    assert abs(accepted.float().mean().item() - expected_rate) < 0.015


def test_deterministic_draft_keeps_target_distribution():
    n, k, v = 30000, 2, TARGET.shape[1]
    gen = torch.Generator().manual_seed(1)
    draft_ids = torch.tensor([[3, 1]]).expand(n, k)  # an n-gram proposal: q is one-hot
    target_logits = torch.stack([TARGET[0], TARGET[1], TARGET[0]]).expand(n, k + 1, v)
    out, accepted = rejection_sample(draft_ids, None, target_logits, make_batch([SP()] * n), gen)
    p = torch.softmax(target_logits[0], dim=-1)
    assert total_variation(out[:, 0], p[0]) < 0.015
    assert abs((accepted >= 1).float().mean().item() - p[0, 3].item()) < 0.015
    second = out[accepted >= 1, 1]
    assert total_variation(second, p[1]) < 0.02
    emitted = (out >= 0).sum(dim=1)
    assert torch.equal(emitted, accepted + 1)


def test_greedy_rows_emit_target_argmax_sequence():
    gen = torch.Generator().manual_seed(2)
    b, k, v = 4, 4, 50
    target_logits = torch.randn(b, k + 1, v, generator=gen)
    argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    draft_ids = argmax[:, :k].clone()
    matching = [4, 0, 2, 3]  # leading drafts that agree with the target
    for row, m in enumerate(matching):
        if m < k:
            draft_ids[row, m] = (argmax[row, m] + 1) % v
    draft_probs = torch.softmax(torch.randn(b, k, v, generator=gen), dim=-1)
    for probs in (None, draft_probs):
        out, accepted = rejection_sample(
            draft_ids, probs, target_logits, make_batch([SP(temperature=0)] * b)
        )
        assert accepted.tolist() == matching
        for row, m in enumerate(matching):
            assert out[row, : m + 1].tolist() == argmax[row, : m + 1].tolist()
            assert (out[row, m + 1 :] == -1).all()


def test_greedy_verify_with_penalties_matches_sequential_decode():
    # Penalties at position j must count drafts 0..j-1, as plain decode would have.
    gen = torch.Generator().manual_seed(3)
    k, v = 5, 12
    params = SP(temperature=0, repetition_penalty=3.0, frequency_penalty=0.7)
    prompt, output = [1, 2], [3]
    target_logits = torch.randn(1, k + 1, v, generator=gen) + 2.0
    sampler = Sampler()
    sequential = []
    history = list(output)
    for j in range(k + 1):
        batch = make_batch([params], [history], [prompt])
        token = sampler.sample(target_logits[:, j], batch).token_ids.item()
        sequential.append(token)
        history.append(token)
    draft_ids = torch.tensor([sequential[:k]])
    out, accepted = rejection_sample(
        draft_ids, None, target_logits, make_batch([params], [output], [prompt])
    )
    assert accepted.item() == k
    assert out[0].tolist() == sequential
    # Without the draft counts the answer would differ on these logits.
    no_penalty = target_logits[0].argmax(dim=-1).tolist()
    assert no_penalty != sequential


def test_seeded_rows_are_batch_invariant_and_mixed_batch_works():
    gen = torch.Generator().manual_seed(4)
    k, v = 3, 16
    target_logits = torch.randn(4, k + 1, v, generator=gen)
    draft_probs = torch.softmax(torch.randn(4, k, v, generator=gen), dim=-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, v), 1, generator=gen).view(4, k)
    params = [SP(seed=11), SP(temperature=0), SP(temperature=0.8, seed=12, top_k=8), SP()]
    batch = make_batch(params, [[1], [2], [3], [4]])
    out, accepted = rejection_sample(draft_ids, draft_probs, target_logits, batch, gen)
    for row in (0, 2):
        alone = make_batch([params[row]], [[row + 1]])
        out1, acc1 = rejection_sample(
            draft_ids[row : row + 1],
            draft_probs[row : row + 1],
            target_logits[row : row + 1],
            alone,
        )
        assert torch.equal(out1[0], out[row]) and acc1.item() == accepted[row].item()
    greedy_out, _ = rejection_sample(
        draft_ids[1:2], None, target_logits[1:2], make_batch([params[1]], [[2]])
    )
    assert torch.equal(greedy_out[0], out[1])
    assert ((out >= 0).sum(dim=1) == accepted + 1).all()


def test_no_drafts_samples_one_token():
    batch = make_batch([SP(temperature=0), SP(seed=1)])
    logits = torch.randn(2, 1, 10, generator=torch.Generator().manual_seed(5))
    out, accepted = rejection_sample(torch.zeros(2, 0, dtype=torch.int64), None, logits, batch)
    assert out.shape == (2, 1) and accepted.tolist() == [0, 0]
    assert out[0, 0] == logits[0, 0].argmax()
    assert 0 <= out[1, 0] < 10


def test_plain_sampling_matches_drafts_as_often_as_verification_accepts_them():
    """The speculator's shadow drafts for sampled requests (`Speculator._shadow_keep`): the
    number of leading deterministic drafts that plain sampling reproduces has the law of
    the number rejection sampling accepts. Both counted over the same target rows, at a
    temperature with top-k; a wrong claim (e.g. accepting with p^2, or counting matches
    anywhere) would be off by far more than the tolerance."""
    n, k, v = 30000, 2, TARGET.shape[1]
    params = SP(temperature=0.8, top_k=4)
    draft_ids = torch.tensor([[3, 1]]).expand(n, k)
    target_logits = torch.stack([TARGET[0], TARGET[1], TARGET[0]]).expand(n, k + 1, v)
    _, accepted = rejection_sample(
        draft_ids, None, target_logits, make_batch([params] * n), torch.Generator().manual_seed(2)
    )
    # plain decode: sample position j from its processed distribution while it matches
    batch = make_batch([params])
    probs = [process_logits(TARGET[i : i + 1], batch).softmax(dim=-1)[0] for i in (0, 1)]
    gen = torch.Generator().manual_seed(3)
    first = torch.multinomial(probs[0], n, replacement=True, generator=gen) == 3
    second = torch.multinomial(probs[1], n, replacement=True, generator=gen) == 1
    matched = first.long() + (first & second).long()
    for a in range(k + 1):
        want = (accepted == a).float().mean().item()
        got = (matched == a).float().mean().item()
        assert abs(got - want) < 0.015, (a, got, want)
    assert 0.05 < (accepted == 2).float().mean().item() < 0.95  # the test separates the cases
