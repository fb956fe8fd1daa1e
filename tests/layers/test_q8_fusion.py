"""Activations quantized by the norm: the q8 rounding (`Q8Act`) that the integer-dot matmuls
need is written by the norm kernel before them and carried on its output (`layers.norm.q8_of`),
instead of one `quantize_q8` launch per consumer. Results must not change by a bit.

Without CUDA the kernel path runs on the CPU through the Triton interpreter, with the
kernel-path switches forced on (as tests/runner/test_cuda_graph.py does); with CUDA the matmul
and MoE tests run on the device, and a GPU test runs the tiny Qwen3-MoE as the engine does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from moestream.kernels import mmvq, ops  # noqa: E402
from moestream.layers import attention, norm  # noqa: E402

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="forces the kernel path on CPU tensors (the interpreter)"
)


@pytest.mark.parametrize("rows", [1, 3])  # the mmvq and the mmq path
@pytest.mark.usefixtures("kernel_weights")
def test_quant_matmul_takes_the_norms_q8(monkeypatch, rows, device, quantized_weight):
    """quant_matmul with the norm's Q8Act gives the bits of quant_matmul without it (which
    quantizes for itself), in batch-invariant mode too; a Q8Act of other rows is refused."""
    from moestream.kernels.norm_rope import add_rms_norm_q8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 256, generator=g).to(device, torch.bfloat16)
    y, xa = add_rms_norm_q8(x, None, torch.randn(256, generator=g).to(device), 1e-6)
    w = quantized_weight((64, 256), "Q4_K", seed=1)
    assert ops.takes_q8(y, w)
    calls = []
    real = mmvq.quantize_q8
    monkeypatch.setattr(mmvq, "quantize_q8", lambda a: calls.append(a.shape) or real(a))
    assert torch.equal(ops.quant_matmul(y, w, xa), ops.quant_matmul(y, w))
    assert calls == [(rows, 256)]  # only the call without xa quantized
    with ops.batch_invariant():
        assert torch.equal(ops.quant_matmul(y, w, xa), ops.quant_matmul(y, w))
    with pytest.raises(ValueError, match="xa holds"):
        ops.quant_matmul(y[:1], w, xa if rows > 1 else mmvq.quantize_q8(x.repeat(2, 1)))


def test_q8_of_reads_only_the_norms_own_output():
    y = torch.zeros(2, 64)
    xa = mmvq.quantize_q8_ref(y)
    assert norm.q8_of(norm.with_q8(y, xa)) is xa
    assert norm.q8_of(y[:1]) is None and norm.q8_of(y + 0) is None
    assert norm.q8_of(norm.with_q8(torch.zeros(3, 64), xa)) is None  # rows differ


def greedy(model, kv, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefill the prompts (one sequence each, block i, one step) and decode `steps` tokens
    greedily for all of them together: (tokens per step, logits [S, V] per step)."""
    from moestream.layers.attention import AttentionMetadata

    device = model.device
    ids = [list(p) for p in prompts]
    starts = [0] * len(prompts)
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            seqs = [(s, len(i), [b]) for b, (s, i) in enumerate(zip(starts, ids, strict=True))]
            attn = AttentionMetadata.build(seqs, 16, device)
            flat = torch.tensor([t for i in ids for t in i], device=device)
            pos = torch.tensor([s + j for s, i in zip(starts, ids, strict=True)
                                for j in range(len(i))], device=device)  # fmt: skip
            hidden = model.forward(flat, pos, attn, kv)  # [T, H]
            last = model.compute_logits(hidden[attn.query_start_loc[1:].long() - 1])  # [S, V]
            logits.append(last)
            starts = [s + len(i) for s, i in zip(starts, ids, strict=True)]
            ids = [[t] for t in last.argmax(-1).tolist()]
            tokens.append([i[0] for i in ids])
    return tokens, logits


@interpreter_only
def test_model_on_the_kernel_path_is_unchanged_by_the_norms_q8(monkeypatch, quantize_q8_calls):
    """The tiny dense Qwen3 (Q8_0) with its layers' matmuls on the kernel path (fused norms;
    attention on its reference): a prefill of three prompts and a decode step of the three
    (MMQ: 3 rows; MMVQ's single rows are slow in the interpreter, and take the same Q8Act:
    `test_quant_matmul_takes_the_norms_q8`). The norms write the q8 rounding for Q/K/V (one
    merged projection) and for the FFN's gate and up, next_norm for the next layer's Q/K/V;
    logits and greedy tokens are bit for bit those of the run where every matmul quantizes
    for itself, with three `quantize_q8` launches fewer per layer and step (QKV, gate, up:
    o_proj's and down's are left)."""
    from moestream.cli import DEMO_DRAFT
    from moestream.layers import linear as linear_layer
    from moestream.layers.linear import fuse_linears
    from moestream.models.base import DecoderLayer
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_DRAFT), "cpu", torch.bfloat16)
    fast = set()  # the layers' weights take the kernels; the output head its reference
    for layer in model.layers:
        layer.attn.projections = fuse_linears([p for p, _ in layer.attn.projections])
        fast |= {id(p.weight) for p, _ in layer.attn.projections}
        fast |= {id(layer.attn.o_proj.weight), *(id(w) for w in (layer.ffn.gate, layer.ffn.up))}
        fast.add(id(layer.ffn.down))
    assert len(model.layers[0].attn.projections) == 1  # Q, K and V merged
    monkeypatch.setattr(norm, "on_kernel_path", lambda x: True)
    monkeypatch.setattr(linear_layer, "device_path", lambda x: True)
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: all(id(w) in fast for w in ws))
    calls = quantize_q8_calls
    prompts = [[11, 502, 77, 1234], [9, 4000, 310], [5, 6, 7, 8, 9]]

    def run() -> tuple[list[int], list[torch.Tensor], list[int]]:
        calls.clear()
        kv = model.make_kv_cache(3, 16)
        tokens, logits = greedy(model, kv, prompts, steps=1)
        return tokens, logits, list(calls)

    fused_tokens, fused_logits, fused_calls = run()
    monkeypatch.setattr(DecoderLayer, "attn_takes_q8", lambda self, x: False)
    monkeypatch.setattr(DecoderLayer, "ffn_takes_q8", lambda self, x: False)
    tokens, logits, plain_calls = run()
    assert fused_tokens == tokens
    for a, b in zip(fused_logits, logits, strict=True):
        assert torch.equal(a, b)
    steps, layers = 2, len(model.layers)
    assert len(plain_calls) == 5 * steps * layers  # QKV, o_proj, gate, up, down
    assert len(fused_calls) == 2 * steps * layers  # o_proj, down


@interpreter_only
def test_decode_attention_writes_o_projs_q8(monkeypatch, quantize_q8_calls):
    """The tiny dense Qwen3 with attention on the kernel path too (interpreter): in decode steps
    the attention kernel writes the q8 rounding of its output for o_proj, whose integer-dot
    GEMV then quantizes nothing; logits bit for bit those of the run where o_proj quantizes
    for itself, one `quantize_q8` launch fewer per layer and decode step."""
    from moestream.cli import DEMO_DRAFT
    from moestream.layers import linear as linear_layer
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_DRAFT), "cpu", torch.bfloat16)
    fast = {id(layer.attn.o_proj.weight) for layer in model.layers}  # o_proj on the kernels
    for mod in (norm, attention):
        monkeypatch.setattr(mod, "on_kernel_path", lambda x: True)
    monkeypatch.setattr(linear_layer, "device_path", lambda x: True)
    monkeypatch.setattr(ops, "_use_kernels", lambda x, *ws: all(id(w) in fast for w in ws))
    prompts = [[11, 502, 77, 1234], [9, 4000, 310]]

    def run() -> tuple[list, list, int]:
        quantize_q8_calls.clear()
        tokens, logits = greedy(model, model.make_kv_cache(2, 16), prompts, steps=2)
        return tokens, logits, len(quantize_q8_calls)

    fused = run()
    monkeypatch.setattr(attention, "DECODE_OUT_Q8", False)
    plain = run()
    assert fused[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], plain[1], strict=True))
    layers = len(model.layers)
    assert plain[2] == 3 * layers  # o_proj in the prefill and in each of the 2 decode steps
    assert fused[2] == 1 * layers  # in the prefill only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_greedy_is_unchanged_by_the_norms_q8(monkeypatch, quantize_q8_calls):
    """The tiny Qwen3-MoE (Q4_K_M) on the GPU, every kernel compiled: prefill and decode steps
    at 1 and 3 sequences give the same logits, bit for bit, with the norms' and the decode
    attention's q8 rounding and without them (every consumer quantizing for itself), with fewer
    `quantize_q8` calls."""
    from moestream.cli import DEMO_MODEL
    from moestream.models.base import DecoderLayer
    from moestream.models.registry import build_model
    from moestream.weights.loader import open_model

    model = build_model(open_model(DEMO_MODEL), "cuda", torch.bfloat16)
    calls = quantize_q8_calls

    def run(prompts: list[list[int]]) -> tuple[list, list, int]:
        calls.clear()
        tokens, logits = greedy(model, model.make_kv_cache(len(prompts), 16), prompts, steps=4)
        return tokens, logits, len(calls)

    cases = ([[11, 502, 77, 1234]], [[11, 502, 77, 1234], [9, 4000, 310], [5, 6, 7, 8, 9]])
    fused = [run(p) for p in cases]
    monkeypatch.setattr(DecoderLayer, "attn_takes_q8", lambda self, x: False)
    monkeypatch.setattr(DecoderLayer, "ffn_takes_q8", lambda self, x: False)
    monkeypatch.setattr(attention, "DECODE_OUT_Q8", False)
    plain = [run(p) for p in cases]
    for (f_tokens, f_logits, f_calls), (tokens, logits, calls_) in zip(fused, plain, strict=True):
        assert f_tokens == tokens
        assert all(torch.equal(a, b) for a, b in zip(f_logits, logits, strict=True))
        assert f_calls < calls_
