"""Check and time MMQ (int8 tensor-core quantized matmul) against MMVQ on a CUDA device.

Usage (repository root, on a machine with a CUDA GPU and triton):
    python bench/mmq_gpu.py [--reps 20]

One line per case: dense Q4_K N=12288 K=4096 and N=4096 K=2048 at M = 8, 16, 32, 64 (`mmq`
vs `mmvq`, which takes at most 8 rows per launch: above that it is called on chunks of 8, as a
caller would have to), and the Qwen3-30B-A3B MoE layer (128 experts, top-8, H=2048, F=768,
gate/up Q4_K, down Q6_K) at T = 8, 16, 32, 64 (`moe_mmq` vs `fused_moe(method="mmvq")`). Each
kernel runs once into a NaN-filled output and is compared with its reference (max |y - ref| /
max |ref|; FAIL above 1e-4 for the dense float32 outputs, 2e-2 for the MoE's bfloat16); times
are medians of CUDA-graph replays over weight copies that span twice the L2 cache
(`bench/kernels_gpu.py`'s method), activation quantization included.
Exits with status 1 on a mismatch.

    python bench/mmq_gpu.py --switch

times instead, at bf16 activations, `mmq` against dequantize + cuBLAS for the dense decode and
prefill shapes of Qwen3-30B-A3B and Qwen3-8B at M = 16 .. 256, and the MoE layer's "mmq" path
against its dequantize + grouped GEMM path at T = 64 .. 256: where the defaults should switch.

    python bench/mmq_gpu.py --split

times `mmq` on Qwen3-30B-A3B's attention projections (q+k+v, q+k, v in Q6_K, o) at M = 8, 16
and 24 with K split 1, 2, 4, 8 and 16 ways (the partial sums' reduction included), beside the
split `mmq_config` picks: how many programs a batched decode step's dense matmuls need.

    python bench/mmq_gpu.py --cached

times `mmq` against cuBLAS on a bf16 copy of the weight (`--weight-cache-gib`) on the same
projections at M = 2 .. 32: from how many rows the copies should serve (`ops.CACHED_MIN_M`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType  # noqa: E402
from kernels_gpu import copies_for, graph_time_us, random_qtensor, rel_err  # noqa: E402

from moestream.weights.qtensor import QTensor, row_bytes  # noqa: E402

T = GGMLQuantizationType
E, TOPK, HIDDEN, FFN = 128, 8, 2048, 768
TOL = 1e-4  # dense, float32 output; the MoE's bfloat16 output: 2e-2


def dense_case(m: int, n: int, k: int, gen: torch.Generator, reps: int) -> bool:
    from moestream.kernels.mmq import mmq, mmq_config
    from moestream.kernels.mmvq import mmvq, quantize_q8, quantize_q8_ref
    from moestream.kernels.mmvq import mmvq_ref as mmq_ref  # the same product

    w = random_qtensor(T.Q4_K, (n, k), gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out_q = torch.full((m, n), float("nan"), device="cuda")  # float32: a tight check
    out_v = torch.full_like(out_q, float("nan"))

    def run_mmq(w: QTensor) -> None:
        mmq(quantize_q8(x), w, out=out_q)

    def run_mmvq(w: QTensor) -> None:
        for i in range(0, m, 8):  # mmvq takes at most 8 rows
            mmvq(quantize_q8(x[i : i + 8]), w, out=out_v[i : i + 8])

    run_mmq(w)
    run_mmvq(w)
    ref = mmq_ref(quantize_q8_ref(x), w)
    err_q, err_v = rel_err(out_q, ref), rel_err(out_v, ref)
    weights = [w] + [
        QTensor(w.data.clone(), w.qtype, w.shape) for _ in range(copies_for(w.nbytes) - 1)
    ]
    us_q = graph_time_us([lambda w=w_: run_mmq(w) for w_ in weights], reps)
    us_v = graph_time_us([lambda w=w_: run_mmvq(w) for w_ in weights], reps)
    cfg = mmq_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    ok = err_q < TOL and err_v < TOL
    gbs = w.nbytes / us_q / 1e3
    print(
        f"dense Q4_K M={m:3d} N={n:5d} K={k}: mmq {us_q:8.1f} us ({gbs:5.0f} GB/s) | mmvq "
        f"{us_v:8.1f} us | x{us_v / us_q:5.2f} | err mmq {err_q:.1e} mmvq {err_v:.1e} | "
        f"{cfg}{'' if ok else ' FAIL'}",
        flush=True,
    )
    return ok


def moe_case(t: int, gen: torch.Generator, reps: int) -> bool:
    from moestream.kernels.moe import fused_moe
    from moestream.kernels.moe_mmq import moe_mmq
    from moestream.kernels.moe_mmvq import moe_mmvq_ref as moe_mmq_ref  # the same numerics

    qg, qd = T.Q4_K, T.Q6_K
    per_expert = 2 * FFN * row_bytes(qg, HIDDEN) + HIDDEN * row_bytes(qd, FFN)
    c = min(copies_for(min(E, t * TOPK) * per_expert), max(1, (24 << 30) // (E * per_expert)))
    gate = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    up = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    down = random_qtensor(qd, (c * E, HIDDEN, FFN), gen)
    x = torch.randn(t, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    calls, used = [], []
    for i in range(c):  # each call its own routing and slots: cold experts, as layer after layer
        logits = torch.randn(t, E, device="cuda", generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)  # [T, k]
        weights = weights / weights.sum(-1, keepdim=True)
        slot = torch.arange(E, dtype=torch.int32, device="cuda") + i * E
        calls.append((ids, weights, slot))
        used.append(torch.unique(ids).numel())
    ids, weights, slot = calls[0]
    out_q = torch.full((t, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_v = torch.full_like(out_q, float("nan"))
    moe_mmq(x, ids, weights, gate, up, down, slot, out=out_q)
    fused_moe(x, ids, weights, gate, up, down, slot, out=out_v, method="mmvq")
    ref = moe_mmq_ref(x.float(), ids, weights, gate, up, down, slot)
    err_q, err_v = rel_err(out_q, ref), rel_err(out_v, ref)
    us_q = graph_time_us(
        [lambda a=a: moe_mmq(x, a[0], a[1], gate, up, down, a[2], out=out_q) for a in calls], reps
    )
    us_v = graph_time_us(
        [
            lambda a=a: fused_moe(x, a[0], a[1], gate, up, down, a[2], out=out_v, method="mmvq")
            for a in calls
        ],
        reps,
    )
    mean_used = sum(used) / len(used)
    gbs = mean_used * per_expert / us_q / 1e3
    ok = err_q < 2e-2 and err_v < 2e-2  # bfloat16 output
    print(
        f"moe Q4_K/Q6_K T={t:3d} ({mean_used:5.1f} experts): mmq {us_q:8.1f} us ({gbs:5.0f} GB/s)"
        f" | mmvq {us_v:8.1f} us | x{us_v / us_q:5.2f} | err mmq {err_q:.1e} mmvq {err_v:.1e}"
        f"{'' if ok else ' FAIL'}",
        flush=True,
    )
    return ok


def switch_case(m: int, n: int, k: int, qtype: T, gen: torch.Generator, reps: int) -> str:
    """mmq against dequantize + cuBLAS (`dequant_matmul`) on bf16 activations: one line."""
    from moestream.kernels.dequant_mm import dequant_matmul
    from moestream.kernels.mmq import mmq
    from moestream.kernels.mmvq import quantize_q8

    w = random_qtensor(qtype, (n, k), gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    weights = [w] + [
        QTensor(w.data.clone(), w.qtype, w.shape) for _ in range(copies_for(w.nbytes) - 1)
    ]
    us_q = graph_time_us([lambda w=w_: mmq(quantize_q8(x), w, out=out) for w_ in weights], reps)
    us_d = graph_time_us([lambda w=w_: dequant_matmul(x, w, out=out) for w_ in weights], reps)
    best = "mmq" if us_q <= us_d else "dequant"
    return (
        f"switch {qtype.name} M={m:4d} N={n:5d} K={k:5d}: mmq {us_q:8.1f} us | dequant+cuBLAS "
        f"{us_d:8.1f} us | faster: {best}"
    )


def moe_switch_case(t: int, gen: torch.Generator, reps: int) -> str:
    """The MoE layer at T tokens: moe_mmq against the dequantize + grouped GEMM path."""
    from moestream.kernels.moe import fused_moe

    qg, qd = T.Q4_K, T.Q6_K
    per_expert = 2 * FFN * row_bytes(qg, HIDDEN) + HIDDEN * row_bytes(qd, FFN)
    c = min(copies_for(E * per_expert), max(1, (24 << 30) // (E * per_expert)))
    gate = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    up = random_qtensor(qg, (c * E, FFN, HIDDEN), gen)
    down = random_qtensor(qd, (c * E, HIDDEN, FFN), gen)
    x = torch.randn(t, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty((t, HIDDEN), dtype=torch.bfloat16, device="cuda")
    calls = []
    for i in range(c):
        logits = torch.randn(t, E, device="cuda", generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
        slot = torch.arange(E, dtype=torch.int32, device="cuda") + i * E
        calls.append((ids, weights / weights.sum(-1, keepdim=True), slot))
    us = {}
    for method in ("mmq", "dequant"):
        us[method] = graph_time_us(
            [
                lambda a=a, m_=method: fused_moe(
                    x, a[0], a[1], gate, up, down, a[2], out=out, method=m_
                )
                for a in calls
            ],
            reps,
        )
    best = min(us, key=us.get)
    return (
        f"switch moe T={t:4d} (A={t * TOPK}): mmq {us['mmq']:8.1f} us | dequant+grouped GEMM "
        f"{us['dequant']:8.1f} us | faster: {best}"
    )


def split_sweep(gen: torch.Generator, reps: int) -> None:
    """`mmq` per K split on the 30B's attention projections (module docstring)."""
    from moestream.kernels.mmq import mmq, mmq_config
    from moestream.kernels.mmvq import quantize_q8

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(5120, 2048, T.Q4_K), (4608, 2048, T.Q4_K), (512, 2048, T.Q6_K), (2048, 4096, T.Q4_K)]
    for n, k, qtype in shapes:
        w = random_qtensor(qtype, (n, k), gen)
        weights = [w] + [
            QTensor(w.data.clone(), w.qtype, w.shape) for _ in range(copies_for(w.nbytes) - 1)
        ]
        for m in (8, 16, 24):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            default = mmq_config(m, n, k, sms)
            cells = []
            for split in (1, 2, 4, 8, 16):
                if (k // 256) % split:
                    continue
                cfg = default._replace(split_k=split)
                calls = [
                    lambda w=w_, c=cfg, x=x, o=out: mmq(quantize_q8(x), w, out=o, config=c)
                    for w_ in weights
                ]
                us = graph_time_us(calls, reps)
                cells.append(f"split {split:2d} {us:6.1f} us")
            print(
                f"mmq {qtype.name} M={m:2d} N={n:5d} K={k}: "
                + " | ".join(cells)
                + f" | default split {default.split_k}",
                flush=True,
            )


def cached_sweep(gen: torch.Generator, reps: int) -> None:
    """`mmq` (default split, q8 rounding included) against cuBLAS on a bf16 copy of the weight
    (what `--weight-cache-gib` keeps) on the 30B's attention projections at M = 2-32: from how
    many rows the copies should be multiplied (`ops.CACHED_MIN_M`)."""
    import torch.nn.functional as F

    from moestream.kernels.mmq import mmq
    from moestream.kernels.mmvq import quantize_q8

    shapes = [(5120, 2048, T.Q4_K), (512, 2048, T.Q6_K), (2048, 4096, T.Q4_K)]
    for n, k, qtype in shapes:
        w = random_qtensor(qtype, (n, k), gen)
        values = w.dequantize(torch.bfloat16)  # [N, K]
        weights = [w] + [
            QTensor(w.data.clone(), w.qtype, w.shape) for _ in range(copies_for(w.nbytes) - 1)
        ]
        copies = [values] + [values.clone() for _ in range(copies_for(values.nbytes) - 1)]
        for m in (2, 4, 8, 16, 24, 32):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            calls_q = [lambda w=w_, o=out, x=x: mmq(quantize_q8(x), w, out=o) for w_ in weights]
            calls_c = [lambda v=v_, o=out, x=x: torch.matmul(x, v.t(), out=o) for v_ in copies]
            us_q, us_c = graph_time_us(calls_q, reps), graph_time_us(calls_c, reps)
            err = rel_err(F.linear(x.float(), values.float()), F.linear(x, values).float())
            print(
                f"cached {qtype.name} M={m:2d} N={n:5d} K={k}: mmq {us_q:6.1f} us | cuBLAS on "
                f"the bf16 copy {us_c:6.1f} us ({values.nbytes / us_c / 1e3:5.0f} GB/s) | "
                f"faster: {'copy' if us_c < us_q else 'mmq'} | bf16 err {err:.1e}",
                flush=True,
            )


def switch(gen: torch.Generator, reps: int) -> None:
    """Where the default paths should switch (ops.DEQUANT_MIN_M, moe.MMQ_MAX_ASSIGNMENTS)."""
    shapes = [  # Qwen3-30B-A3B q/k/v and o; Qwen3-8B q/k/v, o, gate+up, down
        (5120, 2048, T.Q4_K), (2048, 4096, T.Q4_K), (6144, 4096, T.Q4_K),
        (4096, 4096, T.Q4_K), (24576, 4096, T.Q4_K), (4096, 12288, T.Q6_K),
    ]  # fmt: skip
    for n, k, qtype in shapes:
        for m in (16, 32, 64, 128, 256):
            print(switch_case(m, n, k, qtype, gen, reps), flush=True)
    for t in (64, 128, 256):
        print(moe_switch_case(t, gen, reps), flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    parser.add_argument(
        "--switch", action="store_true",
        help="only time mmq against dequantize + cuBLAS / grouped GEMM (the default switches)",
    )  # fmt: skip
    parser.add_argument(
        "--split", action="store_true", help="only time mmq's K splits on the 30B's projections"
    )
    parser.add_argument(
        "--cached",
        action="store_true",
        help="only time mmq against cuBLAS on bf16 weight copies (the 30B's projections)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device and triton", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs")
    if args.switch:
        switch(gen, args.reps)
        return 0
    if args.split:
        split_sweep(gen, args.reps)
        return 0
    if args.cached:
        cached_sweep(gen, args.reps)
        return 0
    ok = True
    for n, k in ((12288, 4096), (4096, 2048)):
        for m in (8, 16, 32, 64):
            ok &= dense_case(m, n, k, gen, args.reps)
    for t in (8, 16, 32, 64):
        ok &= moe_case(t, gen, args.reps)
        torch.cuda.empty_cache()  # the case's expert stacks
    print("all cases match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
