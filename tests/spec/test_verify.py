"""Verification with a different number of drafts per request (`rejection_sample(num_drafts=)`,
`spec.verify.verify_drafts`): a padded batch gives each request what it gets alone."""

from __future__ import annotations

import pytest
import torch

from moestream.sampling import SamplingBatch, process_logits, rejection_sample
from moestream.spec.verify import pad_rows, verify_drafts
from moestream.types import SamplingParams as SP


def make_batch(params, outputs=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.from_params(params, outputs, [[] for _ in params], "cpu")


def test_pad_rows_repeats_each_requests_last_row():
    logits = torch.arange(6, dtype=torch.float32).unsqueeze(1)  # rows 0..5: k = 2, 0, 1
    padded = pad_rows(logits, [2, 0, 1])
    assert padded.squeeze(-1).tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    with pytest.raises(ValueError):
        pad_rows(logits, [2, 1])


@pytest.mark.parametrize("seeded", [False, True])
def test_ragged_batch_equals_each_row_alone(seeded):
    gen = torch.Generator().manual_seed(0)
    ks, v = [3, 1, 2, 3, 0], 20
    params = [
        SP(temperature=0),
        SP(temperature=0.9, seed=5 if seeded else None),
        SP(temperature=0, repetition_penalty=1.5),
        SP(temperature=0.7, top_k=6, seed=6 if seeded else None),
        SP(temperature=1.0, seed=7 if seeded else None),
    ]
    outputs = [[1, 2], [3], [4, 4], [5], [6]]
    logits = torch.randn(len(ks), 4, v, generator=gen) * 3
    drafts = torch.randint(0, v, (len(ks), 3), generator=gen)
    drafts[0] = logits[0, :3].argmax(dim=-1)  # all accepted by the greedy row
    batch = make_batch(params, outputs)
    out, acc = rejection_sample(drafts, None, logits, batch, gen, ks)
    assert ((out >= 0).sum(dim=1) == acc + 1).all()
    assert all(a <= k for a, k in zip(acc.tolist(), ks))
    assert acc[0] == 3
    for i, k in enumerate(ks):
        if not (params[i].greedy or seeded):
            continue  # unseeded random rows share a generator: compared in distribution
        alone, a1 = rejection_sample(
            drafts[i : i + 1, :k],
            None,
            logits[i : i + 1, : k + 1],
            make_batch([params[i]], [outputs[i]]),
        )
        assert a1.item() == acc[i].item()
        assert out[i, : k + 1].tolist() == alone[0].tolist(), i
        assert (out[i, k + 1 :] == -1).all()


def test_ragged_rows_keep_the_target_distribution():
    # Rows with 1 and with 2 drafts in one batch: the first emitted token follows p_0 in both,
    # and a row whose drafts were all accepted draws its bonus at its own position k.
    n, v = 20000, 5
    gen = torch.Generator().manual_seed(1)
    target = torch.tensor([[1.0, 0.5, -0.3, 0.8, 0.0], [0.2, 1.1, 0.4, -0.5, 0.3], [0.0] * 5])
    logits = target.expand(n, 3, v).clone()
    drafts = torch.tensor([[3, 1]]).expand(n, 2)
    ks = [1 + i % 2 for i in range(n)]
    out, acc = rejection_sample(drafts, None, logits, make_batch([SP()] * n), gen, ks)
    p = torch.softmax(target, dim=-1)
    one = torch.tensor(ks) == 1
    for rows in (one, ~one):
        counts = torch.bincount(out[rows, 0], minlength=v).float()
        assert 0.5 * (counts / counts.sum() - p[0]).abs().sum() < 0.03
    # k = 1, draft accepted: the bonus at position 1 follows p_1 (not p_2, uniform).
    bonus = out[one & (acc == 1), 1]
    counts = torch.bincount(bonus, minlength=v).float()
    assert 0.5 * (counts / counts.sum() - p[1]).abs().sum() < 0.04
    assert (out[one, 2] == -1).all()


def test_verify_drafts_logprobs_match_plain_rows():
    gen = torch.Generator().manual_seed(2)
    v = 30
    rows = torch.randn(5, v, generator=gen)  # request a: 2 drafts (3 rows), b: 1 draft (2 rows)
    drafts = [[int(rows[0].argmax()), int(rows[1].argmax())], [int(rows[3].argmax())]]
    params = [SP(temperature=0, logprobs=2), SP(temperature=0, logprobs=0)]
    got = verify_drafts(rows, drafts, make_batch(params))
    assert got.num_accepted.tolist() == [2, 1]
    lp = got.logprobs.logprobs.view(2, 3)
    expected = torch.log_softmax(rows, dim=-1)
    assert lp[0].tolist() == [expected[j, int(rows[j].argmax())].item() for j in range(3)]
    assert lp[1, :2].tolist() == [expected[3 + j, int(rows[3 + j].argmax())].item() for j in (0, 1)]
    values, ids = got.logprobs.top_logprobs
    assert ids.view(2, 3, -1)[0, 2].tolist() == expected[2].topk(2).indices.tolist()
    with pytest.raises(ValueError):
        verify_drafts(rows, [[1, 2], []], make_batch(params))
    # processed mode: temperature and top-k shape the logprobs of random rows
    hot = [SP(temperature=0.5, top_k=3, logprobs=0)]
    got = verify_drafts(rows[:2], [[0]], make_batch(hot), generator=gen, logprobs_mode="processed")
    proc = torch.log_softmax(process_logits(rows[:2], make_batch(hot * 2)), dim=-1)
    t = got.token_ids[0, 0].item()
    assert got.logprobs.logprobs[0].item() == proc[0, t].item()


def test_runner_greedy_verification_equals_rejection_sampling(monkeypatch):
    """`ModelRunner.sample_with_drafts` on all-argmax rows (one read-back of every row's
    argmax, drafts accepted on the host) gives what the general path (the sampler for plain
    rows, `rejection_sample` for drafted ones) gives, ties included."""
    from moestream.runner import model_runner
    from moestream.runner.model_runner import ModelRunner
    from moestream.types import ScheduledRequest

    gen = torch.Generator().manual_seed(0)
    v = 50
    runner = ModelRunner.__new__(ModelRunner)  # only the sampling half: no model needed
    runner.device, runner.logits_processor = torch.device("cpu"), None
    runner.sampler = model_runner.Sampler()
    runner.reader = model_runner.HostReader(torch.device("cpu"))
    runner._last_batch = None
    for trial in range(20):
        ks = [int(k) for k in torch.randint(0, 5, (4,), generator=gen)]
        logits = torch.randn(sum(k + 1 for k in ks), v, generator=gen)
        logits[:, 7] = logits[:, 3] = logits.max() + 1  # ties go to the lower id in both paths
        logits[::2] = torch.randn(logits[::2].shape, generator=gen)
        best = logits.argmax(-1).tolist()
        reqs, row = [], 0
        for i, k in enumerate(ks):
            drafts = [(best[row + j] + (0 if (j + trial) % 3 else 1)) % v for j in range(k)]
            reqs.append(
                ScheduledRequest(f"r{i}", [1], 5, [0], True, drafts, SP(temperature=0), [1], [2])
            )
            row += k + 1
        fast = runner.sample_with_drafts(logits, reqs).sampled
        with monkeypatch.context() as m:
            m.setattr(model_runner, "argmax_only", lambda params: False)
            general = runner.sample_with_drafts(logits, reqs).sampled
        assert fast == general, (trial, ks)
