"""Time the prefill dequantizer (`dequant_mm.dequantize_rows`) over launch shapes, per GGUF type
and weight shape, and print the fixed per-type table (`dequant_mm.DEQUANT_SHAPES`) to paste.

Usage (repository root):
    python bench/dequant_sweep.py [--quick] [--autotune]   # on a CUDA GPU: < 3 min on an H200
    python bench/dequant_sweep.py --sass                   # no GPU needed: the sm_90 build

GPU mode. Shapes: the Qwen3-30B-A3B MoE stacks as prefill dequantizes them (128 experts, all
with tokens, through a permuted slot table: gate/up [128, 768, 2048] into half of a stacked
[128, 1536, 2048] buffer, down [128, 2048, 768]) and dense [4096, 2048], [2048, 4096],
[151936, 2048] (the output head) and [12288, 4096]; every supported type (Q4_K, Q6_K, Q5_K,
Q8_0, Q2_K, Q3_K; --quick: Q4_K and Q6_K, fewer shapes and launch shapes). Weights are random
GGUF blocks with small float16 scales (`kernels_gpu.random_qtensor`); outputs bfloat16. Per
launch shape: the median of CUDA-event times (`triton.testing.do_bench`, which clears the L2
between runs), GB/s as (bytes read + bytes written) / time and as bytes written / time, "%
copy" = the first over the device-to-device copy bandwidth of a bfloat16 tensor of the
output's size (read + written, measured per shape), and "bits": whether the output equals the
current kernel's ("planes 16x1", the per-plane order the autotuner used to pick from) bit for
bit; the baseline's first rows are also checked against the torch reference. Prints one line
per launch shape, the fastest per (type, shape), then a `DEQUANT_SHAPES` table: per type the
launch shape with the least total time over its shapes, plus a per-(type, K) entry where
another one is more than 3% faster at that K. Exits 1 when a check fails.

--autotune also runs Triton's autotuner over the older candidates (`TUNE_CONFIGS`, both store
orders) per (type, shape) and prints its pick: what the per-process tuning used to choose.

--sass compiles `_dequant_kernel` for sm_90 with Triton's bundled tools (no GPU) per type and
launch shape and prints registers per thread, spill (stack) bytes, convert_layout ops in the
TTGIR and the SASS's global stores by width (STG.E.128 / .64 / 32-bit / .U16, ".EF":
evict-first), global loads and shared-memory ops.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from moestream.kernels.dequant_mm import DequantShape  # noqa: E402
from moestream.weights.qtensor import QTensor  # noqa: E402

T = GGMLQuantizationType
DEVICE = "cuda"
TYPES = (T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q2_K, T.Q3_K)
# (name, experts or 0 for a 2-D weight, rows, K)
SHAPES = (
    ("moe gate/up", 128, 768, 2048),
    ("moe down", 128, 2048, 768),
    ("dense", 0, 4096, 2048),
    ("dense", 0, 2048, 4096),
    ("head", 0, 151936, 2048),
    ("dense", 0, 12288, 4096),
)
BASELINE = DequantShape(16, 1, 4, planes=True)  # the current kernel's values (and a timing)
CANDIDATES = (
    BASELINE,
    DequantShape(8, 1, 4, stream=True),
    DequantShape(8, 2, 4, stream=True),
    DequantShape(16, 1, 4, stream=True),
    DequantShape(16, 2, 4, stream=True),
    DequantShape(16, 2, 4),
    DequantShape(8, 4, 4, stream=True),
    DequantShape(16, 4, 8, stream=True),
    DequantShape(32, 2, 8, stream=True),
    DequantShape(4, 2, 2, stream=True),
)
QUICK = (0, 2, 4, 5, 7)  # indices into CANDIDATES


def label(s: DequantShape) -> str:
    order = "planes" if s.planes else "k-order"
    return f"{order} {s.block_r}x{s.groups} w{s.warps}{' cs' if s.stream else ''}"


def literal(s: DequantShape) -> str:
    extra = (", stream=True" if s.stream else "") + (", planes=True" if s.planes else "")
    return f"DequantShape({s.block_r}, {s.groups}, {s.warps}{extra})"


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=3, rep=20, return_mode="median")


def make_case(qtype: T, e: int, rows: int, k: int, up_half: bool, gen) -> tuple:
    """(weight, out, (expert_slot, counts)) on the GPU: a 2-D weight (e == 0), or an expert
    stack read through a permuted slot table with every expert chosen; `up_half` writes the
    second half of a stacked [E, 2F, K] buffer (a strided view), as the MoE does."""
    from kernels_gpu import random_qtensor

    w = random_qtensor(qtype, (e, rows, k) if e else (rows, k), gen)
    if not e:
        return w, torch.empty((rows, k), dtype=torch.bfloat16, device=DEVICE), (None, None)
    slot = torch.randperm(e, device=DEVICE, generator=gen).to(torch.int32)
    counts = torch.ones(e, dtype=torch.int32, device=DEVICE)
    out = torch.empty((e, 2 * rows if up_half else rows, k), dtype=torch.bfloat16, device=DEVICE)
    return w, out[:, -rows:], (slot, counts)


def copy_gbs(numel: int) -> float:
    """GB/s (read + written) of a device-to-device copy of `numel` bfloat16 values."""
    src = torch.empty(numel, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src)) / 1e6


def reference_check(w: QTensor, out: torch.Tensor, slot: torch.Tensor | None) -> str | None:
    """Rows 0..7 of slot 0 in `out` against the torch reference dequantization rounded to
    bfloat16: None when equal, else how many values differ; a FAIL when any is off by more
    than one bfloat16 step (the GPU may contract q * s - m into an FMA: an ulp of float32)."""
    k = w.shape[-1]
    head = QTensor((w.data[0] if slot is not None else w.data)[:8].cpu(), w.qtype, (8, k))
    rows = out[int((slot == 0).nonzero()[0])] if slot is not None else out  # [R, K]
    got, ref = rows[:8].cpu().float(), head.dequantize().to(torch.bfloat16).float()
    if torch.equal(got, ref):
        return None
    off = (got - ref).abs() > 2.0**-7 * ref.abs()
    return (
        f"{int((got != ref).sum())} of {ref.numel()} values differ{': FAIL' if off.any() else ''}"
    )


# The launch shapes the dequantizer was autotuned over per process before DEQUANT_SHAPES:
# (rows, groups, warps), each in both store orders.
TUNE_CONFIGS = ((8, 1, 4), (8, 2, 4), (16, 1, 4), (16, 2, 4), (32, 1, 8), (32, 2, 8))


@functools.cache
def tuned_kernel():
    """`_dequant_kernel` under Triton's autotuner over TUNE_CONFIGS, keyed by type, rows and
    K, timed on the first call of each key: the policy DEQUANT_SHAPES replaced."""
    import triton

    from moestream.kernels.dequant_mm import _dequant_kernel

    configs = [
        triton.Config({"BLOCK_R": r, "GROUPS": g, "PLANES": p}, num_warps=w)
        for r, g, w in TUNE_CONFIGS
        for p in (False, True)
    ]
    return triton.autotune(configs, key=["R", "K", "QTYPE"], warmup=5, rep=20)(_dequant_kernel)


def autotuned(w: QTensor, out: torch.Tensor, slot, counts) -> str:
    """The per-process autotuner's pick (`tuned_kernel`, timed on this call) and its time."""
    import triton

    from moestream.kernels.dequant_mm import MAGIC

    tuned = tuned_kernel()
    data = w.data if slot is not None else w.data[None]  # [S, N, row_bytes]
    out3 = out if out.dim() == 3 else out[None]  # [E, R, K]
    r, k = out3.shape[1], out3.shape[2]

    def grid(meta: dict) -> tuple[int, int]:
        blocks = triton.cdiv(r, meta["BLOCK_R"]) * triton.cdiv(k // 256, meta["GROUPS"])
        return blocks, out3.shape[0]

    args = (
        data, data if slot is None else slot, data if counts is None else counts, out3, r, k,
        data.stride(0), data.stride(1), out3.stride(0), out3.stride(1), MAGIC,
    )  # fmt: skip
    flags = {"QTYPE": int(w.qtype), "HAS_SLOT": slot is not None, "HAS_COUNT": slot is not None}
    tuned[grid](*args, STREAM=False, **flags)
    ms = median_ms(lambda: tuned[grid](*args, STREAM=False, **flags))
    return f"autotuned: {tuned.best_config}  {ms * 1e3:.1f} us"


def sweep_case(qtype: T, name: str, e: int, rows: int, k: int, cands, gen, autotune: bool,
               totals: dict) -> tuple[int, str]:  # fmt: skip
    """Time every launch shape at one (type, shape); add the times to `totals`. Returns
    (failed checks, the line of the fastest)."""
    from moestream.kernels.dequant_mm import dequantize_rows

    w, out, (slot, counts) = make_case(qtype, e, rows, k, name == "moe gate/up", gen)
    nread, nwrite = w.nbytes, out.numel() * out.element_size()
    copy = copy_gbs(out.numel())
    what = f"{qtype.name} {name:11s} {tuple(w.shape)}"
    print(f"\n{what}: copy {copy:,.0f} GB/s (r+w)", flush=True)
    dequantize_rows(w, out, slot, counts, shape=BASELINE)
    expect = out.clone()
    failed = 0
    if (diff := reference_check(w, expect, slot)) is not None:
        print(f"  baseline against the torch reference: {diff}")
        failed += diff.endswith("FAIL")
    results = []
    for cand in cands:
        out.fill_(float("nan"))
        dequantize_rows(w, out, slot, counts, shape=cand)
        same = torch.equal(out.view(torch.int16), expect.view(torch.int16))
        failed += not same
        ms = median_ms(lambda c=cand: dequantize_rows(w, out, slot, counts, shape=c))
        results.append((ms, cand))
        for key in ((qtype, None), (qtype, k)):
            totals.setdefault(key, Counter())[cand] += ms
        gbs = (nread + nwrite) / ms / 1e6
        print(
            f"  {label(cand):22s} {ms * 1e3:8.1f} us {gbs:7,.0f} GB/s r+w"
            f" {nwrite / ms / 1e6:7,.0f} w  {100 * gbs / copy:3.0f}% copy"
            f"  bits {'equal' if same else 'DIFFER: FAIL'}",
            flush=True,
        )
    if autotune:
        print(f"  {autotuned(w, out, slot, counts)}", flush=True)
    ms, cand = min(results, key=lambda item: item[0])
    gbs = (nread + nwrite) / ms / 1e6
    base_ms = {c: t for t, c in results}.get(BASELINE, float("nan"))
    line = (
        f"{what}: {label(cand):22s} {ms * 1e3:8.1f} us {gbs:7,.0f} GB/s"
        f" {100 * gbs / copy:3.0f}% copy  (baseline {base_ms * 1e3:.1f} us)"
    )
    return failed, line


def run_gpu(quick: bool, autotune: bool) -> int:
    types = TYPES[:2] if quick else TYPES
    shapes = SHAPES[:3] + SHAPES[4:5] if quick else SHAPES
    cands = [CANDIDATES[i] for i in QUICK] if quick else list(CANDIDATES)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    failed = 0
    best_lines: list[str] = []
    totals: dict[tuple[T, int | None], Counter] = {}  # (type, K or None) -> shape -> ms
    for qtype in types:
        for name, e, rows, k in shapes:
            bad, line = sweep_case(qtype, name, e, rows, k, cands, gen, autotune, totals)
            failed += bad
            best_lines.append(line)
            torch.cuda.empty_cache()
    print("\nfastest per (type, shape):")
    print("\n".join(best_lines))
    print("\nDEQUANT_SHAPES = {  # bench/dequant_sweep.py on", torch.cuda.get_device_name())
    for qtype in types:
        overall = totals[(qtype, None)]
        pick = min(overall, key=overall.get)
        print(f"    (T.{qtype.name}, None): {literal(pick)},")
        for k in sorted({s[3] for s in shapes}):
            per_k = totals[(qtype, k)]
            best = min(per_k, key=per_k.get)
            if per_k[best] < 0.97 * per_k[pick]:
                print(f"    (T.{qtype.name}, {k}): {literal(best)},")
    print("}")
    print(f"{failed} checks failed")
    return 1 if failed else 0


def build_sm90(qtype: int, shape: DequantShape, moe: bool) -> dict[str, object]:
    """Registers, stack bytes, convert_layout ops and SASS memory-op counts of `_dequant_kernel`
    built for sm_90 at a launch shape (pointers and strides taken as multiples of 16, as at the
    MoE and dense shapes above)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from moestream.kernels.dequant_mm import _dequant_kernel

    ptrs = {"w_ptr": "*u8", "slot_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*bf16"}
    ints = {"R": "i32", "K": "i32", "stride_we": "i64", "stride_wr": "i32", "stride_oe": "i32",
            "stride_or": "i32", "magic": "i32"}  # fmt: skip
    consts = {
        "QTYPE": qtype, "BLOCK_R": shape.block_r, "GROUPS": shape.groups, "HAS_SLOT": moe,
        "HAS_COUNT": moe, "STREAM": shape.stream, "PLANES": shape.planes,
    }  # fmt: skip
    sig = {**ptrs, **ints, **dict.fromkeys(consts, "constexpr")}
    names = list(sig)
    aligned = [*ptrs, "K", "stride_we", "stride_wr", "stride_oe", "stride_or"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = triton.compiler.ASTSource(
        fn=_dequant_kernel, signature=sig, constexprs=consts, attrs=attrs
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": shape.warps}
    )
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    ops = Counter(re.findall(r"\b((?:STG|LDG|STS|LDS|STSM|LDSM)\.[\w.]+|BAR\.SYNC)", sass))
    return {
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "converts": compiled.asm["ttgir"].count("convert_layout"),
        "ops": ops,
    }


def run_sass() -> int:
    print("sm_90 build of _dequant_kernel (bf16 out; counts are per program, loop bodies once)")
    print("type  launch shape            regs stack cvt  stores | loads | shared")
    for qtype in TYPES:
        for cand in CANDIDATES:
            info = build_sm90(int(qtype), cand, moe=True)
            ops = info["ops"]
            stores = " ".join(f"{op}x{n}" for op, n in sorted(ops.items()) if op.startswith("STG"))
            loads = " ".join(f"{op}x{n}" for op, n in sorted(ops.items()) if op.startswith("LDG"))
            shared = sum(n for op, n in ops.items() if not op.startswith(("STG", "LDG")))
            print(
                f"{qtype.name:5s} {label(cand):22s} {info['regs']:4d} {info['stack']:5d}"
                f" {info['converts']:3d}  {stores} | {loads} | {shared}",
                flush=True,
            )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Q4_K and Q6_K, fewer shapes")
    p.add_argument("--autotune", action="store_true", help="also the per-process autotuner's pick")
    p.add_argument("--sass", action="store_true", help="sm_90 build report (no GPU needed)")
    args = p.parse_args()
    if args.sass:
        return run_sass()
    if not torch.cuda.is_available():
        print("no CUDA device: use --sass for the offline build report")
        return 2
    return run_gpu(args.quick, args.autotune)


if __name__ == "__main__":
    sys.exit(main())
