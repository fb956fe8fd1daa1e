"""Verify steps (K tokens per sequence) as CUDA graphs (runner/cuda_graph.py), on the CPU.

A fake forward with the attention kernels' contract (each sequence's new tokens are the last
`query_start_loc` run of its `seq_lens`; K/V written at slots >= 0 first, then each row reads
the cache through the block table up to its own position) runs through `DecodeGraphs` with a
backend that "replays" by recomputing into the captured output. Verify steps of mixed draft
counts interleave with decode steps while requests arrive and finish and tables grow: every
step's real rows equal the eager forward's rows (in the verifier's order), and the cache
holds exactly what the eager step writes. A second test runs the real layers on their kernel
path (Triton interpreter: q/k-norm + RoPE + KV write, paged prefill attention) with padding
rows and padding sequences against the torch reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from moestream.layers.attention import AttentionMetadata
from moestream.runner.cuda_graph import DecodeGraphs, RecomputeBackend

V, BS, MAX_BLOCKS, NUM_BLOCKS = 5, 4, 5, 32


class FakeModel:
    """A forward with the kernels' contract over an integer "cache" of slots: a row's logits
    are a function of its token, its position and every cached value it can see (positions
    0 .. its own, through its sequence's block table), so a wrong length, position, table or
    write order changes them. It checks what the kernels need: real rows' positions agree with
    the last-K-of-seq_lens rule, and no row reads past its table or outside the pool."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randint(1, 100, (NUM_BLOCKS * BS,), generator=g)
        self.rows: list[int] = []

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata):
        n = ids.shape[0]
        self.rows.append(n)
        qsl = attn.query_start_loc.long()
        row = torch.arange(n)
        seq = torch.searchsorted(qsl[1:], row, right=True)  # [N] sequence of each row
        n_q = (qsl[1:] - qsl[:-1])[seq]
        lens = attn.seq_lens.long()[seq]
        q_pos = lens - n_q + row - qsl[seq]  # [N] the position the kernel gives each row
        keep = attn.slot_mapping >= 0
        assert torch.equal(pos[keep], q_pos[keep]), "a real row's position breaks the K-last rule"
        self.kv[attn.slot_mapping[keep]] = (ids * 1000 + pos)[keep]  # writes before reads
        visible = torch.where(lens > 0, q_pos + 1, 0).clamp(min=0)  # [N]
        width = attn.block_tables.shape[1]
        assert (visible <= width * BS).all(), "a row reads past its block table"
        t = torch.arange(width * BS)  # context positions
        table = attn.block_tables.long()[seq]  # [N, nb]
        seen = t[None, :] < visible[:, None]  # [N, L]
        block = table.gather(1, (t // BS)[None, :].expand(n, -1))  # [N, L]
        assert ((block >= 0) & (block < NUM_BLOCKS))[seen].all(), "a block id outside the pool"
        slot = (block * BS + t % BS).clamp(0, NUM_BLOCKS * BS - 1)
        context = (self.kv[slot] * (t + 1) * seen).sum(dim=1)  # [N] exact integers
        feature = ids * 7 + pos * 3 + context
        return feature[:, None].double() + torch.arange(V, dtype=torch.float64)[None, :]


def eager_rows(model: FakeModel, steps: list[tuple[int, list[int], int, list[int]]]):
    """The eager forward of one step, (token, drafts, start, blocks) per sequence: its rows
    are the verifier's rows (each sequence's token, then its drafts)."""
    ids = [t for t, d, _, _ in steps for t in [t, *d]]
    pos = [p for _, d, s, _ in steps for p in range(s, s + len(d) + 1)]
    attn = AttentionMetadata.build([(s, len(d) + 1, b) for _, d, s, b in steps], BS, "cpu")
    return model.forward(torch.tensor(ids), torch.tensor(pos), attn)


def test_verify_and_decode_steps_match_eager():
    rng = random.Random(3)
    model, backend = FakeModel(), RecomputeBackend()
    graphs = DecodeGraphs(
        model.forward, BS, MAX_BLOCKS, "cpu", buckets=(1, 2, 4, 8), backend=backend,
        verify_buckets=(1, 2, 4), verify_tokens=(2, 4, 8),
    )  # fmt: skip
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    live: dict[int, tuple[list[int], int]] = {}  # request -> (block list, next position)
    next_id, kinds = 0, set()
    for step in range(60):
        for rid in list(live):
            if rng.random() < 0.1:
                free += live.pop(rid)[0]
        while len(live) < 1 + step % 6 and len(free) >= MAX_BLOCKS:
            live[next_id] = ([free.pop()], rng.randrange(BS))
            next_id += 1
        order = list(live)
        rng.shuffle(order)  # sequences change rows
        verify = step % 3 != 0
        most = rng.choice([1, 3, 7]) if verify else 0  # drafts: K = 2, 4 or 8
        steps = []
        for rid in order[: 4 if verify else 8]:
            blocks, start = live[rid]
            room = MAX_BLOCKS * BS - start
            drafts = [rng.randrange(50) for _ in range(rng.randrange(most + 1))]
            drafts = drafts[: max(0, room - 1)]
            while len(blocks) * BS < start + len(drafts) + 1:
                blocks.append(free.pop())  # the same list object, grown in place
            steps.append((rng.randrange(50), drafts, start, blocks))
        kv_before = model.kv.clone()
        tokens, drafts, starts, tables = (list(x) for x in zip(*steps))
        if any(drafts):
            got = graphs.run_verify(tokens, drafts, starts, tables)
            kinds.add(graphs.graph_for(len(steps), max(map(len, drafts)) + 1))
        else:
            with torch.inference_mode():
                got = graphs.run_decode(tokens, starts, tables)
        kv_graph = model.kv.clone()
        model.kv.copy_(kv_before)
        ref = eager_rows(model, steps)
        assert torch.equal(got, ref), f"step {step}"
        assert torch.equal(kv_graph, model.kv), f"step {step}: KV writes"
        for rid, (_, d, s, _) in zip(order, steps):  # accept a random prefix of the drafts
            blocks, _ = live[rid]
            live[rid] = (blocks, s + 1 + rng.randrange(len(d) + 1))
            if live[rid][1] >= MAX_BLOCKS * BS - 1:
                free += live.pop(rid)[0]
    assert len({k for _, k in kinds}) == 3 and len({b for b, _ in kinds}) >= 2, kinds
    assert set(graphs.captured_verify) == kinds
    assert backend.captures == len(graphs.captured) + len(kinds)


def test_graph_for_buckets_and_bounds():
    graphs = DecodeGraphs(FakeModel().forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend())
    assert graphs.graph_for(3, 1) == (4, 1) and graphs.graph_for(32, 1) == (32, 1)
    assert graphs.graph_for(33, 1) is None
    assert graphs.graph_for(1, 2) == (1, 2) and graphs.graph_for(3, 3) == (4, 4)
    assert graphs.graph_for(16, 16) == (16, 16) and graphs.graph_for(9, 5) == (16, 8)
    assert graphs.graph_for(17, 2) is None and graphs.graph_for(4, 17) is None
    assert graphs.table_width == MAX_BLOCKS + 4  # 15 pad positions past a full table, BS 4
    off = DecodeGraphs(
        FakeModel().forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend(), verify_tokens=()
    )
    assert off.graph_for(2, 2) is None and off.table_width == MAX_BLOCKS
    with pytest.raises(ValueError, match="verify_tokens"):
        DecodeGraphs(FakeModel().forward, BS, 4, "cpu", verify_tokens=(1, 2))
    with pytest.raises(ValueError, match="no verify graph"):
        graphs.run_verify([1] * 17, [[2]] * 17, [0] * 17, [[0]] * 17)


def test_verify_capture_runs_on_padding_rows_only():
    model = FakeModel()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend())
    kv = model.kv.clone()
    with torch.inference_mode():
        graphs.seq_lens.fill_(9)
        graphs.slot_mapping.fill_(5)  # stale values from an earlier step
        graphs._capture(2, 8)
    assert model.rows == [16] and torch.equal(model.kv, kv)
    assert graphs.captured_verify == ((2, 8),) and graphs.captured == ()


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels through the Triton interpreter on CPU tensors; on a GPU the "
    "compiled path is checked by the GPU tests in test_cuda_graph.py",
)
def test_kernel_path_verify_replay_matches_reference(monkeypatch):
    """The CUDA verify path on the CPU: the layers' Triton kernels under the interpreter (fused
    norms, q/k-norm + RoPE + KV write, paged prefill attention over `for_verify` metadata),
    merged QKV, replayed through DecodeGraphs.run_verify with pad rows (one of whose keys lie
    past its sequence's table, in the spare columns) and a padding sequence; the real rows'
    logits and the K/V written match the torch reference forward of the eager step."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.cli import DEMO_DRAFT
    from moestream.layers import attention, norm
    from moestream.layers.linear import fuse_linears
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_DRAFT))
    model.layers = model.layers[:2]
    bs = 16
    # (cached tokens, drafts, blocks): K = 4, bucket 4 (one padding sequence). The second's
    # pad rows sit at positions 32, 33, past its two blocks; the third crosses a block.
    seqs = [(9, [11], [3, 7]), (30, [], [0, 5]), (14, [40, 41, 42], [2, 6])]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n + 1,), generator=g) for n, _, _ in seqs]

    def prefill(kv) -> None:
        with torch.inference_mode():
            for (n, _, table), p in zip(seqs, prompts):
                attn = AttentionMetadata.build([(0, n, table)], bs, "cpu")
                model.forward(p[:-1], torch.arange(n), attn, kv)

    ids = torch.tensor([t for (_, d, _), p in zip(seqs, prompts) for t in [int(p[-1]), *d]])
    pos = torch.tensor([q for n, d, _ in seqs for q in range(n, n + len(d) + 1)])
    step = AttentionMetadata.build([(n, len(d) + 1, t) for n, d, t in seqs], bs, "cpu")
    ref_kv, kv = model.make_kv_cache(8, bs), model.make_kv_cache(8, bs)
    prefill(ref_kv)
    for i in range(len(kv.k)):
        kv.k[i].copy_(ref_kv.k[i])
        kv.v[i].copy_(ref_kv.v[i])
    with torch.inference_mode():
        ref = model.compute_logits(model.forward(ids, pos, step, ref_kv))  # [R, V]
    for module in (norm, attention):
        monkeypatch.setattr(module, "on_kernel_path", lambda x: True)
    for layer in model.layers:
        layer.attn.projections = fuse_linears([p for p, _ in layer.attn.projections])

    def forward(ids, pos, attn):
        assert attn.query_lens_cpu is None and attn.max_query_len == 4  # device data only
        return model.compute_logits(model.forward(ids, pos, attn, kv))

    graphs = DecodeGraphs(
        forward, bs, 2, "cpu", buckets=(1,), backend=RecomputeBackend(),
        verify_buckets=(4,), verify_tokens=(4,),
    )  # fmt: skip
    assert graphs.table_width == 3
    out = graphs.run_verify(
        [int(p[-1]) for p in prompts], [d for _, d, _ in seqs], [n for n, _, _ in seqs],
        [t for _, _, t in seqs],
    )  # fmt: skip
    assert graphs.captured_verify == ((4, 4),)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for i in range(len(kv.k)):  # pad rows and the padding sequence wrote nothing
        torch.testing.assert_close(kv.k[i], ref_kv.k[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[i], ref_kv.v[i], rtol=1e-5, atol=1e-5)
