"""Prefill chunks of one sequence as CUDA graphs (runner/prefill_graph.py), on the CPU.

A fake forward with the attention kernels' contract (the sequence's new tokens are the last
`query_start_loc` run of its `seq_lens`; K/V written at slots >= 0 first, then each row reads
the cache through the block table up to its own position) runs through `PrefillGraphs` with a
backend that "replays" by recomputing into the captured output: chunks of many lengths, at
many starts, over tables that grow, give the eager forward's last-row logits and write exactly
the eager step's K/V. A second test runs the real layers on their kernel path (Triton
interpreter) with pad rows past the sequence's blocks, against the torch reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from moestream.layers.attention import AttentionMetadata
from moestream.runner.cuda_graph import RecomputeBackend
from moestream.runner.prefill_graph import PrefillGraphs, prefill_buckets

V, BS, MAX_BLOCKS, NUM_BLOCKS = 5, 4, 12, 40


class FakeModel:
    """Integer "cache" of slots; a row's output depends on its token, its position and every
    cached value it can see through its block table, so a wrong length, position, table or
    write order changes it. Checks the kernels' needs: real rows' positions follow the
    last-T-of-seq_lens rule, no row reads past its table or outside the pool."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randint(1, 100, (NUM_BLOCKS * BS,), generator=g)
        self.rows: list[int] = []

    def forward(self, ids, pos, attn: AttentionMetadata) -> torch.Tensor:
        n = ids.shape[0]
        self.rows.append(n)
        assert attn.num_seqs == 1
        n_q = int(attn.query_start_loc[1] - attn.query_start_loc[0])
        lens = int(attn.seq_lens[0])
        q_pos = lens - n_q + torch.arange(n)  # the position the kernel gives each row
        keep = attn.slot_mapping >= 0
        assert torch.equal(pos[keep], q_pos[keep]), "a real row's position breaks the T-last rule"
        self.kv[attn.slot_mapping[keep]] = (ids * 1000 + pos)[keep]  # writes before reads
        visible = (q_pos + 1).clamp(min=0) if lens > 0 else torch.zeros(n, dtype=torch.long)
        width = attn.block_tables.shape[1]
        assert (visible <= width * BS).all(), "a row reads past its block table"
        t = torch.arange(width * BS)
        seen = t[None, :] < visible[:, None]  # [N, L]
        block = attn.block_tables.long()[0][t // BS][None, :].expand(n, -1)  # [N, L]
        assert ((block >= 0) & (block < NUM_BLOCKS))[seen].all(), "a block id outside the pool"
        slot = (block * BS + t % BS).clamp(0, NUM_BLOCKS * BS - 1)
        context = (self.kv[slot] * (t + 1) * seen).sum(dim=1)  # [N] exact integers
        feature = ids * 7 + pos * 3 + context
        return feature[:, None].double() + torch.arange(V, dtype=torch.float64)[None, :]

    def prefill_forward(self, ids, pos, attn, rows) -> torch.Tensor:
        return self.forward(ids, pos, attn).index_select(0, rows)  # [1, V]


def test_prefill_buckets():
    assert prefill_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert prefill_buckets(300) == (16, 32, 64, 128, 256, 300)
    assert prefill_buckets(16) == (16,) and prefill_buckets(10) == (10,)
    assert prefill_buckets(1) == ()


def test_chunks_match_eager_last_row_and_kv_writes():
    rng = random.Random(5)
    model, backend = FakeModel(), RecomputeBackend()
    graphs = PrefillGraphs(model.prefill_forward, BS, MAX_BLOCKS, "cpu", (4, 8, 16), backend)
    assert graphs.table_width == MAX_BLOCKS + 4  # 15 pad positions past a full table
    for step in range(40):
        blocks = rng.sample(range(NUM_BLOCKS), MAX_BLOCKS)
        n = rng.randrange(2, 17)
        start = rng.randrange(MAX_BLOCKS * BS - n + 1)
        blocks = blocks[: -(-(start + n) // BS)]  # the table covers exactly what is fed
        ids = [rng.randrange(50) for _ in range(n)]
        kv_before = model.kv.clone()
        got = graphs.run(ids, start, blocks)
        kv_graph = model.kv.clone()
        model.kv.copy_(kv_before)
        attn = AttentionMetadata.build([(start, n, blocks)], BS, "cpu")
        ref = model.forward(torch.tensor(ids), torch.arange(start, start + n), attn)[-1:]
        assert torch.equal(got, ref), f"step {step}: n {n} start {start}"
        assert torch.equal(kv_graph, model.kv), f"step {step}: KV writes"
    assert graphs.captured == (4, 8, 16) and backend.captures == 3


def test_bounds_and_capture_on_padding_rows():
    model = FakeModel()
    graphs = PrefillGraphs(model.prefill_forward, BS, MAX_BLOCKS, "cpu", (4, 8), RecomputeBackend())
    assert graphs.bucket_for(1) is None and graphs.bucket_for(9) is None
    assert graphs.bucket_for(2) == 4 and graphs.bucket_for(5) == 8
    with pytest.raises(ValueError, match="no prefill graph"):
        graphs.run(list(range(9)), 0, [0, 1, 2])
    with pytest.raises(ValueError, match="do not cover"):
        graphs.run([1, 2, 3], 2, [0])
    kv = model.kv.clone()
    with torch.inference_mode():
        graphs.seq_lens.fill_(9)
        graphs.slot_mapping.fill_(5)  # stale values from an earlier step
        graphs._capture(8)
    assert model.rows == [8] and torch.equal(model.kv, kv)
    with pytest.raises(ValueError, match="increasing"):
        PrefillGraphs(model.prefill_forward, BS, 4, "cpu", (8, 4), RecomputeBackend())


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels through the Triton interpreter on CPU tensors; on a GPU the "
    "engine test in test_cuda_graph.py runs the compiled path",
)
def test_kernel_path_prefill_replay_matches_reference(monkeypatch):
    """The CUDA prefill-graph path on the CPU: the layers' Triton kernels under the interpreter
    (fused norms, q/k-norm + RoPE + KV write, paged prefill attention over `for_verify`
    metadata), merged QKV, a 13-token chunk after 9 cached tokens replayed as the 16-row bucket
    (its pad rows' keys past the sequence's blocks, in the spare columns): the last row's
    logits and the K/V written match the torch reference forward of the eager chunk."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.cli import DEMO_DRAFT
    from moestream.layers import attention, norm
    from moestream.layers.linear import fuse_linears
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_DRAFT))
    model.layers = model.layers[:2]
    bs, cached, n, table = 16, 9, 13, [3, 7]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 4000, (cached + n,), generator=g)
    ref_kv, kv = model.make_kv_cache(8, bs), model.make_kv_cache(8, bs)
    with torch.inference_mode():
        first = AttentionMetadata.build([(0, cached, table)], bs, "cpu")
        model.forward(prompt[:cached], torch.arange(cached), first, ref_kv)
        for i in range(len(kv.k)):
            kv.k[i].copy_(ref_kv.k[i])
            kv.v[i].copy_(ref_kv.v[i])
        chunk = AttentionMetadata.build([(cached, n, table)], bs, "cpu")
        hidden = model.forward(prompt[cached:], torch.arange(cached, cached + n), chunk, ref_kv)
        ref = model.compute_logits(hidden[-1:])  # [1, V]
    for module in (norm, attention):
        monkeypatch.setattr(module, "on_kernel_path", lambda x: True)
    for layer in model.layers:
        layer.attn.projections = fuse_linears([p for p, _ in layer.attn.projections])

    def forward(ids, pos, attn, rows):
        assert attn.query_lens_cpu is None and attn.max_query_len == 16  # device data only
        return model.compute_logits(model.forward(ids, pos, attn, kv).index_select(0, rows))

    graphs = PrefillGraphs(forward, bs, 2, "cpu", (16,), RecomputeBackend())
    out = graphs.run(prompt[cached:].tolist(), cached, table)
    assert graphs.captured == (16,)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for i in range(len(kv.k)):  # pad rows wrote nothing
        torch.testing.assert_close(kv.k[i], ref_kv.k[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[i], ref_kv.v[i], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels through the Triton interpreter on CPU tensors; on a GPU the "
    "engine test in test_cuda_graph.py runs the compiled path",
)
def test_engine_with_prefill_graphs_matches_eager(monkeypatch):
    """The engine with prefill graphs (replayed by recomputation) on the demo model's attention
    and norm kernels (interpreter; two of its layers): a prompt chunked by a 32-token budget (a
    chunk that is not sampled, one that is) and a prompt whose first blocks hit the prefix
    cache (a chunk that starts past 0): greedy tokens identical to the same engine without
    prefill graphs, and the graph steps did run."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream import LLM, SamplingParams
    from moestream.cli import DEMO_MODEL
    from moestream.layers import attention, norm
    from moestream.runner.prefill_graph import build_prefill_graphs

    for module in (norm, attention):
        monkeypatch.setattr(module, "on_kernel_path", lambda x: True)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(10, 3000, (45,), generator=g).tolist()
    prompts = [first, first[:32] + torch.randint(10, 3000, (9,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(graphs: bool) -> tuple[list[list[int]], tuple[int, ...], int]:
        llm = LLM(DEMO_MODEL, device="cpu", max_num_batched_tokens=32, kv_cache_gib=0.05)
        runner = llm.engine.runner
        runner.model.layers = runner.model.layers[:2]  # the interpreter is slow
        if graphs:
            runner.prefill_graphs = build_prefill_graphs(
                runner.model, runner.kv, runner.block_size, 32, RecomputeBackend()
            )
        outs = [llm.generate([p], params)[0] for p in prompts]  # one request a step
        captured = runner.prefill_graphs.captured if graphs else ()
        return [o.token_ids for o in outs], captured, outs[1].num_cached_tokens

    eager, _, _ = run(False)
    replayed, captured, cached = run(True)
    assert replayed == eager and cached == 32
    assert captured == (16, 32)  # 32-token chunk; 13-token tail and the 9 tokens past the hit
