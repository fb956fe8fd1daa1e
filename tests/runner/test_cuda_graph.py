"""Decode CUDA graphs (runner/cuda_graph.py).

CPU tests drive `DecodeGraphs` with a fake forward and a backend that "replays" by recomputing
into the captured output buffer, which is what a CUDA graph does to its static buffers: they
check bucketing, padding rows (no KV write, no attention), the copy into static inputs, lazy
capture per bucket and the runner's choice of steps. GPU tests (marked) run a tiny synthesized
Qwen3-MoE through the engine with and without graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernel-path test below runs Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

from moestream.layers.attention import SHORT_DECODE_CONTEXT, AttentionMetadata
from moestream.runner.cuda_graph import BUCKETS, DecodeGraphs, RecomputeBackend, decode_graphs_for

V, BS, MAX_BLOCKS = 11, 4, 6


class FakeModel:
    """A decode forward with the kernels' contract: K/V written at slots >= 0 only; logits of a
    row depend on its token, position, length and the blocks its length covers; rows of length
    0 read nothing."""

    def __init__(self) -> None:
        self.kv = torch.zeros(64)  # flat "cache" of slots
        self.calls: list[int] = []

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, attn: AttentionMetadata):
        self.calls.append(ids.shape[0])
        keep = attn.slot_mapping >= 0
        self.kv[attn.slot_mapping[keep]] = (ids * 1000 + pos)[keep].float()
        cols = torch.arange(attn.block_tables.shape[1])
        used = cols[None, :] < (attn.seq_lens[:, None] + BS - 1) // BS  # [B, nb]
        blocks = (attn.block_tables * used).sum(dim=1)  # [B]
        row = ids * 7 + pos * 3 + attn.seq_lens * 5 + blocks * 11  # [B]
        return row[:, None].float() + torch.arange(V).float()[None, :]  # [B, V]


def decode_inputs(n: int, seed: int, width: int | None = None):
    """Inputs of one decode step for n sequences: distinct slots, block tables of `width` (the
    widest sequence's blocks, as the runner builds them)."""
    g = torch.Generator().manual_seed(seed)
    width = width or MAX_BLOCKS
    seq_lens = torch.randint(1, BS * min(width, MAX_BLOCKS) + 1, (n,), generator=g)
    seq_lens = seq_lens.to(torch.int32)
    tables = torch.randint(0, 16, (n, width), generator=g, dtype=torch.int32)
    slots = torch.randperm(64, generator=g)[:n]
    ids = torch.randint(0, 50, (n,), generator=g)
    return ids, (seq_lens - 1).long(), tables, seq_lens, slots


def eager(model: FakeModel, ids, pos, tables, seq_lens, slots) -> torch.Tensor:
    qsl = torch.arange(ids.shape[0] + 1, dtype=torch.int32)
    attn = AttentionMetadata.for_decode(seq_lens, tables[:, :MAX_BLOCKS], slots, qsl, BS)
    return model.forward(ids, pos, attn)


def test_padded_replay_matches_eager_and_writes_only_real_slots():
    model, backend = FakeModel(), RecomputeBackend()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=backend)
    # Batch sizes in an order that reuses buckets with fewer rows than before (stale rows).
    for step, n in enumerate([8, 3, 1, 5, 2, 32, 9, 4, 3, 16, 31]):
        inputs = decode_inputs(n, seed=step, width=1 + step % MAX_BLOCKS)
        kv_before = model.kv.clone()
        logits = graphs.run(*inputs)
        written = (model.kv != kv_before).nonzero().flatten().sort().values
        assert written.tolist() == sorted(inputs[4].tolist()), f"step {step}: KV writes"
        fresh = FakeModel()
        fresh.kv.copy_(kv_before)
        ref = eager(fresh, *inputs)
        assert logits.shape == (n, V) and torch.equal(logits, ref), f"step {step}"
        assert torch.equal(model.kv, fresh.kv)
    assert backend.captures == 6  # buckets 1, 2, 4, 8, 16, 32, each captured once
    assert graphs.captured == BUCKETS


def test_run_decode_from_host_lists_matches_eager():
    """`run_decode` takes each step's token ids, positions and block lists; it rewrites and
    copies only the block-table rows that changed (a list grown in place, another request's
    list in the row, rows moved, tables written by `run`). Every step matches the eager
    forward, writes only the real rows' slots, and the static tables equal the requests'."""
    model, backend = FakeModel(), RecomputeBackend()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=backend)
    rng = torch.Generator().manual_seed(5)
    free = list(range(16))
    live: dict[int, tuple[list[int], int]] = {}  # request -> (block list, next position)
    next_id = 0
    for step in range(40):
        # Requests finish and arrive, so sequences change rows; tables grow in place.
        for rid in list(live):
            if torch.rand(1, generator=rng).item() < 0.15:
                free += live.pop(rid)[0]
        while len(live) < 1 + step % 9 and len(free) >= 2:
            blocks = [free.pop(int(torch.randint(len(free), (1,), generator=rng)))]
            live[next_id] = (blocks, int(torch.randint(BS, (1,), generator=rng)))
            next_id += 1
        order = list(live)
        if step % 3 == 0:
            order.reverse()
        for rid in order:
            blocks, pos = live[rid]
            if pos == len(blocks) * BS and len(blocks) < MAX_BLOCKS and free:
                blocks.append(free.pop())  # the same list object, one block longer
            if pos == len(blocks) * BS:
                free += blocks  # full: the request ends
                del live[rid]
        order = [r for r in order if r in live]
        if not order:
            continue
        ids = torch.randint(0, 50, (len(order),), generator=rng)
        pos = [live[r][1] for r in order]
        tables = [live[r][0] for r in order]
        seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
        slots = torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(tables, pos)])
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        model.kv.fill_(-1.0)  # (the fake's logits do not read it) so that every write shows
        if step % 7 == 6:  # tensor-fed steps write the device tables behind the host's back
            graphs.run(*decode_inputs(len(order) + 1, seed=step))
            model.kv.fill_(-1.0)
        kv_before = model.kv.clone()
        with torch.inference_mode():
            logits = graphs.run_decode(ids.tolist(), pos, tables)
        written = (model.kv != kv_before).nonzero().flatten().sort().values
        assert written.tolist() == sorted(slots.tolist()), f"step {step}: KV writes"
        fresh = FakeModel()
        fresh.kv.copy_(kv_before)
        ref = eager(fresh, ids, torch.tensor(pos), padded, seq_lens, slots)
        assert torch.equal(logits, ref), f"step {step}"
        for i, t in enumerate(tables):
            assert graphs.block_tables[i, : len(t)].tolist() == t, f"step {step} row {i}"
        for r in order:
            blocks, p = live[r]
            live[r] = (blocks, p + 1)
    # Each (bucket, context class) captured once: `run` takes the long-context graph.
    assert backend.captures == len(graphs.captured_decode) >= 4


def test_dropped_graphs_are_captured_anew_and_replay_the_same_logits():
    """`drop` (for a change the graphs hold as nodes) forgets every graph: the next step of a
    bucket captures again, and its logits are the eager ones as before."""
    model, backend = FakeModel(), RecomputeBackend()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=backend)
    inputs = decode_inputs(3, seed=1)
    first = graphs.run(*inputs).clone()
    graphs.run(*inputs)
    assert backend.captures == 1 and graphs.captured == (4,)
    graphs.drop()
    assert graphs.num_captured == 0 and graphs.captured == ()
    assert torch.equal(graphs.run(*inputs), first)
    assert backend.captures == 2 and graphs.captured == (4,)


def test_decode_graphs_per_context_class():
    """A decode step whose contexts all fit SHORT_DECODE_CONTEXT replays the bucket's short
    graph (its metadata bounds seq_lens, so attention keeps the least split count); a longer
    one the other graph. Both are captured once and give the eager logits."""
    bound = SHORT_DECODE_CONTEXT
    bs, max_blocks = 256, -(-(bound + 64) // 256)
    seen: list[int | None] = []

    class Recording(FakeModel):
        def forward(self, ids, pos, attn):
            seen.append(attn.max_seq_len)
            return super().forward(ids, pos, attn)

    model, backend = Recording(), RecomputeBackend()
    model.kv = torch.zeros(bs * max_blocks)
    graphs = DecodeGraphs(model.forward, bs, max_blocks, "cpu", backend=backend)
    tables = [list(range(max_blocks))]
    with torch.inference_mode():
        for p in (5, bound - 1, bound, 7):  # short, short (the last that fits), long, short
            graphs.run_decode([3], [p], tables)
    assert graphs.captured_decode == ((1, False), (1, True))
    assert backend.captures == 2
    # capture then replay per step: short, replay, long capture + replay, replay
    assert seen == [bound, bound, bound, None, None, bound]


def test_static_inputs_are_aligned_views_of_one_buffer():
    """Rows for the largest graph (decode 5 x 1, verify 2 x 6 = 12), sequences for the larger
    batch, table columns for 7 blocks plus the 5 positions verify pad rows reach past them."""
    backend = RecomputeBackend()
    graphs = DecodeGraphs(
        FakeModel().forward, BS, 7, "cpu", buckets=(1, 3, 5), backend=backend,
        verify_buckets=(1, 2), verify_tokens=(2, 6),
    )  # fmt: skip
    fields = {
        "input_ids": (torch.int64, (12,)),
        "positions": (torch.int64, (12,)),
        "slot_mapping": (torch.int64, (12,)),
        "sample_rows": (torch.int64, (12,)),
        "seq_lens": (torch.int32, (5,)),
        "block_tables": (torch.int32, (5, 9)),
    }
    storage = graphs.input_ids.untyped_storage().data_ptr()
    for name, (dtype, shape) in fields.items():
        t = getattr(graphs, name)
        assert t.dtype == dtype and t.shape == shape and t.is_contiguous(), name
        assert t.data_ptr() % 16 == 0, name
        assert t.untyped_storage().data_ptr() == storage, name
    assert (graphs.slot_mapping == -1).all()


def test_capture_runs_on_padding_rows_only():
    """Warm-up/capture runs see every row padded: the KV cache is never touched by them."""
    model = FakeModel()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend())
    with torch.inference_mode():  # as the runner steps
        graphs.seq_lens.fill_(9)
        graphs.slot_mapping.fill_(5)  # stale values from an earlier step
        graphs._capture(4)
    assert model.calls == [4] and not model.kv.any()


def test_wide_block_tables_are_cut_to_max_blocks():
    model = FakeModel()
    graphs = DecodeGraphs(model.forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend())
    ids, pos, tables, seq_lens, slots = decode_inputs(3, seed=1, width=MAX_BLOCKS + 3)
    logits = graphs.run(ids, pos, tables, seq_lens, slots)
    assert torch.equal(logits, eager(FakeModel(), ids, pos, tables, seq_lens, slots))


def test_bucket_for_and_can_run():
    graphs = DecodeGraphs(FakeModel().forward, BS, MAX_BLOCKS, "cpu", backend=RecomputeBackend())
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="1 .. 32"):
        graphs.bucket_for(33)
    decode = AttentionMetadata.build([(5, 1, [0, 1]), (0, 1, [2])], BS, "cpu")
    prefill = AttentionMetadata.build([(5, 1, [0, 1]), (0, 3, [2])], BS, "cpu")
    assert decode.is_decode and not prefill.is_decode
    assert graphs.can_run(decode, num_sampled=2)
    assert not graphs.can_run(decode, num_sampled=1)  # a request that is not sampled
    assert not graphs.can_run(prefill, num_sampled=2)
    many = AttentionMetadata.build([(0, 1, [i]) for i in range(33)], BS, "cpu")
    assert not graphs.can_run(many, num_sampled=33)
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphs(FakeModel().forward, BS, MAX_BLOCKS, "cpu", buckets=(4, 2))


def test_capture_runs_with_the_garbage_collector_off(monkeypatch):
    """CudaGraphBackend.capture (CUDA's calls faked): the warm-up runs with the collector as it
    was, the captured call with it off (collecting an unreachable graph there would destroy its
    executable and invalidate the capture), and the collector is on again after, also when the
    captured call raises."""
    import contextlib
    import gc

    from moestream.runner import cuda_graph

    class Graph:
        def replay(self) -> None:
            pass

    fake = {
        "Stream": lambda device: type("S", (), {"wait_stream": lambda self, other: None})(),
        "stream": lambda s: contextlib.nullcontext(),
        "current_stream": lambda device: type("S", (), {"wait_stream": lambda self, o: None})(),
        "CUDAGraph": Graph,
        "graph": lambda graph, pool, capture_error_mode: contextlib.nullcontext(),
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    backend = cuda_graph.CudaGraphBackend.__new__(cuda_graph.CudaGraphBackend)
    backend.device, backend.pool = torch.device("cpu"), None
    seen = []

    def fn() -> torch.Tensor:
        seen.append(gc.isenabled())
        return torch.zeros(1)

    assert gc.isenabled()
    backend.capture(fn)
    assert seen == [True, False] and gc.isenabled()

    def fails() -> torch.Tensor:
        if len(seen) == 3:
            raise RuntimeError("capture failed")
        seen.append(gc.isenabled())
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="capture failed"):
        backend.capture(fails)
    assert gc.isenabled()


def test_no_graphs_on_cpu():
    """A CPU model cannot be captured: the runner stays eager (and nothing needs CUDA)."""
    from moestream.cli import DEMO_MODEL
    from moestream.models.registry import build_model
    from moestream.runner.model_runner import ModelRunner
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_MODEL))
    kv = model.make_kv_cache(4, BS)
    assert not model.supports_cuda_graphs
    assert decode_graphs_for(model, kv, BS) is None
    assert ModelRunner(model, kv, BS, torch.device("cpu")).graphs is None


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels through the Triton interpreter on CPU tensors; on a GPU the "
    "compiled path is checked by the GPU tests here and by bench/decode_gpu.py",
)
def test_kernel_path_decode_replay_matches_reference(monkeypatch):
    """The CUDA decode path on the CPU: the layers' Triton kernels under the interpreter (fused
    norms, q/k-norm + RoPE + KV write, paged decode attention), merged QKV, metadata
    from `for_decode` with padding rows, replayed through DecodeGraphs; logits and the K/V
    written match the torch reference forward."""
    pytest.importorskip("triton", reason="triton is not installed")
    from moestream.cli import DEMO_DRAFT
    from moestream.layers import attention, norm
    from moestream.layers.linear import fuse_linears
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    # The demo draft (dense Qwen3, q/k norms, Q8_0: cheap reference matmuls); the routing
    # kernel has its own tests. Two layers show the chaining; the interpreter is slow.
    model = build_model(open_model(DEMO_DRAFT))
    model.layers = model.layers[:2]
    bs, lens = 16, [9, 30, 17]  # context after the decode token; bucket 4 pads one row
    tables = [[3, 7], [0, 5], [2, 6]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g) for n in lens]

    def prefill(kv) -> None:
        with torch.inference_mode():
            for i, p in enumerate(prompts):  # prompt minus its last token, one sequence a step
                attn = AttentionMetadata.build([(0, lens[i] - 1, tables[i])], bs, "cpu")
                model.forward(p[:-1], torch.arange(lens[i] - 1), attn, kv)

    step = AttentionMetadata.build([(n - 1, 1, tables[i]) for i, n in enumerate(lens)], bs, "cpu")
    ids = torch.stack([p[-1] for p in prompts])
    pos = torch.tensor([n - 1 for n in lens])
    ref_kv, kv = model.make_kv_cache(8, bs), model.make_kv_cache(8, bs)
    prefill(ref_kv)
    for i in range(len(kv.k)):
        kv.k[i].copy_(ref_kv.k[i])
        kv.v[i].copy_(ref_kv.v[i])
    with torch.inference_mode():
        ref = model.compute_logits(model.forward(ids, pos, step, ref_kv))
    for module in (norm, attention):
        monkeypatch.setattr(module, "on_kernel_path", lambda x: True)
    for layer in model.layers:
        layer.attn.projections = fuse_linears([p for p, _ in layer.attn.projections])
    assert len(model.layers[0].attn.projections) < 3  # something was merged

    def forward(ids, pos, attn):
        return model.compute_logits(model.forward(ids, pos, attn, kv))

    graphs = DecodeGraphs(forward, bs, 4, "cpu", backend=RecomputeBackend())
    out = graphs.run(ids, pos, step.block_tables, step.seq_lens, step.slot_mapping)
    assert graphs.captured == (4,)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for i in range(len(kv.k)):
        torch.testing.assert_close(kv.k[i], ref_kv.k[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[i], ref_kv.v[i], rtol=1e-5, atol=1e-5)


# ---- GPU --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from moestream.weights.synth import synth_gguf

    path = tmp_path_factory.mktemp("graphs") / "tiny-qwen3-moe.gguf"
    return synth_gguf("tiny-qwen3-moe", "Q4_K_M", path, progress=False)


def _greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from moestream import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.gpu
@gpu
def test_engine_graphs_match_eager(tiny_gguf):
    """Greedy tokens are identical with and without graphs at batch sizes on and off buckets."""
    from moestream import LLM

    graph_llm = LLM(tiny_gguf, device="cuda", kv_cache_gib=0.25, enable_prefix_caching=False)
    eager_llm = LLM(
        tiny_gguf, device="cuda", kv_cache_gib=0.25, enable_prefix_caching=False,
        enforce_eager=True,
    )  # fmt: skip
    assert graph_llm.engine.runner.graphs is not None and eager_llm.engine.runner.graphs is None
    for batch in (1, 3, 8):
        prompts = [[(7 * i + 13 * j) % 4000 + 5 for j in range(20 + 9 * i)] for i in range(batch)]
        assert _greedy(graph_llm, prompts, 24) == _greedy(eager_llm, prompts, 24), batch
    assert {1, 4, 8} <= set(graph_llm.engine.runner.graphs.captured)
    # the lone 20-token prompt ran as the 32-token prefill graph; batched prompts ran eagerly
    assert graph_llm.engine.runner.prefill_graphs.captured == (32,)


@pytest.mark.gpu
@gpu
def test_replayed_logits_equal_eager_logits(tiny_gguf):
    """One decode step through DecodeGraphs.run against the eager forward on the same KV cache
    contents: the same logits (same kernels, same shapes at a bucket size)."""
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(tiny_gguf), "cuda", torch.bfloat16)
    assert model.supports_cuda_graphs
    kv = model.make_kv_cache(64, 16)
    graphs = decode_graphs_for(model, kv, 16)
    lens = [5, 40, 17, 1]
    tables = [[4 * i + j for j in range(4)] for i in range(4)]
    prefill = AttentionMetadata.build(
        [(0, n - 1, tables[i]) for i, n in enumerate(lens) if n > 1], 16, "cuda"
    )
    total = sum(n - 1 for n in lens)
    ids = torch.randint(5, 4000, (total,), device="cuda")
    pos = torch.cat([torch.arange(n - 1) for n in lens if n > 1]).cuda()
    with torch.inference_mode():
        model.forward(ids, pos, prefill, kv)
        step = AttentionMetadata.build(
            [(n - 1, 1, tables[i]) for i, n in enumerate(lens)], 16, "cuda"
        )
        new_ids = torch.randint(5, 4000, (4,), device="cuda")
        new_pos = torch.tensor([n - 1 for n in lens], device="cuda")
        k_saved, v_saved = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
        eager = model.compute_logits(model.forward(new_ids, new_pos, step, kv))
        for i in range(len(kv.k)):
            kv.k[i].copy_(k_saved[i])
            kv.v[i].copy_(v_saved[i])
        replayed = graphs.run(new_ids, new_pos, step.block_tables, step.seq_lens, step.slot_mapping)
    # Bitwise equal when cuBLAS picks the same router GEMM inside the capture (bench/decode_gpu.py
    # reports it); required: the same argmax and differences within bf16 rounding.
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    assert (replayed - eager).abs().max() <= 0.02 * eager.abs().max()


@pytest.mark.gpu
@gpu
def test_verify_replay_matches_eager(tiny_gguf):
    """One verify step (drafts 0, 1, 3, 2: K = 4, bucket 4) through DecodeGraphs.run_verify
    against the eager forward on the same KV cache contents: the same argmax and logits within
    bf16 rounding (the row counts differ: 10 eager, 16 in the graph; without --deterministic a
    matmul may pick other tiles), and the same K/V written."""
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(tiny_gguf), "cuda", torch.bfloat16)
    kv = model.make_kv_cache(64, 16)
    graphs = decode_graphs_for(model, kv, 16)
    assert graphs is not None
    lens, drafts = [5, 40, 17, 31], [[], [7], [8, 9, 10], [11, 12]]  # cached, then fed
    tables = [[4 * i + j for j in range(4)] for i in range(4)]
    prefill = AttentionMetadata.build([(0, n, tables[i]) for i, n in enumerate(lens)], 16, "cuda")
    ids = torch.randint(5, 4000, (sum(lens),), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lens]).cuda()
    last = [int(t) for t in torch.randint(5, 4000, (4,))]
    with torch.inference_mode():
        model.forward(ids, pos, prefill, kv)
        step = AttentionMetadata.build(
            [(n, len(d) + 1, tables[i]) for i, (n, d) in enumerate(zip(lens, drafts))], 16, "cuda"
        )
        new_ids = torch.tensor([t for t, d in zip(last, drafts) for t in [t, *d]], device="cuda")
        new_pos = torch.tensor(
            [p for n, d in zip(lens, drafts) for p in range(n, n + len(d) + 1)], device="cuda"
        )
        k_saved, v_saved = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
        eager = model.compute_logits(model.forward(new_ids, new_pos, step, kv))  # [10, V]
        k_eager, v_eager = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
        for i in range(len(kv.k)):
            kv.k[i].copy_(k_saved[i])
            kv.v[i].copy_(v_saved[i])
        replayed = graphs.run_verify(last, drafts, lens, tables)
    assert graphs.captured_verify == ((4, 4),)
    assert replayed.shape == eager.shape
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    assert (replayed - eager).abs().max() <= 0.02 * eager.abs().max()
    for i in range(len(kv.k)):
        torch.testing.assert_close(kv.k[i], k_eager[i], rtol=0.02, atol=0.02)
        torch.testing.assert_close(kv.v[i], v_eager[i], rtol=0.02, atol=0.02)


@pytest.mark.gpu
@gpu
def test_engine_verify_graphs_match_eager(tiny_gguf):
    """Speculative greedy decode (n-gram drafts every step) on a copy-heavy prompt, in
    batch-invariant mode (--deterministic: every row's bits independent of the batch, so the
    padded graph rows cannot change them): the same tokens with verify graphs as eager, and
    the verify graphs ran."""
    from moestream import LLM
    from moestream.spec.base import SpecConfig

    spec = SpecConfig(mode="ngram", max_k=7, always=True)
    kw = dict(device="cuda", kv_cache_gib=0.25, enable_prefix_caching=False, deterministic=True)
    graph_llm = LLM(tiny_gguf, speculative=spec, **kw)
    eager_llm = LLM(tiny_gguf, speculative=spec, enforce_eager=True, **kw)
    unit = [(11 * j) % 4000 + 5 for j in range(12)]
    prompts = [unit * 6, (unit[3:] + unit[:3]) * 5, [9, 10, 11] * 10]
    got = _greedy(graph_llm, prompts, 40)
    assert got == _greedy(eager_llm, prompts, 40)
    assert graph_llm.engine.runner.graphs.captured_verify
    assert graph_llm.engine.spec_stats()["total"]["draft_tokens"] > 0


def test_host_table_types_block_capture_only_off_the_kernels(monkeypatch):
    """IQ4_NL, IQ4_XS and MXFP4 dequantize through a value table built on the host in torch,
    which a CUDA graph cannot capture, but the Triton kernels unpack them in registers: a layer
    with such weights is capturable exactly where the kernels take them."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    import moestream.layers.linear as linear_mod
    from moestream.weights.qtensor import QTensor

    def weight(qtype, k=256):
        block, size = GGML_QUANT_SIZES[qtype]
        return QTensor(torch.zeros(4, k // block * size, dtype=torch.uint8), qtype, (4, k))

    for qtype in (Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4):
        assert linear_mod.needs_host_table(weight(qtype))  # on the CPU: the torch reference
    assert not linear_mod.needs_host_table(weight(Q.Q4_K))
    from moestream.kernels import ops

    # as for a weight on a CUDA device: the type decides
    monkeypatch.setattr(linear_mod, "kernel_weight", lambda w: w.qtype in ops.KERNEL_QTYPES)
    monkeypatch.setattr(linear_mod, "HAS_TRITON", True)
    assert not linear_mod.needs_host_table(weight(Q.IQ4_XS))
    assert linear_mod.needs_host_table(weight(Q.NVFP4, 64))  # no kernel unpacks NVFP4


def test_capture_state_is_the_threads_own() -> None:
    """`captured_phase` names the phase a graph captured now will run ("decode" unless inside
    `capturing_phase`), per thread: a server's engine thread capturing a prefill graph does not
    change what another thread's capture counts as."""
    import threading

    from moestream.runner.cuda_graph import captured_phase, capturing_phase, warming_up

    assert captured_phase() == "decode" and not warming_up()
    seen = []
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with capturing_phase("prefill"):
            seen.append(captured_phase())
            inside.set()
            release.wait(5)
        seen.append(captured_phase())

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    assert captured_phase() == "decode"  # this thread's own
    release.set()
    t.join()
    assert seen == ["prefill", "decode"]
    with capturing_phase("prefill"):
        assert captured_phase() == "prefill"
    assert captured_phase() == "decode"
