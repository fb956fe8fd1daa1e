"""Build statistics of the fused MoE mmq kernels for sm_90, without a GPU: registers, spills,
shared memory, cp.async copies, global loads by width and the occupancy they allow, per launch
variant (warps, pipeline stages, BLOCK_N, BLOCK_M, register cap).

Usage (repository root; no GPU needed, the Triton wheel's own ptxas compiles):
    python bench/sm90_builds.py [--quick] [--jobs N]
    python bench/sm90_builds.py --decode    # the decode-sized MoE kernels (below) instead

Each variant of `moe_mmq._moe_gate_up_kernel` and `moe_mmq._moe_down_kernel` at the
Qwen3-30B-A3B shapes (H = 2048: 8 groups of 256, F = 768, top-8; gate/up Q4_K, down Q6_K and
Q4_K) is compiled for sm_90 as a launch with aligned tensors specializes it (pointers and the
strides that are multiples of 16 carry `tt.divisibility` 16; Q6_K's 630-byte rows do not), the
way `tests/kernels/test_sm90_builds.py` does. Registers and spills come from ptxas's own
report (`-v`; `CompiledKernel.n_regs` / `n_spills` need a CUDA driver), shared memory from the
build's metadata, cp.async copies and global loads are counted in the PTX (static instructions:
a pipelined loop's prologue copies count too). "blocks/SM" is the occupancy calculator's bound
on an H200 (sm_90): 64 K registers in 4 quarters that each hold whole warps (registers
allocated 256 per warp), 228 KiB shared memory with 1 KiB reserved per block, 32 blocks, 64
warps. "maxnreg" is Triton's launch option (`.maxnreg` in the PTX): ptxas spills
what does not fit, and may use up to the cap where it uses fewer without one.

The last column counts the build's SASS instructions (static, by the Triton wheel's nvdisasm)
and, in brackets, warp instructions per output row of a program (rows x tiles, all its warps).

`--decode`: the "mmvq" path's down kernel (`moe_mmvq._down_mmvq_kernel`, padded Q6_K, 4 rows;
BM = its expert split) and the grouped path's gate/up (`moe_grouped._gate_up_grouped_kernel`,
Q4_K; BM = assignments a block) over warps and rows, as `bench/scripts/gpu_figures.sh` s11a
and s11c compare them on the GPU; and the grouped path's down (`_down_grouped_kernel`, padded
Q6_K and Q4_K, 2 assignments a block; its "stages" column holds the groups of 256 a step, 4:
F = 768's three at once, one masked; 1: one at a time), as `bench/kernels_gpu.py
--sweep-moe-down` times them, in row tiles as well (`MoeGroupedConfig.down_tiles`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import os
import re
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

F, H_GROUPS, TOPK = 768, 8, 8  # Qwen3-30B-A3B: expert FFN, hidden / 256, experts per token
Q4_K, Q6_K = 12, 14
QTYPE_NAMES = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
POINTERS = {
    "xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "sorted_ptr": "*i32",
    "block_expert_ptr": "*i32", "slot_ptr": "*i32", "g_ptr": "*u8", "u_ptr": "*u8",
    "h_ptr": "*fp32", "hq_ptr": "*i8", "hd_ptr": "*fp32", "hs_ptr": "*fp32", "d_ptr": "*u8",
    "weights_ptr": "*fp32", "y_ptr": "*fp32",
}  # fmt: skip
# Integer arguments that are multiples of 16 at T = 32 (A = 256 assignments, E = 128, H = 2048,
# the activations' rows, the expert stacks, Q4_K's 1152-byte gate/up rows; `build` adds the
# 432-byte rows of Q4_K down).
ALIGNED = {"A", "E", "H", "stride_xm", "stride_dm", "stride_ge", "stride_gn", "stride_ue",
           "stride_un", "stride_de"}  # fmt: skip
SM90_REGS_PER_QUARTER, SM90_SMEM, SM90_BLOCKS, SM90_WARPS = 16384, 228 * 1024, 32, 64
# The bytes operand of `cp.async.ca|cg.shared.global [dst], [src], bytes, ...` in PTX.
CP_ASYNC_SIZE = re.compile(
    r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(\w+)"
)


class Variant(NamedTuple):
    kernel: str  # "gate_up" or "down"
    qtype: int  # the weights' GGML type (gate and up alike)
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    tiles: int = 1  # the grouped down's row tiles a program (`MoeGroupedConfig.down_tiles`)


class Build(NamedTuple):
    variant: Variant
    mma: str  # "wgmma" or "mma.sync"
    regs: int
    spill_stores: int  # bytes
    spill_loads: int
    shared: int  # bytes of dynamic shared memory per block
    cp_async: Counter  # copies by bytes (4, 8, 16)
    loads: Counter  # ld.global by bytes per thread (1, 2, 4, 8, 16)
    sass: int  # SASS instructions of a thread's (static) code, 0 where nvdisasm is missing


def variants(quick: bool) -> list[Variant]:
    """Gate/up (Q4_K) and down (Q6_K, Q4_K) at BLOCK_M 16 over warps x stages x BLOCK_N x
    maxnreg, and BLOCK_M 32 (the mean 17-32 assignments per expert) at BLOCK_N 64, 3 stages.
    `quick`: the current launch (2 warps, 3 stages, BLOCK_N 64) and a few changes of it."""
    kernels = [("gate_up", Q4_K), ("down", Q6_K), ("down", Q4_K)]
    if quick:
        shapes = [(16, 64, 2, 3, None), (16, 64, 2, 3, 128), (16, 64, 4, 3, None),
                  (16, 64, 4, 3, 128), (16, 64, 2, 1, None)]  # fmt: skip
    else:
        shapes = list(itertools.product([16], [32, 64, 128], [2, 4], [1, 2, 3, 4],
                                        [None, 96, 128, 168]))  # fmt: skip
        shapes += list(itertools.product([32], [64], [4, 8], [3], [None, 128]))
    return [Variant(k, q, *shape) for k, q in kernels for shape in shapes]


def _ptxas_report(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v`."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas report in the build's output: {log[-300:]!r}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def _load_widths(ptx: str) -> Counter:
    """ld.global instructions by bytes per thread (vector length x element width)."""
    widths = Counter()
    for suffix in re.findall(r"\bld\.global((?:\.[\w:]+)+)", ptx):
        parts = suffix.split(".")
        vec = 4 if "v4" in parts else 2 if "v2" in parts else 1
        bits = int(re.fullmatch(r"[bsuf](\d+)", parts[-1]).group(1))
        widths[vec * bits // 8] += 1
    return widths


def sass_count(compiled) -> int:
    """Static SASS instructions of a build (the Triton wheel's nvdisasm; 0 without it)."""
    import subprocess
    import tempfile

    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.is_file():
        return 0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    return len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+\S", sass, flags=re.MULTILINE))


def compile_sm90(kernel, constexprs: dict, pointers: dict, aligned: set, options: dict):
    """(compiled kernel, ptxas log) of `kernel` built fresh for sm_90 (so that ptxas runs and
    reports), as a launch with aligned tensors specializes it: `pointers` (name -> type) and the
    integer arguments in `aligned` carry `tt.divisibility` 16."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in pointers or n in aligned}  # fmt: skip
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    knobs.compilation.always_compile = True  # a cached build skips ptxas and its report
    knobs.nvidia.dump_ptxas_log = True  # printed to stdout
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, log.getvalue()


def build(v: Variant) -> Build:
    """Compile one variant for sm_90."""
    from moestream.kernels import moe_mmq

    if v.kernel == "gate_up":
        kernel = moe_mmq._moe_gate_up_kernel
        constexprs = dict(F=F, QG=v.qtype, QU=v.qtype, H_GROUPS=H_GROUPS, TOPK=TOPK)
    else:
        kernel = moe_mmq._moe_down_kernel
        constexprs = dict(F=F, QD=v.qtype)
    constexprs.update(BLOCK_M=v.block_m, BLOCK_N=v.block_n, ASM=True)
    aligned = ALIGNED | ({"stride_dn"} if v.qtype == Q4_K else set())  # Q6_K rows: 630 B
    options = {"num_warps": v.num_warps, "num_stages": v.num_stages}
    if v.maxnreg is not None:
        options["maxnreg"] = v.maxnreg
    compiled, log = compile_sm90(kernel, constexprs, POINTERS, aligned, options)
    ptx = compiled.asm["ptx"]
    copies = Counter(int(size, 0) for size in CP_ASYNC_SIZE.findall(ptx))
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync"
    regs, stores, loads = _ptxas_report(log)
    return Build(v, mma, regs, stores, loads, compiled.metadata.shared, copies, _load_widths(ptx),
                 sass_count(compiled))  # fmt: skip


# The decode-sized MoE kernels (`--decode`): the "mmvq" path's down kernel (padded Q6_K, its
# rows tile; block_m = the expert split) and the grouped path's gate/up (Q4_K; block_m =
# assignments a block), over the launch shapes `gpu_figures.sh` s11a and s11c compare.
DECODE_POINTERS = {
    "hq_ptr": "*i32", "hd_ptr": "*fp32", "hs_ptr": "*fp32", "ids_ptr": "*i32",
    "weights_ptr": "*fp32", "slot_ptr": "*i32", "d_ptr": "*u8", "out_ptr": "*bf16",
    "addr_ptr": "*i64", "part_ptr": "*fp32", "count_ptr": "*i32", "xq_ptr": "*i32",
    "xd_ptr": "*fp32", "xs_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
    "g_ptr": "*u8", "u_ptr": "*u8", "h_ptr": "*fp32", "y_ptr": "*fp32", "each_ptr": "*fp32",
}  # fmt: skip
DECODE_ALIGNED = {"H", "stride_de", "stride_dn", "stride_ot", "stride_xq", "stride_ge",
                  "stride_gn", "stride_ue", "stride_un"}  # fmt: skip


def decode_variants() -> list[Variant]:
    """(kernel, block_m, rows, warps): the mmvq down at splits 1/2/4 and 1/2/4 warps; the grouped
    gate/up at 2 and 4 assignments a block, 4 and 8 rows, 1 and 2 warps."""
    down = [Variant("mmvq_down", Q6_K, s, 4, w, 1, None) for s in (1, 2, 4) for w in (4, 2, 1)]
    up = [Variant("grouped_gate_up", Q4_K, m, n, w, 1, None)
          for m in (2, 4) for n in (8, 4) for w in (2, 1)]  # fmt: skip
    # the grouped down (num_stages: its groups a step, 4 = F's three at once, one masked; in row
    # tiles, one group a step across them)
    grouped_down = [
        Variant("grouped_down", q, 2, n, w, g, None)
        for q in (Q6_K, Q4_K)
        for n in (8, 16)
        for w in (1, 2)
        for g in (4, 1)
    ]
    grouped_down += [Variant("grouped_down", q, 2, 8, w, 1, None, t)
                     for q in (Q6_K, Q4_K) for t in (2, 4) for w in (1, 2)]  # fmt: skip
    return down + up + grouped_down


def build_decode(v: Variant) -> Build:
    """Compile one decode variant for sm_90."""
    from moestream.kernels import moe_grouped, moe_mmvq
    from moestream.kernels._triton_dequant import Q6_KP

    q6_kp = int(Q6_KP.value)  # the padded Q6_K's kernel type, as a plain int constexpr

    if v.kernel == "grouped_down":
        kernel = moe_grouped._down_grouped_kernel
        qd = q6_kp if v.qtype == Q6_K else v.qtype
        constexprs = dict(QD=qd, F=F, G=v.num_stages, BLOCK_M=v.block_m, BLOCK_N=v.block_n,
                          ASM=True, PDL=False, TILES=v.tiles)  # fmt: skip
    elif v.kernel == "mmvq_down":
        kernel = moe_mmvq._down_mmvq_kernel
        constexprs = dict(QD=q6_kp, F=F, TOPK=TOPK, BLOCK_N=v.block_n, G=4,
                          CHUNK=TOPK // v.block_m, SPLIT=v.block_m, TREE=False, ROWS=True,
                          ADDR=False, ASM=True, PDL=False, HOST=False,
                          EACH=False)  # fmt: skip
    else:
        kernel = moe_grouped._gate_up_grouped_kernel
        constexprs = dict(F=F, QG=v.qtype, QU=v.qtype, H_GROUPS=H_GROUPS, TOPK=TOPK, G=8,
                          BLOCK_M=v.block_m, BLOCK_N=v.block_n, ASM=True,
                          PDL=False)  # fmt: skip
    options = {"num_warps": v.num_warps}
    compiled, log = compile_sm90(kernel, constexprs, DECODE_POINTERS, DECODE_ALIGNED, options)
    regs, stores, loads = _ptxas_report(log)
    ptx = compiled.asm["ptx"]
    return Build(v, "-", regs, stores, loads, compiled.metadata.shared, Counter(),
                 _load_widths(ptx), sass_count(compiled))  # fmt: skip


def blocks_per_sm(regs: int, warps: int, shared: int) -> int:
    """Resident blocks per SM on sm_90 (the CUDA occupancy calculator's rules)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (SM90_REGS_PER_QUARTER // per_warp) * 4 // warps
    by_smem = SM90_SMEM // (shared + 1024)
    return min(SM90_BLOCKS, SM90_WARPS // warps, by_regs, by_smem)


def _try_build(v: Variant) -> Build | str:
    try:
        return build(v) if v.kernel in ("gate_up", "down") else build_decode(v)
    except Exception as exc:  # a variant the compiler rejects: one row says why
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"


def row(v: Variant, b: Build | str) -> str:
    kernel = f"{v.kernel} {QTYPE_NAMES[v.qtype]}" + (f", {v.tiles} tiles" if v.tiles > 1 else "")
    shape = (kernel, v.block_m, v.block_n, v.num_warps, v.num_stages, v.maxnreg or "-")
    if isinstance(b, str):
        cells = (*shape, f"FAILED {b}")
    else:
        blocks = blocks_per_sm(b.regs, v.num_warps, b.shared)
        copies = "/".join(str(b.cp_async[n]) for n in (16, 8, 4))
        loads = "/".join(str(b.loads[n]) for n in (16, 8, 4, 2, 1))
        spills = f"{b.spill_stores}/{b.spill_loads}" if b.spill_stores or b.spill_loads else "0"
        occupancy = f"{100 * blocks * v.num_warps / SM90_WARPS:.1f}%"
        rows = v.block_n * v.tiles
        sass = f"{b.sass} ({b.sass * v.num_warps / rows:.0f})" if b.sass else "-"
        cells = (*shape, b.mma, b.regs, spills, b.shared, copies, loads, blocks, occupancy, sass)
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 variants per kernel, not 100")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel builds")
    parser.add_argument(
        "--decode", action="store_true", help="the decode-sized MoE kernels' shapes instead"
    )
    args = parser.parse_args()
    # The interpreter (TRITON_INTERPRET=1, as the CPU tests set it) cannot compile; the builds
    # run in children that inherit this environment and import triton after it is cleared.
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    todo = decode_variants() if args.decode else variants(args.quick)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        builds = list(pool.map(_try_build, todo))
    command = " ".join(["python", *sys.argv])
    print(f"`{command}`: triton {triton.__version__}, sm_90, {datetime.date.today()}\n")
    header = ("kernel", "BM", "BN", "warps", "stages", "maxnreg", "mma", "regs",
              "spill st/ld B", "smem B", "cp.async 16/8/4 B", "ld.global 16/8/4/2/1 B",
              "blocks/SM", "occupancy", "SASS (warp instr. a row)")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for v, b in zip(todo, builds, strict=True):
        print(row(v, b), flush=True)
    failed = sum(isinstance(b, str) for b in builds)
    return 1 if failed == len(builds) else 0


if __name__ == "__main__":
    sys.exit(main())
