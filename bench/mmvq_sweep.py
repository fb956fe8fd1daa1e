"""Time the decode GEMV (`mmvq`) variants and launch shapes at the decode shapes of the models.

Usage (repository root):
    python bench/mmvq_sweep.py [--quick] [--reps 20]   # on a CUDA GPU: < 90 s on an H200
    python bench/mmvq_sweep.py --types IQ4_XS,Q4_0     # on a GPU: these types, two shapes
    python bench/mmvq_sweep.py --asm [--types Q4_0,IQ4_NL]  # no GPU needed: the sm_90 build

GPU mode. Shapes: Qwen3-30B-A3B fused q/k/v (N=5120 K=2048), o_proj (2048 x 4096) and the Q6_K
output head (151936 x 2048); Qwen3-8B fused q/k/v (6144 x 4096), o_proj (4096 x 4096), fused
gate+up (24576 x 4096) and down (4096 x 12288, Q6_K); M = 1 and 2. Per shape the weights are
made once (random GGUF blocks, `bench/kernels_gpu.py`) with copies spanning twice the L2 cache
(every launch reads cold weights, as a decode step does) and the activations quantized once;
each configuration runs once into a NaN-filled output, is compared with `mmvq_ref` (max
|y - ref| / max |ref|, FAIL above 1e-4), then timed as the median CUDA-graph replay over the
copies. The time is the `mmvq` launch alone (with the K-split reduction where split_k > 1),
not the activation quantization. GB/s counts weight bytes + activations + output; "% copy"
divides by the device-to-device copy bandwidth. Configurations: the current default
("tile", `mmvq_config`), the "once" default, and "once" over rows per program, groups per step
and K splits at M = 1; at M = 2 the two defaults and the three fastest others at M = 1.
Shapes of one type and K share compiled kernels; a second run reuses Triton's cache. Prints
one line per configuration, then the best per shape and M, and which default was faster on
how many cases. Exits 1 when a check fails.

--asm compiles `_mmvq_kernel` and `mmvq_once._mmvq_once_kernel` for sm_90 with Triton's bundled
tools (no GPU) and prints per type, M_BLOCK and launch shape: registers per thread, stack bytes
(spills), convert_layout ops in the TTGIR, and BAR.SYNC / LDG / SHFL counts in the SASS.
--types picks the types (default Q4_K, Q5_K, Q6_K, Q8_0; the 4-bit code types Q4_0, IQ4_NL,
IQ4_XS and MXFP4 have the "once" kernel only).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType  # noqa: E402

T = GGMLQuantizationType
# (model, matrix, N, K, type): the dense decode matmuls of the Q4_K_M mix
SHAPES = [
    ("30B-A3B", "qkv", 5120, 2048, T.Q4_K),
    ("30B-A3B", "o", 2048, 4096, T.Q4_K),
    ("30B-A3B", "head", 151936, 2048, T.Q6_K),
    ("8B", "qkv", 6144, 4096, T.Q4_K),
    ("8B", "o", 4096, 4096, T.Q4_K),
    ("8B", "gate+up", 24576, 4096, T.Q4_K),
    ("8B", "down", 4096, 12288, T.Q6_K),
]


def defaults(n: int, k: int, sms: int, m: int) -> list:
    """`mmvq_config`'s "tile" (the current default) and "once" choices at M rows."""
    from moestream.kernels.mmvq import mmvq_config

    return [mmvq_config(n, k, sms, m_block(m), variant) for variant in ("tile", "once")]


def candidates(n: int, k: int, quick: bool) -> list:
    """ "once" over rows per program (2-16) at up to 8 groups per step, and where K has 16 groups
    or more, 16 groups per step or a K split of 2 (4 or 8 rows)."""
    from moestream.kernels.mmvq import MmvqConfig

    groups = k // 256
    out = [MmvqConfig(bn, 1, min(8, groups), 4, "once") for bn in (2, 4, 8, 16)]
    if quick:
        return out[:3]
    if groups >= 16:
        for bn in (4, 8):
            out += [MmvqConfig(bn, 1, 16, 4, "once"), MmvqConfig(bn, 2, 8, 4, "once")]
    return out


def m_block(m: int) -> int:
    return 1 << (m - 1).bit_length()


def code_shapes(qtypes: list[GGMLQuantizationType]) -> list[tuple[str, str, int, int, T]]:
    """The timed sweep's shapes for types outside the models' mix (`--types`): an 8B-sized
    fused q/k/v and gate+up-like matrix (6144 x 4096, 12288 x 4096) per type."""
    return [
        ("any", name, n, 4096, t) for t in qtypes for name, n in (("6144", 6144), ("12288", 12288))
    ]


def run_gpu(quick: bool, reps: int, shapes: list | None = None) -> int:
    import torch
    from kernels_gpu import copies_for, copy_bandwidth, graph_time_us, random_qtensor, rel_err

    from moestream.kernels.mmvq import mmvq, mmvq_ref, quantize_q8
    from moestream.weights.qtensor import QTensor

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    copy_gbs = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"device: {props.name}, {sms} SMs; copy bandwidth {copy_gbs:,.0f} GB/s (read + write)")
    print("us: the mmvq launch alone (activations quantized beforehand), cold weights\n")
    best_lines, wins, failed = [], {"tile": 0, "once": 0}, 0
    if shapes is None:
        shapes = SHAPES[:3] if quick else SHAPES
    for model, name, n, k, qtype in shapes:
        w = random_qtensor(qtype, (n, k), gen)
        copies = [w] + [QTensor(w.data.clone(), qtype, w.shape) for _ in
                        range(copies_for(w.nbytes) - 1)]  # fmt: skip
        top: list = []  # M = 2 tries the defaults and the 3 fastest at M = 1
        for m in (1, 2):
            a = quantize_q8(torch.randn(m, k, device="cuda", generator=gen))
            ref = mmvq_ref(a, w)
            out = torch.full((m, n), float("nan"), device="cuda")
            nbytes = w.nbytes + a.q.nbytes + a.d.nbytes + a.s.nbytes + out.nbytes
            base = defaults(n, k, sms, m)
            configs = base + (top if m > 1 else candidates(n, k, quick))
            results = []
            for cfg in dict.fromkeys(configs):
                out.fill_(float("nan"))
                try:
                    mmvq(a, w, out=out, config=cfg)
                    err = rel_err(out, ref)
                    us = graph_time_us(
                        [
                            lambda c=c, a=a, o=out, f=cfg: mmvq(a, c, out=o, config=f)
                            for c in copies
                        ],
                        reps=reps,
                    )
                except Exception as exc:  # a config the compiler rejects: report, go on
                    print(f"  {tuple(cfg)}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                ok = err < 1e-4
                failed += not ok
                gbs = nbytes / us / 1e3
                results.append((us, cfg))
                mark = " (default)" if cfg in base else ""
                print(
                    f"{model:7s} {name:7s} M={m} N={n:6d} K={k:5d} {qtype.name}  {us:8.2f} us"
                    f" {gbs:6,.0f} GB/s {100 * gbs / copy_gbs:3.0f}%  err {err:.1e}"
                    f"{'' if ok else ' FAIL'}  {tuple(cfg)}{mark}",
                    flush=True,
                )
            if not results:
                continue
            results.sort(key=lambda item: item[0])
            top = [cfg for _, cfg in results if cfg not in base][:3]
            us, cfg = results[0]
            gbs = nbytes / us / 1e3
            timed = {c.variant: t for t, c in results if c in base}
            if len(timed) == 2:
                wins[min(timed, key=timed.get)] += 1
            dflt = ", ".join(f"{v} default {t:.2f} us" for v, t in timed.items())
            best_lines.append(
                f"{model:7s} {name:7s} M={m}: best {us:8.2f} us {gbs:6,.0f} GB/s"
                f" {100 * gbs / copy_gbs:3.0f}%  {tuple(cfg)}  ({dflt})"
            )
        del w, copies
        torch.cuda.empty_cache()
    print("\nbest per shape:")
    print("\n".join(best_lines))
    print(f"\nfaster default: tile on {wins['tile']} cases, once on {wins['once']}")
    print(f"{failed} checks failed")
    return 1 if failed else 0


def build_sm90(kernel, qtype: int, m_block: int, block_n: int, g: int, groups: int, warps: int):
    """(convert_layout count, registers, stack bytes, SASS) of `kernel` built for sm_90 (no GPU
    needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    ptrs = {"q_ptr": "*i32", "d_ptr": "*fp32", "s_ptr": "*fp32", "w_ptr": "*u8", "out_ptr": "*fp32"}
    ints = ("M", "N", "stride_qm", "stride_dm", "stride_wn", "stride_os", "stride_om")
    # PDL on, as every launch on sm_90 has it (`pdl.pdl_args`)
    consts = {"GROUPS_PER_SPLIT": groups, "QTYPE": qtype, "BLOCK_N": block_n,
              "M_BLOCK": m_block, "G": g, "ASM": True, "PDL": True}  # fmt: skip
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    names = list(sig)
    aligned = [*ptrs, *ints[2:]]  # pointers and strides: multiples of 16, as at launch
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))  # bytes: > 0 means spills
    return compiled.asm["ttgir"].count("ttg.convert_layout"), regs, stack, sass


def run_asm(qtypes: list[GGMLQuantizationType]) -> int:
    from moestream.kernels import mmvq as mv
    from moestream.kernels import mmvq_once

    print("kernel type M_BLOCK BN  G groups warps | regs stack convert_layout BAR  LDG SHFL")
    for qtype in qtypes:
        sub = 8 if qtype == T.Q8_0 else 4
        for m_block in (1, 2, 8):
            for block_n, g, groups in ((4, 8, 8), (4, 8, 16), (8, 8, 16)):
                cfg = mv.MmvqConfig(block_n, 1, g, 4, "once")
                runs = [("once", mmvq_once._mmvq_once_kernel, mmvq_once.once_warps(cfg, sub))]
                if block_n == 4 and groups == 8 and m_block < 8 and qtype in mv.MMVQ_QTYPES:
                    runs.append(("tile", mv._mmvq_kernel, 4))
                for label, kernel, warps in runs:
                    cvt, regs, stack, sass = build_sm90(kernel, int(qtype), m_block, block_n, g,
                                                 groups, warps)  # fmt: skip
                    counts = [len(re.findall(p, sass)) for p in ("BAR.SYNC", "LDG", "SHFL")]
                    print(
                        f"{label:6s} {qtype.name:5s} {m_block:3d} {block_n:4d} {g:3d} {groups:4d}"
                        f" {warps:4d}  | {regs:4d} {stack:5d} {cvt:6d} {counts[0]:8d}"
                        f" {counts[1]:4d} {counts[2]:4d}",
                        flush=True,
                    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30B-A3B shapes, fewer configs")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    parser.add_argument("--asm", action="store_true", help="sm_90 build check, no GPU")
    parser.add_argument(
        "--types",
        default=None,
        help="comma list of GGML type names: with --asm the types built (default Q4_K,Q5_K,"
        "Q6_K,Q8_0); on a GPU, time these types at two 8B-sized shapes instead of the models'",
    )
    args = parser.parse_args()
    qtypes = None
    if args.types is not None or args.asm:
        from moestream.kernels.ops import MMVQ_DENSE_QTYPES

        names = (args.types or "Q4_K,Q5_K,Q6_K,Q8_0").split(",")
        qtypes = [T[name] for name in names if name in T.__members__]
        if len(qtypes) != len(names) or not set(qtypes) <= MMVQ_DENSE_QTYPES:
            parser.error(f"--types: names from {sorted(t.name for t in MMVQ_DENSE_QTYPES)}")
    if args.asm:
        return run_asm(qtypes)
    return run_gpu(args.quick, args.reps, None if qtypes is None else code_shapes(qtypes))


if __name__ == "__main__":
    sys.exit(main())
