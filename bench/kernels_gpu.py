"""Check and time the Triton quantized kernels at real model shapes on a CUDA device.

Usage (repository root, on a machine with a CUDA GPU and triton):
    python bench/kernels_gpu.py [--only gemv,gemm,moe] [--quick] [--sweep]

For every case it makes fresh random weights (random GGUF blocks with small float16 scales,
generated on the device) and activations, runs the kernel once into a NaN-filled output and
compares it with the float32 torch reference (max |y - ref| / max |ref|; FAIL above 2e-2 for
bfloat16 activations, 1e-4 for float32).

Timing: the kernel is launched on C copies of its weights in turn (C chosen so that they span
twice the L2 cache: every launch reads cold weights, as a decode step does layer after layer),
the C launches are captured in one CUDA graph (as the engine runs decode: no host launch
overhead) and the graph is replayed; "us" is the median replay time / C. GB/s counts the bytes
that must move: the weight bytes read (for MoE: of the distinct experts the routing selects),
activations read and the output written. "% copy" divides by the device-to-device copy
bandwidth measured first (bytes read + written by `Tensor.copy_` of 1 GiB), the figure
/work/shared/ANCHORS.md uses. Exits with status 1 when a check fails.

--sweep times the decode MMVQ (M=1) over a grid of launch configurations and prints the best
ones per shape beside the heuristic's choice, for tuning `mmvq.mmvq_config`.

`--only gemv` also times the 4-bit code types (Q4_0, IQ4_NL, IQ4_XS, MXFP4) on both decode
paths at N=12288 K=4096: the float GEMV and mmvq at M=1, mmvq and the tiled GEMM at M=2.

Shapes: Qwen3-30B-A3B (hidden 2048, 32/4 heads of 128, 128 experts top-8, expert FFN 768,
vocab 151936) and Qwen3-8B (hidden 4096, FFN 12288), weights in the Q4_K_M mix (Q4_K, Q6_K).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from moestream.kernels import ops  # noqa: E402
from moestream.weights.qtensor import QTensor, row_bytes  # noqa: E402

T = GGMLQuantizationType
# Byte offsets of the float16 scales (d, dmin) in each block; every other byte is random.
F16_FIELDS = {
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.MXFP4: (),
}
# Byte offsets of E8M0 exponents (MXFP4: 2^(e - 128) per 32 values, times codes up to 12).
E8M0_FIELDS = {T.MXFP4: (0,)}
E, TOPK, HIDDEN, FFN = 128, 8, 2048, 768  # Qwen3-30B-A3B MoE layer
CODE_TYPES = (T.Q4_0, T.IQ4_NL, T.IQ4_XS, T.MXFP4)  # dense mmvq through `mmvq_codes`


def random_qtensor(qtype: GGMLQuantizationType, shape: tuple[int, ...], gen) -> QTensor:
    """Random blocks on the GPU; scales chosen so the values are O(0.01..0.1)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = math.prod(shape) // block
    data = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, device="cuda", generator=gen)
    scale = 2.0**-10 if qtype != T.Q8_0 else 2.0**-9
    for off in F16_FIELDS[qtype]:
        mag = torch.rand(n_blocks, device="cuda", generator=gen) * scale + scale / 2
        data[:, off : off + 2] = mag.half().view(torch.uint8).view(n_blocks, 2)
    for off in E8M0_FIELDS.get(qtype, ()):  # 2^-11 .. 2^-8
        data[:, off] = torch.randint(117, 121, (n_blocks,), device="cuda", generator=gen).byte()
    row_bytes = shape[-1] // block * size
    return QTensor(data.view(*shape[:-1], row_bytes), qtype, shape)


@dataclass
class Row:
    kernel: str
    shape: str
    qtype: str
    dtype: str
    err: float
    us: float
    nbytes: int
    flops: int

    @property
    def ok(self) -> bool:
        return self.err < (1e-4 if self.dtype == "float32" else 2e-2)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def copies_for(nbytes: int) -> int:
    """Weight copies that together span twice the L2 cache (at least 2, at most 256)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(256, math.ceil(2 * l2 / max(nbytes, 1))))


def graph_time_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median time of one call, from replays of a CUDA graph that runs all `calls` in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def matmul_fn(kind: str):
    from moestream.kernels.dequant_mm import dequant_matmul
    from moestream.kernels.mmvq import mmvq, quantize_q8
    from moestream.kernels.quant_gemm import quant_gemm
    from moestream.kernels.quant_gemv import quant_gemv

    def mmvq_call(x, w, out, config=None):  # the activation quantizer is part of the call
        return mmvq(quantize_q8(x), w, out=out, config=config)

    def cached_call(x, w, out):  # the bf16 copy kept by --weight-cache-gib, through cuBLAS
        return torch.mm(x, w.values.t(), out=out)

    calls = {"gemv": quant_gemv, "gemm": quant_gemm, "mmvq": mmvq_call, "dequant": dequant_matmul}
    return {**calls, "cached": cached_call}[kind]


def matmul_ref(kind: str, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """float32 reference: the float product, or for mmvq its own (8-bit activations)."""
    if kind == "mmvq":
        from moestream.kernels.mmvq import mmvq_ref, quantize_q8_ref

        return mmvq_ref(quantize_q8_ref(x), w)
    return x.float() @ w.dequantize(torch.float32).t()


def bench_matmul(kind, m, n, k, qtype, dtype, *, gen, config=None, padded=False) -> Row:
    """`padded`: the weight in the padded layout (`QTensor.aligned`; bytes counted unpadded)."""
    fn = matmul_fn(kind)
    kw = {"config": config} if config is not None else {}
    from moestream.kernels.dequant_mm import cache_values

    w = random_qtensor(qtype, (n, k), gen).to("cuda", aligned=padded)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    size = n * k * 2 if kind == "cached" else n * row_bytes(qtype, k)  # the bytes a call reads
    more = [QTensor(w.data.clone(), qtype, w.shape, padded=w.padded)
            for _ in range(copies_for(w.nbytes) - 1)]  # fmt: skip
    weights = [w, *more]
    if kind == "cached":
        for w_ in weights:
            cache_values(w_, dtype)
    fn(x, w, out=out, **kw)
    err = rel_err(out, matmul_ref(kind, x, w))
    us = graph_time_us([lambda w=w_: fn(x, w, out=out, **kw) for w_ in weights])
    nbytes = size + x.numel() * x.element_size() + out.numel() * out.element_size()
    shape = f"M={m} N={n} K={k}"
    return Row(kind, shape, qtype.name, str(dtype)[6:], err, us, nbytes, 2 * m * n * k)


def bench_moe(
    t: int,
    qtypes,
    dtype,
    method=None,
    *,
    gen,
    mmvq_cfg=None,
    cached=False,
    mmq_cfg=None,
    grouped_cfg=None,
    padded=False,
) -> Row:
    """One layer of Qwen3-30B-A3B experts. The stacks hold C copies of the 128 experts; each
    timed call routes with its own random top-8 and its own expert_slot table (expert e ->
    slot e + 128 c), so consecutive calls read different, cold experts. `mmq_cfg`,
    `grouped_cfg`: the "mmq" / "grouped" path with that launch shape. `padded`: the stacks in
    the padded layout (`QTensor.aligned`; bytes counted unpadded)."""
    from moestream.kernels.moe import default_method, fused_moe
    from moestream.kernels.moe_grouped import moe_grouped
    from moestream.kernels.moe_mmq import moe_mmq
    from moestream.kernels.moe_mmvq import moe_mmvq_ref

    def run(a) -> None:
        if mmq_cfg is not None:
            moe_mmq(x, a[0], a[1], gate, up, down, a[2], out=a[3], config=mmq_cfg)
        elif grouped_cfg is not None:
            moe_grouped(x, a[0], a[1], gate, up, down, a[2], a[3], grouped_cfg)
        else:
            fused_moe(
                x, a[0], a[1], gate, up, down, a[2], out=a[3], method=method, mmvq_cfg=mmvq_cfg
            )

    qg, qd = qtypes
    per_expert = 2 * FFN * row_bytes(qg, HIDDEN) + HIDDEN * row_bytes(qd, FFN)  # gate, up, down
    used_per_call = min(E, t * TOPK) * per_expert
    c = min(copies_for(used_per_call), max(1, (24 << 30) // (E * per_expert)))
    gate = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    up = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    down = random_qtensor(qd, (c * E, HIDDEN, FFN), gen)
    if padded:
        gate, up, down = (w.aligned() for w in (gate, up, down))
    if cached:  # bf16 copies (--weight-cache-gib): the grouped GEMM reads them, nothing to unpack
        from moestream.kernels.dequant_mm import cache_values

        c = min(c, max(1, (48 << 30) // (E * 3 * FFN * HIDDEN * 2)))
        gate, up, down = (QTensor(w.data[: c * E], w.qtype, (c * E, *w.shape[1:])) for w in
                          (gate, up, down))  # fmt: skip
        for w in (gate, up, down):
            cache_values(w, dtype)
    x = torch.randn(t, HIDDEN, device="cuda", generator=gen).to(dtype)
    calls, used = [], []
    for i in range(c):
        logits = torch.randn(t, E, device="cuda", generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)  # [T, k]
        weights = weights / weights.sum(-1, keepdim=True)
        slot = torch.arange(E, dtype=torch.int32, device="cuda") + i * E
        out = torch.full((t, HIDDEN), float("nan"), dtype=dtype, device="cuda")
        calls.append((ids, weights, slot, out))
        used.append(torch.unique(ids).numel())
    ids, weights, slot, out = calls[0]
    if mmq_cfg is not None:
        path = "mmq"
    elif grouped_cfg is not None:
        path = "grouped"
    else:
        path = method or default_method(t * TOPK, gate, up, down, x)
    run(calls[0])
    ref = moe_mmvq_ref if path in ("mmvq", "mmq", "grouped") else ops.moe_forward_ref
    err = rel_err(out, ref(x.float(), ids, weights, gate, up, down, slot))
    us = graph_time_us([lambda a=a: run(a) for a in calls])
    mean_used = sum(used) / len(used)
    nbytes = int(mean_used * per_expert) + 2 * x.numel() * x.element_size()
    shape = f"T={t} E={E} k={TOPK} H={HIDDEN} F={FFN} ({mean_used:.0f} used)"
    flops = 2 * 3 * t * TOPK * HIDDEN * FFN
    qtype_names = f"{qg.name}/{qd.name}"
    if cached:
        path, nbytes = f"{path}-cached", int(mean_used * 3 * FFN * HIDDEN * 2)
    return Row(f"moe-{path}", shape, qtype_names, str(dtype)[6:], err, us, nbytes, flops)


def bench_moe_cached(t: int, qtypes, dtype, method=None, *, gen) -> Row:
    """`bench_moe` on bf16 copies of the stacks (`--weight-cache-gib`)."""
    return bench_moe(t, qtypes, dtype, method, gen=gen, cached=True)


def cases(only: set[str], quick: bool):
    """(bench function, arguments) of each case; `quick` keeps a few per kernel."""
    bf16, f32 = torch.bfloat16, torch.float32
    # Qwen3-30B-A3B attention q, k, o; Qwen3-8B FFN up and down; the output head (Q6_K)
    decode = [(4096, 2048, T.Q4_K), (512, 2048, T.Q4_K), (2048, 4096, T.Q4_K)]
    decode += [(12288, 4096, T.Q4_K), (4096, 12288, T.Q6_K), (151936, 2048, T.Q6_K)]
    prefill = [(4096, 2048, T.Q4_K), (12288, 4096, T.Q4_K), (4096, 12288, T.Q6_K)]
    other_types = () if quick else (T.Q5_K, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4, T.Q4_0)
    if "mmvq" in only:
        for n, k, qtype in decode[:2] if quick else decode:
            yield bench_matmul, ("mmvq", 1, n, k, qtype, bf16)
        for qtype in () if quick else (T.Q5_K, T.Q8_0):
            yield bench_matmul, ("mmvq", 1, 12288, 4096, qtype, bf16)
        for m in (2, 4, 8):
            for n, k, qtype in (decode[0], decode[3]):
                yield bench_matmul, ("mmvq", m, n, k, qtype, bf16)
    if "gemv" in only:
        for n, k, qtype in decode[:1] if quick else decode:
            yield bench_matmul, ("gemv", 1, n, k, qtype, bf16)
        for qtype in other_types:
            if qtype not in CODE_TYPES:
                yield bench_matmul, ("gemv", 1, 12288, 4096, qtype, bf16)
        # The 4-bit code types: the float GEMV (their path before `mmvq_codes`) beside mmvq at
        # one row, and mmvq beside the tiled GEMM (their path from 3 rows) at 2, 4 and 8.
        for qtype in (T.Q4_0,) if quick else CODE_TYPES:
            yield bench_matmul, ("gemv", 1, 12288, 4096, qtype, bf16)
            yield bench_matmul, ("mmvq", 1, 12288, 4096, qtype, bf16)
            for m in () if quick else (2, 4, 8):
                yield bench_matmul, ("mmvq", m, 12288, 4096, qtype, bf16)
                yield bench_matmul, ("gemm", m, 12288, 4096, qtype, bf16)
        for m in () if quick else (4, 8):  # the GEMV's own multi-row path, for comparison
            yield bench_matmul, ("gemv", m, 12288, 4096, T.Q4_K, bf16)
        yield bench_matmul, ("gemv", 1, 4096, 4096, T.Q4_K, f32)
    if "gemm" in only:
        for m in () if quick else (4, 8, 16):  # batched decode: what ops sends here from M=2
            for n, k, qtype in (decode[0], decode[3], decode[5]):
                yield bench_matmul, ("gemm", m, n, k, qtype, bf16)
        for m in (512,) if quick else (64, 512, 4096):
            for n, k, qtype in prefill:
                yield bench_matmul, ("gemm", m, n, k, qtype, bf16)
        for qtype in other_types:
            yield bench_matmul, ("gemm", 512, 12288, 4096, qtype, bf16)
        yield bench_matmul, ("gemm", 64, 4096, 4096, T.Q4_K, f32)
    if "dequant" in only:  # bf16 weight copy + cuBLAS: both sides of DEQUANT_MIN_M, and prefill
        for m in (16, 32, 64, 128, 512, 4096):
            for n, k, qtype in prefill:
                yield bench_matmul, ("dequant", m, n, k, qtype, bf16)
                if m <= 128:
                    yield bench_matmul, ("gemm", m, n, k, qtype, bf16)
        for t in (32, 64, 128, 512, 4096):  # grouped GEMM on bf16 copies of the experts
            yield bench_moe, (t, (T.Q4_K, T.Q6_K), bf16, "dequant")
    if "cached" in only:  # --weight-cache-gib: bf16 copies kept from load, against MMQ/mmvq
        for m in (8, 16, 32):
            for n, k, qtype in (decode[0], decode[3]):
                yield bench_matmul, ("cached", m, n, k, qtype, bf16)
        for t in (8, 16, 32, 64, 512, 4096):
            yield bench_moe_cached, (t, (T.Q4_K, T.Q6_K), bf16, "dequant")
    if "moecodes" in only:  # 4-bit code type experts: the grouped path against the float one
        for mix in ((T.IQ4_XS, T.IQ4_XS), (T.Q4_0, T.Q4_0), (T.MXFP4, T.MXFP4)):
            for t in (1,) if quick else (1, 8, 32):
                yield bench_moe, (t, mix, bf16)
                yield bench_moe, (t, mix, bf16, "gemv")
    if "moe" in only:
        mix = (T.Q4_K, T.Q6_K)
        for t in (1, 8) if quick else (1, 4, 8, 16, 32, 512, 4096):
            yield bench_moe, (t, mix, bf16)
        yield bench_moe, (1, mix, bf16, "gemv")  # the float decode path, for comparison
        if not quick:
            yield bench_moe, (1, (T.Q4_K, T.Q4_K), bf16)
            yield bench_moe, (8, mix, bf16, "gemm")  # the other path at the crossover
            yield bench_moe, (16, mix, bf16, "gemv")
            for t in (16, 32):  # both batched-decode paths where the default switches
                yield bench_moe, (t, mix, bf16, "gemm")
            yield bench_moe, (64, mix, bf16, "mmvq")


def print_row(r: Row, copy_gbs: float) -> None:
    gbs = r.nbytes / r.us / 1e3
    flag = "" if r.ok else " FAIL"
    cells = (r.kernel, r.shape, r.qtype, r.dtype, f"{r.err:.2e}{flag}", f"{r.us:,.1f}")
    cells += (f"{gbs:,.0f}", f"{100 * gbs / copy_gbs:.0f}%", f"{r.flops / r.us / 1e6:.1f}")
    print("| " + " | ".join(cells) + " |", flush=True)


def time_configs(configs, run) -> list:
    """(us, config, Row) of `run(config)` for each config; one the compiler rejects is
    reported and skipped."""
    results = []
    for cfg in configs:
        try:
            r = run(cfg)
        except Exception as exc:  # a config the compiler rejects: report, go on
            print(f"  {cfg}: {type(exc).__name__}: {exc}", flush=True)
            continue
        results.append((r.us, cfg, r))
        torch.cuda.empty_cache()
    return results


def print_best(title: str, results: list, default, copy_gbs: float) -> None:
    """A sweep's (us, config, Row) results: the 5 fastest and the default, with GB/s."""
    results.sort(key=lambda item: item[0])
    print(f"\n{title}: {len(results)} configs")
    for us, cfg, r in results[:5] + [item for item in results if item[1] == default]:
        gbs = r.nbytes / us / 1e3
        mark = " (default)" if cfg == default else ""
        print(f"  {us:8.1f} us {gbs:7,.0f} GB/s {100 * gbs / copy_gbs:4.0f}%  {cfg}{mark}")


def sweep(gen, copy_gbs: float) -> None:
    """Decode MMVQ (M=1) over launch configurations; the 5 fastest per shape and the default."""
    from moestream.kernels.mmvq import MmvqConfig, mmvq_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4096, 2048, T.Q4_K), (2048, 4096, T.Q4_K), (12288, 4096, T.Q4_K)]
    shapes += [(4096, 12288, T.Q6_K), (151936, 2048, T.Q6_K)]
    for n, k, qtype in shapes:
        groups = k // 256
        default = mmvq_config(n, k, sms)
        shapes_grid = itertools.product((4, 8, 16, 32), (1, 2), (2, 4, 8), (4, 8))
        grid = [MmvqConfig(b, s, g, w) for b, s, g, w in shapes_grid
                if groups % s == 0 and b * g <= 256]  # fmt: skip
        results = time_configs(
            grid,
            lambda cfg, n=n, k=k, q=qtype: bench_matmul("mmvq", 1, n, k, q, torch.bfloat16,
                                                        gen=gen, config=cfg),
        )  # fmt: skip
        print_best(f"MMVQ M=1 N={n} K={k} {qtype.name}", results, default, copy_gbs)


def sweep_router(gen, copy_gbs: float) -> None:
    """The fused router (`router.fused_route`: logits GEMV, softmax, top-8 of 128) of
    Qwen3-30B-A3B (float32 weight [128, 2048]) over launch shapes (programs per token, warps) at
    T = 1 and 8, cold weights (each call reads its own copy). Each shape's picks are checked
    against torch (softmax, topk) on the first copy."""
    from moestream.kernels.router import fused_route, route_counters

    e, h, k = E, HIDDEN, TOPK
    c = copies_for(e * h * 4)
    weights = torch.randn(c, e, h, device="cuda", generator=gen) / h**0.5
    counters = route_counters(torch.device("cuda"))
    shapes = [(64, 4), (32, 4), (128, 4), (16, 4), (128, 2), (128, 1), (64, 2), (64, 1), (32, 2),
              (32, 8), (16, 8)]  # fmt: skip
    for t in (1, 8):
        xs = [torch.randn(t, h, device="cuda", generator=gen).bfloat16() for _ in range(c)]
        want = torch.topk(torch.softmax(xs[0].float() @ weights[0].t(), -1), k, dim=-1).indices
        print(f"router T={t} E={e} H={h} k={k}, {c} weight copies", flush=True)
        for ppt, warps in shapes:

            def call(i: int, ppt=ppt, warps=warps, xs=xs):
                return fused_route(xs[i], weights[i], k, True, counters,
                                   programs_per_token=ppt, num_warps=warps)  # fmt: skip

            try:
                _, ids = call(0)
                ok = torch.equal(ids.sort(-1).values, want.sort(-1).values)
                us = graph_time_us([lambda i=i: call(i) for i in range(c)])
            except Exception as exc:  # a shape the compiler rejects: report, go on
                print(f"  ppt {ppt:3d} w{warps}: {type(exc).__name__}: {exc}", flush=True)
                continue
            gbs = e * h * 4 / us / 1e3
            print(f"  ppt {ppt:3d} w{warps}: {us:7.2f} us {gbs:7,.0f} GB/s "
                  f"{'ok' if ok else 'PICKS DIFFER'}", flush=True)  # fmt: skip


def sweep_moe_once(gen, copy_gbs: float) -> None:
    """The MoE "mmvq" path's gate/up as the "once" kernel (`MoeMmvqConfig.up_once`: rows per
    program, groups per step, warps) against the default, Qwen3-30B-A3B layer, Q4_K/Q6_K and
    Q4_K/Q4_K, T = 1 and 8; whole-layer times (gate/up and down)."""
    from dataclasses import replace

    from moestream.kernels.moe_mmvq import MoeMmvqConfig

    default = MoeMmvqConfig()
    once = [
        replace(default, up_once=True, up_block_n=n, up_groups=g, up_warps=w)
        for n in (4, 8, 16, 32)
        for g, w in ((8, 2), (4, 1))
    ]
    for mix in ((T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K)):
        for t in (1, 8):
            rows = []
            for cfg in [default, *once]:
                try:
                    r = bench_moe(t, mix, torch.bfloat16, "mmvq", gen=gen, mmvq_cfg=cfg)
                except Exception as exc:  # a config the compiler rejects: report, go on
                    print(f"  {cfg}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                rows.append((r.us, cfg, r))
                name = "default" if cfg == default else (
                    f"once n{cfg.up_block_n} g{cfg.up_groups} w{cfg.up_warps}")  # fmt: skip
                gbs = r.nbytes / r.us / 1e3
                print(f"  {mix[0].name}/{mix[1].name} T={t} {r.us:8.1f} us {gbs:6,.0f} GB/s "
                      f"err {r.err:.1e}  {name}", flush=True)  # fmt: skip
                torch.cuda.empty_cache()
            best = min(rows, key=lambda x: x[0])
            print(f"  best {best[0]:.1f} us: {best[1]}\n", flush=True)


def sweep_moe(gen, copy_gbs: float) -> None:
    """The MoE "mmvq" path over its launch variants (`MoeMmvqConfig`), Qwen3-30B-A3B layer,
    Q4_K/Q6_K. T = 1: the gate/up variants (groups per step, warps, K split, gate and up in
    one step or not, tree or plain sums) with the default down, then the down variants (rows
    per program, groups per step, warps, experts unrolled per loop step, "rows" tile or not)
    with the fastest gate/up. T = 8: the 6 fastest at T = 1, the default and the shape before
    the variants ("before"). Prints the fastest of each stage, then the T = 8 candidates with
    both times and the pick: the fastest at T = 1 among those no slower at T = 8 than
    "before"."""
    from dataclasses import replace

    from moestream.kernels.moe_mmvq import MoeMmvqConfig

    mix = (T.Q4_K, T.Q6_K)
    default = MoeMmvqConfig()
    before = MoeMmvqConfig(  # the kernels' shape before the variants, spelled out
        up_groups=4, up_warps=8, up_split=1, up_fused=False, up_tree=True,
        down_block_n=4, down_groups=4, down_warps=4, down_experts=8, down_rows=False,
        down_tree=True,
    )  # fmt: skip

    def short(c: MoeMmvqConfig) -> str:
        up = (
            f"up g{c.up_groups} w{c.up_warps} s{c.up_split} fused={c.up_fused:d} tree={c.up_tree:d}"
        )
        down = f"down n{c.down_block_n} g{c.down_groups} w{c.down_warps} e{c.down_experts}"
        return f"{up} | {down} rows={c.down_rows:d} tree={c.down_tree:d}"

    def timed(t: int, configs, title: str, show: int = 6) -> dict:
        times = {}
        for cfg in dict.fromkeys(configs):
            try:
                r = bench_moe(t, mix, torch.bfloat16, "mmvq", gen=gen, mmvq_cfg=cfg)
            except Exception as exc:  # a config the compiler rejects: report, go on
                print(f"  {cfg}: {type(exc).__name__}: {exc}", flush=True)
                continue
            times[cfg] = (r.us, r)
            print(f"    T={t} {r.us:8.1f} us  {short(cfg)}", flush=True)
            torch.cuda.empty_cache()
        ranked = sorted(times, key=lambda c: times[c][0])
        print(f"\nMoE mmvq T={t}, {title}: {len(times)} configs", flush=True)
        marked = [c for c in (default, before) if c in times]
        for cfg in list(dict.fromkeys(ranked[:show] + marked)):
            us, r = times[cfg]
            gbs = r.nbytes / us / 1e3
            mark = " (default)" if cfg == default else " (before)" if cfg == before else ""
            print(f"  {us:8.1f} us {gbs:7,.0f} GB/s {100 * gbs / copy_gbs:4.0f}%  {cfg}{mark}")
        return times

    up_grid = [
        replace(default, up_groups=g, up_warps=w, up_split=s, up_fused=f, up_tree=tree)
        for g, s in ((2, 1), (4, 1), (2, 2), (4, 2), (2, 4))  # H = 2048: 8 groups
        for w in (4, 8)
        for f, tree in ((True, False), (False, True))  # unfused: always trees
    ]
    t1 = timed(1, [*up_grid, default, before], "gate/up variants")
    best_up = replace(min(t1, key=lambda c: t1[c][0]), down_rows=True)
    down_grid = [  # F = 768: 3 groups, in one step with a masked fourth
        replace(best_up, down_block_n=n, down_groups=4, down_warps=w, down_experts=e)
        for n in (4, 8)
        for w in (4, 8)
        for e in (2, 4, 8)
    ]
    down_grid += [
        replace(best_up, down_block_n=4, down_experts=e, down_rows=False, down_tree=False)
        for e in (2, 8)
    ]
    t1.update(timed(1, down_grid, "down variants"))
    ranked = sorted(t1, key=lambda c: t1[c][0])
    t8 = timed(8, list(dict.fromkeys([*ranked[:6], default, before])), "candidates", show=8)
    print("\nMoE mmvq candidates, T=1 / T=8 us:")
    for cfg in t8:
        print(f"  {t1[cfg][0]:8.1f} {t8[cfg][0]:8.1f}  {cfg}")
    limit = t8[before][0] if before in t8 else float("inf")
    ok = [c for c in t8 if c in t1 and t8[c][0] <= limit] or list(t8)
    pick = min(ok, key=lambda c: t1[c][0])
    print(f"pick (fastest at T=1, T=8 no slower than before): {pick}")


def moe_line(t: int, r: Row, copy_gbs: float, label: str) -> str:
    """One timed MoE launch shape of a sweep: T, us, GB/s, % of copy bandwidth, error, label."""
    gbs = r.nbytes / r.us / 1e3
    return (
        f"  T={t:3d} {r.us:8.1f} us {gbs:7,.0f} GB/s {100 * gbs / copy_gbs:4.0f}%"
        f"  err {r.err:.1e}  {label}"
    )


def sweep_moe_mmq(gen, copy_gbs: float) -> None:
    """The MoE "mmq" path (batched decode, 17-128 tokens) over launch shapes (`MmqConfig`:
    weight rows per program, warps, pipeline stages, register cap; BLOCK_M from the mean
    assignments per expert as `moe_mmq_config` picks it), Qwen3-30B-A3B layer, Q4_K/Q6_K, at
    T = 16, 32, 64. Prints every row, then the fastest per T and the one with the least summed
    time."""
    from moestream.kernels.mmq import MmqConfig
    from moestream.kernels.moe_mmq import moe_mmq_config

    mix = (T.Q4_K, T.Q6_K)
    shapes = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3),
              (128, 8, 4), (64, 2, 3)]  # fmt: skip
    # More resident warps per SM (`python bench/sm90_builds.py`, Triton 3.6, sm_90; the
    # default, 2 warps and 3 stages, holds 8: 177 registers gate/up, 252 down). Warps per SM,
    # bytes of spill stores gate/up / down:
    #   2 warps, 3 stages, cap 168: 12, 8 / 188; cap 128: 16, 148 / 516
    #   4 warps, 1 stage (no cp.async): 12, none; cap 128: 16, 0 / 28; cap 96: 20, 104 / 188
    #   4 warps, 2 and 3 stages, cap 128: 16, 16 / 88 and 8 / 88
    shapes += [(64, 2, 3, 168), (64, 2, 3, 128), (64, 4, 1), (64, 4, 1, 128), (64, 4, 1, 96),
               (64, 4, 2, 128), (64, 4, 3, 128)]  # fmt: skip
    times: dict[str, dict[int, float]] = {}
    for t in (16, 32, 64):
        base = moe_mmq_config(t * TOPK, E)
        for bn, w, st, *cap in shapes:
            cfg = MmqConfig(base.block_m, bn, 1, w, st, *cap)
            name = f"bn{bn} w{w} st{st}" + (f" r{cap[0]}" if cap else "")
            try:
                r = bench_moe(t, mix, torch.bfloat16, gen=gen, mmq_cfg=cfg)
            except Exception as exc:  # a shape the compiler rejects: report, go on
                print(f"  T={t} {cfg}: {type(exc).__name__}: {exc}", flush=True)
                continue
            mark = " (default)" if cfg == base else ""
            print(moe_line(t, r, copy_gbs, name + mark), flush=True)
            times.setdefault(name, {})[t] = r.us
            torch.cuda.empty_cache()
    full = {k: v for k, v in times.items() if len(v) == 3}
    for t in (16, 32, 64):
        best = min(full, key=lambda k: full[k][t])
        print(f"fastest at T={t}: {best} {full[best][t]:.1f} us")
    best = min(full, key=lambda k: sum(full[k].values()))
    print(f"least summed time: {best} {full[best]}")


def sweep_moe_grouped(gen, copy_gbs: float, small: bool = False, down: bool = False) -> None:
    """The MoE "grouped" path (`moe_grouped`: each expert's weights read once per block of its
    assignments) over launch shapes (`MoeGroupedConfig`), against the mmvq and mmq paths'
    defaults, Qwen3-30B-A3B layer, Q4_K/Q6_K, at T = 16, 32, 64; `small`: at T = 4, 8, 12
    (where mmvq serves now) with 1-2 assignments a block, and the down kernel's shapes at
    T = 16, 32 around the default; `down`: the default gate/up with the down kernel's tiles a
    program (1: F = 768's three groups at once in a four-group step, one masked; 2-8: one group
    a step across the tiles), rows a tile (8, 16) and warps (1, 2) at T = 16, 32. Prints every
    row, then the fastest shape per T and the one with the least summed time."""
    from dataclasses import replace

    from moestream.kernels.moe_grouped import MoeGroupedConfig, grouped_config

    mix = (T.Q4_K, T.Q6_K)
    fields = ("block_m", "up_block_n", "up_groups", "up_warps", "down_block_n", "down_groups")
    shapes = (
        (2, 8, 8, 2, 8, 4), (8, 8, 8, 2, 8, 4), (16, 8, 8, 2, 8, 4), (4, 16, 8, 2, 16, 4),
        (4, 4, 8, 2, 4, 4), (2, 16, 8, 2, 16, 4), (8, 4, 8, 2, 4, 2), (4, 8, 4, 1, 8, 2),
    )  # fmt: skip
    ts: tuple[int, ...] = (16, 32, 64)
    if small:
        shapes = (
            (1, 8, 8, 2, 8, 4), (2, 8, 8, 2, 8, 4), (1, 4, 8, 2, 4, 4), (2, 4, 8, 2, 4, 4),
            (2, 8, 8, 2, 4, 4), (2, 8, 8, 2, 16, 4), (2, 8, 8, 2, 8, 2), (2, 8, 8, 2, 16, 2),
        )  # fmt: skip
        ts = (4, 8, 12, 16, 32)
    configs = [grouped_config(t * TOPK, E) for t in ts if t >= 16]
    configs += [MoeGroupedConfig(**dict(zip(fields, shape))) for shape in shapes]
    if down:  # T = 16 (16 requests, issue #5's figure furthest from its target) first
        ts = (16, 32)
        base = grouped_config(16 * TOPK, E)
        configs = [base] + [
            replace(base, down_block_n=n, down_warps=w, down_tiles=tiles)
            for tiles in (1, 2, 4, 8)
            for n in (8, 16)
            for w in (1, 2)
        ]
    times: dict[MoeGroupedConfig, dict[int, float]] = {}
    for t in ts:
        for method in ("mmvq",) if t < 16 else ("mmvq", "mmq"):
            r = bench_moe(t, mix, torch.bfloat16, method, gen=gen)
            print(moe_line(t, r, copy_gbs, f"{method} (default shape)"), flush=True)
        for cfg in dict.fromkeys(configs):
            try:
                r = bench_moe(t, mix, torch.bfloat16, gen=gen, grouped_cfg=cfg)
            except Exception as exc:  # a shape the compiler rejects: report, go on
                print(f"  T={t} {cfg}: {type(exc).__name__}: {exc}", flush=True)
                continue
            mark = " (default)" if cfg == grouped_config(t * TOPK, E) else ""
            print(moe_line(t, r, copy_gbs, f"grouped {cfg}{mark}"), flush=True)
            times.setdefault(cfg, {})[t] = r.us
            torch.cuda.empty_cache()
    full = {k: v for k, v in times.items() if len(v) == len(ts)}
    for t in ts:
        best = min(full, key=lambda k: full[k][t])
        print(f"fastest at T={t}: {full[best][t]:.1f} us {best}")
    best = min(full, key=lambda k: sum(full[k].values()))
    print(f"least summed time: {best} {full[best]}")


def sweep_moe_host(gen, copy_gbs: float) -> None:
    """The MoE "mmvq" path reading experts by address (zero-copy placement,
    `--expert-zero-copy`): a Qwen3-30B-A3B layer (Q4_K/Q6_K) with half of its experts in device
    memory and half in pinned host memory, over launch variants (`MoeMmvqConfig`) at T = 1
    and 8. 16 routings a timed graph (together they touch every host expert, more than the L2
    holds). Prints us per call, GB/s of the host-resident expert bytes read, the error against
    the device-resident call, and the fastest variant per T."""
    from dataclasses import replace

    from moestream.kernels.moe import fused_moe
    from moestream.kernels.moe_mmvq import MoeMmvqConfig

    n_dev = E // 2
    stacks = (
        random_qtensor(T.Q4_K, (E, FFN, HIDDEN), gen),
        random_qtensor(T.Q4_K, (E, FFN, HIDDEN), gen),
        random_qtensor(T.Q6_K, (E, HIDDEN, FFN), gen),
    )
    host = []
    for w in stacks:
        h = torch.empty((E - n_dev, *w.data.shape[1:]), dtype=w.data.dtype, pin_memory=True)
        h.copy_(w.data[n_dev:])
        host.append(h)
    addr = torch.tensor(
        [
            [w.data[i].data_ptr() if i < n_dev else h[i - n_dev].data_ptr() for i in range(E)]
            for w, h in zip(stacks, host)
        ],
        dtype=torch.int64,
        device="cuda",
    )  # [3, E]
    templates = [QTensor(w.data[:1], w.qtype, (1, *w.shape[1:])) for w in stacks]
    per_expert = sum(w.data[0].numel() for w in stacks)
    slot = torch.arange(E, dtype=torch.int32, device="cuda")
    base = MoeMmvqConfig()
    configs = [base]
    configs += [
        replace(base, up_split=s, up_groups=g, up_warps=w)
        for s in (4, 8)
        for g in (1, 2)
        for w in (4, 8)
    ]
    configs += [replace(base, down_block_n=n, down_experts=e) for n in (2, 4, 8) for e in (2, 4, 8)]
    configs = list(dict.fromkeys(configs))
    for t in (1, 8):
        x = torch.randn(t, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        calls, host_used = [], []
        for _ in range(16):
            logits = torch.randn(t, E, device="cuda", generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.empty((t, HIDDEN), dtype=torch.bfloat16, device="cuda")
            calls.append((ids, weights, out))
            host_used.append(int((torch.unique(ids) >= n_dev).sum()))
        host_bytes = sum(host_used) / len(host_used) * per_expert
        ids0, w0, _ = calls[0]
        ref = fused_moe(x, ids0, w0, *stacks, slot, method="mmvq").float()
        print(f"\nT={t}: {host_bytes / 1e6:.1f} MB of host-resident experts read per call")
        times = {}
        for cfg in configs:

            def run(a, cfg=cfg, x=x):
                return fused_moe(
                    x, a[0], a[1], *templates, None, out=a[2], method="mmvq",
                    expert_addr=addr, mmvq_cfg=cfg,
                )  # fmt: skip

            try:
                err = rel_err(run(calls[0]), ref)
                us = graph_time_us([lambda a=a: run(a) for a in calls], reps=10)
            except Exception as exc:  # a shape the compiler rejects: report, go on
                print(f"  {cfg}: {type(exc).__name__}: {exc}", flush=True)
                continue
            times[cfg] = us
            mark = " (default)" if cfg == base else ""
            print(
                f"  {us:8.1f} us {host_bytes / us / 1e3:6.1f} GB/s host  err {err:.1e}"
                f"  up g{cfg.up_groups} w{cfg.up_warps} s{cfg.up_split}"
                f" | down n{cfg.down_block_n} e{cfg.down_experts}{mark}",
                flush=True,
            )
        best = min(times, key=times.get)
        print(f"fastest at T={t}: {times[best]:.1f} us (default {times.get(base, 0):.1f}) {best}")


def time_align(gen) -> int:
    """`moe.align_assignments` (torch ops) vs `moe_align.align_blocks` (one Triton launch) at
    E=128, k=8: median us per call from CUDA-graph replays (50 calls a graph), outputs compared
    element for element. -> number of mismatches."""
    from moestream.kernels.moe import align_assignments
    from moestream.kernels.moe_align import align_blocks

    print("| T | A | block_m | torch us | triton us | speedup | equal |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for t, block_m in itertools.product((1, 8, 16, 32, 64, 128, 512), (2, 4, 16)):
        scores = torch.rand((t, E), generator=gen, device="cuda")
        ids = scores.topk(TOPK, dim=1).indices  # [T, k] int64, k distinct experts per token
        want, got = align_assignments(ids, E, block_m), align_blocks(ids, E, block_m)
        same = all(torch.equal(w, g) for w, g in zip(want, got))
        bad += not same
        us_torch = graph_time_us([lambda i=ids, m=block_m: align_assignments(i, E, m)] * 50)
        us_triton = graph_time_us([lambda i=ids, m=block_m: align_blocks(i, E, m)] * 50)
        print(
            f"| {t} | {t * TOPK} | {block_m} | {us_torch:.1f} | {us_triton:.1f} |"
            f" {us_torch / us_triton:.1f}x | {'yes' if same else 'NO'} |",
            flush=True,
        )
    return bad


def sweep_q6k_layout(gen, copy_gbs: float) -> None:
    """Q6_K read from the file's 210-byte blocks against the padded 224-byte layout
    (`QTensor.aligned`), each case twice in turn (native, padded, native, padded): the dense
    decode GEMV (the default path, `mmvq` "once") at the Q6_K shapes of Qwen3-30B-A3B and
    Qwen3-8B, and the 30B MoE layer (Q4_K gate/up, Q6_K down) at 1-32 tokens."""
    dense = [(1, 151936, 2048), (1, 512, 2048), (1, 4096, 12288), (1, 1024, 4096),
             (4, 151936, 2048), (8, 4096, 12288)]  # fmt: skip
    print("| case | native us | padded us | native us | padded us | padded / native |")
    print("|---|---|---|---|---|---|")
    for m, n, k in dense:
        us = [
            bench_matmul("mmvq", m, n, k, T.Q6_K, torch.bfloat16, gen=gen, padded=p).us
            for p in (False, True, False, True)
        ]
        ratio = (us[1] + us[3]) / (us[0] + us[2])
        cells = " | ".join(f"{u:.1f}" for u in us)
        print(f"| mmvq M={m} N={n} K={k} | {cells} | {ratio:.3f} |", flush=True)
        torch.cuda.empty_cache()
    for t in (1, 4, 8, 16, 32):
        us = []
        for p in (False, True, False, True):
            us.append(bench_moe(t, (T.Q4_K, T.Q6_K), torch.bfloat16, gen=gen, padded=p).us)
            torch.cuda.empty_cache()
        ratio = (us[1] + us[3]) / (us[0] + us[2])
        cells = " | ".join(f"{u:.1f}" for u in us)
        print(f"| MoE layer T={t} Q4_K/Q6_K | {cells} | {ratio:.3f} |", flush=True)


def sweep_q6k_padded(gen, copy_gbs: float) -> None:
    """Launch shapes for padded Q6_K (`QTensor.aligned`), whose defaults were tuned on the
    file's 210-byte blocks: the dense "once" GEMV at M = 1 (Qwen3-30B-A3B's head and v
    projection, Qwen3-8B's down) and the MoE layer's down kernel variants (default gate/up)
    at T = 1 and 8. The 5 fastest and the default per case."""
    from dataclasses import replace

    from moestream.kernels import moe_mmvq
    from moestream.kernels.mmvq import MmvqConfig, mmvq_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    for n, k in ((151936, 2048), (512, 2048), (4096, 12288)):
        default = mmvq_config(n, k, sms, variant="once", padded=True)
        groups = k // 256
        grid = [MmvqConfig(b, s, g, w, "once") for b in (4, 8, 16) for s in (1, 2)
                for g in (4, 8) for w in (1, 2, 4)]  # fmt: skip
        fits = [c for c in dict.fromkeys([default, *grid])
                if groups % c.split_k == 0 and c.groups <= groups // c.split_k]  # fmt: skip
        results = time_configs(
            fits,
            lambda cfg, n=n, k=k: bench_matmul("mmvq", 1, n, k, T.Q6_K, torch.bfloat16,
                                               gen=gen, config=cfg, padded=True),
        )  # fmt: skip
        print_best(f"MMVQ once M=1 N={n} K={k} Q6_K padded", results, default, copy_gbs)
    default = moe_mmvq.DEFAULT_CONFIG
    grid = [replace(default, down_block_n=n, down_groups=g, down_warps=w, down_experts=e)
            for n in (4, 8) for g in (1, 4) for w in (2, 4, 8) for e in (4, 8)]  # fmt: skip
    grid += [replace(default, down_rows=False, down_experts=e) for e in (2, 8)]
    for t in (1, 8):
        results = time_configs(
            dict.fromkeys([default, *grid]),
            lambda cfg, t=t: bench_moe(t, (T.Q4_K, T.Q6_K), torch.bfloat16, "mmvq", gen=gen,
                                       mmvq_cfg=cfg, padded=True),
        )  # fmt: skip
        print_best(f"MoE layer T={t} Q4_K/Q6_K padded, down variants", results, default, copy_gbs)


def sweep_once_8b(gen, copy_gbs: float) -> None:
    """Launch shapes of the "once" decode GEMV (M = 1) on Qwen3-8B's matrices, the largest
    dense ones a decode step reads (issue #4's 75%-of-copy-bandwidth target): merged q/k/v and
    o, merged gate/up, down in Q4_K and in padded Q6_K. The 5 fastest and the default each."""
    from moestream.kernels.mmvq import MmvqConfig, mmvq_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(6144, 4096, T.Q4_K, False), (4096, 4096, T.Q4_K, False)]
    shapes += [(24576, 4096, T.Q4_K, False), (4096, 12288, T.Q4_K, False)]
    shapes += [(4096, 12288, T.Q6_K, True)]
    for n, k, qtype, padded in shapes:
        default = mmvq_config(n, k, sms, variant="once", padded=padded)
        groups = k // 256
        grid = [MmvqConfig(b, 1, g, w, "once") for b in (2, 4, 8) for g in (4, 8, 16)
                for w in (1, 2, 4)]  # fmt: skip
        fits = [c for c in dict.fromkeys([default, *grid])
                if groups % c.split_k == 0 and c.groups <= groups // c.split_k]  # fmt: skip
        results = time_configs(
            fits,
            lambda cfg, n=n, k=k, q=qtype, p=padded: bench_matmul(
                "mmvq", 1, n, k, q, torch.bfloat16, gen=gen, config=cfg, padded=p
            ),
        )  # fmt: skip
        name = f"{qtype.name}{' padded' if padded else ''}"
        print_best(f"MMVQ once M=1 N={n} K={k} {name}", results, default, copy_gbs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="mmvq,gemv,gemm,moe",
        help="comma list of mmvq, gemv, gemm, moe, moecodes, dequant, cached",
    )
    parser.add_argument("--quick", action="store_true", help="a few shapes per kernel")
    parser.add_argument("--sweep", action="store_true", help="tune the decode MMVQ config")
    parser.add_argument("--sweep-moe", action="store_true", help="tune the MoE mmvq config")
    parser.add_argument(
        "--sweep-moe-mmq", action="store_true", help="time the MoE mmq launch shapes, T=16..64"
    )
    parser.add_argument(
        "--sweep-moe-grouped",
        action="store_true",
        help="time the MoE grouped launch shapes against mmvq and mmq, T=16..64",
    )
    parser.add_argument(
        "--sweep-moe-grouped-small",
        action="store_true",
        help="the same at T=4..12 (mmvq's range) and the down kernel's shapes at T=16, 32",
    )
    parser.add_argument(
        "--sweep-moe-down",
        action="store_true",
        help="the grouped path's down kernel: tiles, rows and warps at T=16, 32",
    )
    parser.add_argument(
        "--sweep-moe-host",
        action="store_true",
        help="time the MoE mmvq launch shapes on half host-resident (zero-copy) experts",
    )
    parser.add_argument("--sweep-moe-once", action="store_true", help="MoE once gate/up")
    parser.add_argument("--sweep-router", action="store_true", help="time the router shapes")
    parser.add_argument("--time-align", action="store_true", help="time align_blocks vs torch")
    parser.add_argument(
        "--sweep-q6k-layout", action="store_true", help="Q6_K native against padded blocks"
    )
    parser.add_argument(
        "--sweep-q6k-padded", action="store_true", help="launch shapes for padded Q6_K"
    )
    parser.add_argument(
        "--sweep-once-8b", action="store_true", help="launch shapes of the 8B's decode GEMVs"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or not ops.HAS_TRITON:
        print("needs a CUDA device and triton", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references in full precision
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)  # fresh each run
    copy_gbs = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2_mib = props.L2_cache_size >> 20
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2_mib} MiB")
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s (read + write)\n")
    if args.time_align:
        return 1 if time_align(gen) else 0
    sweeps = [
        (args.sweep, sweep),
        (args.sweep_moe, sweep_moe),
        (args.sweep_moe_mmq, sweep_moe_mmq),
        (args.sweep_moe_grouped, sweep_moe_grouped),
        (args.sweep_moe_grouped_small, functools.partial(sweep_moe_grouped, small=True)),
        (args.sweep_moe_down, functools.partial(sweep_moe_grouped, down=True)),
        (args.sweep_moe_host, sweep_moe_host),
        (args.sweep_router, sweep_router),
        (args.sweep_moe_once, sweep_moe_once),
        (args.sweep_q6k_layout, sweep_q6k_layout),
        (args.sweep_q6k_padded, sweep_q6k_padded),
        (args.sweep_once_8b, sweep_once_8b),
    ]
    if any(on for on, _ in sweeps):
        for on, run in sweeps:
            if on:
                run(gen, copy_gbs)
        return 0
    header = ("kernel", "shape", "qtype", "dtype", "max rel err", "us", "GB/s", "% copy", "TFLOP/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    failed = total = 0
    for fn, fargs in cases(set(args.only.split(",")), args.quick):
        total += 1
        try:
            row = fn(*fargs, gen=gen)
        except Exception as exc:  # report and go on: one broken case must not hide the rest
            failed += 1
            print(f"| {fn.__name__} {fargs} | FAILED {type(exc).__name__}: {exc} |", flush=True)
            continue
        failed += not row.ok
        print_row(row, copy_gbs)
        torch.cuda.empty_cache()
    print(f"\n{total - failed}/{total} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
