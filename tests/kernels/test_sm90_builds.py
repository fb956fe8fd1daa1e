"""Properties of the GPU builds of kernels, checked without a GPU: the kernels are compiled for
sm_90 with the Triton wheel's own ptxas and their PTX is read. (The interpreter that runs the
other kernel tests on the CPU checks values, not how loads are issued.) The builds run in a
child process: this one may have the interpreter on (TRITON_INTERPRET=1), which cannot
compile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("triton", reason="triton is not installed")

# Compiles KERNEL of moestream.kernels.MODULE with the given constexprs and warps for sm_90
# (the pointers named typed as given, and they and the integer arguments named 16-byte aligned,
# as a launch with aligned tensors specializes them) and prints its PTX, or "SKIP: why" if this
# triton cannot build.
BUILD = r"""
import importlib, json, sys
import triton
module, name, constexprs, warps, pointers, aligned, options = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(f"moestream.kernels.{module}"), name)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"SKIP: {e}"); sys.exit(0)
names = kernel.arg_names
sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if n in pointers or n in aligned}
src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
try:
    options = {"num_warps": warps, **options}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
except (FileNotFoundError, RuntimeError) as e:  # no ptxas in this build
    print(f"SKIP: {type(e).__name__}: {str(e)[:200]}"); sys.exit(0)
print(compiled.asm["ptx"])
"""


def sm90_ptx(
    module: str,
    kernel: str,
    constexprs: dict,
    num_warps: int,
    pointers: dict,
    aligned: set,
    options: dict | None = None,
) -> str:
    """The sm_90 PTX of moestream.kernels.`module`.`kernel` (see BUILD; `options`: more
    compile options, as a launch passes them), built in a child process; skips the test where
    this triton cannot build for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [module, kernel, constexprs, num_warps, pointers, sorted(aligned), options or {}]
    args = json.dumps(args)
    run = subprocess.run(
        [sys.executable, "-c", BUILD, args], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.strip()
    if out.startswith("SKIP:"):
        pytest.skip(f"cannot build for sm_90 here ({out[5:].strip()})")
    return out


MMVQ_POINTERS = {
    "xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "ids_ptr": "*i64",
    "slot_ptr": "*i32", "g_ptr": "*u8", "u_ptr": "*u8", "d_ptr": "*u8", "hq_ptr": "*i32",
    "hd_ptr": "*fp32", "hs_ptr": "*fp32", "addr_ptr": "*i64", "part_ptr": "*fp32",
    "hf_ptr": "*fp32", "count_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*bf16",
}  # fmt: skip
MMVQ_ALIGNED = {"stride_xq", "stride_xd", "stride_ge", "stride_gn", "stride_ue", "stride_un",
                "stride_de", "stride_dn", "stride_ot"}  # fmt: skip


def vector_loads(kernel: str, constexprs: dict, num_warps: int) -> int:
    """128-bit global loads in the sm_90 PTX of moe_mmvq.`kernel`."""
    ptx = sm90_ptx("moe_mmvq", kernel, constexprs, num_warps, MMVQ_POINTERS, MMVQ_ALIGNED)
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))


# The launches of zero-copy placement (`ops` passes `moe_mmvq.ZERO_COPY_CONFIG`: the tile
# gate/up kernel, one group per K step, 4 K splits, 8 warps; the default down kernel) at the
# Qwen3-30B-A3B shapes, Q4_K weights (Q6_K blocks are only 2-byte aligned: no 128-bit loads
# either way).
GATE_UP = dict(F=768, QG=12, QU=12, H_GROUPS=8, TOPK=8, G=1, SPLIT=4, FUSED=True, TREE=False)
GATE_UP.update(ASM=True, PDL=True)
DOWN = dict(
    QD=12, F=768, TOPK=8, BLOCK_N=4, G=4, CHUNK=8, SPLIT=1, TREE=False, ROWS=False, ASM=True
)
DOWN.update(PDL=True, HOST=False, EACH=False)


@pytest.mark.parametrize(
    ("kernel", "constexprs", "num_warps"),
    [("_gate_up_mmvq_kernel", GATE_UP, 8), ("_down_mmvq_kernel", DOWN, 4)],
    ids=["gate_up", "down"],
)
def test_zero_copy_weights_load_as_wide_as_slot_weights(kernel, constexprs, num_warps):
    """The fused MoE reading experts at byte addresses from a table (zero-copy placement, host
    memory over the host link) issues the same 128-bit weight loads as reading them from the
    slot stacks (Q4_K, the Qwen3-30B-A3B shapes). An alignment hint put on the address
    integer instead of the pointer was dropped by the cast: the gate/up kernel then read
    2 128-bit words and 16 32-bit ones where 6 128-bit loads do."""
    slot = vector_loads(kernel, {**constexprs, "ADDR": False}, num_warps)
    addr = vector_loads(kernel, {**constexprs, "ADDR": True}, num_warps)
    assert slot >= 4
    assert addr == slot


def test_expert_page_copies_load_host_memory_16_bytes_wide_past_l1() -> None:
    """The pager's copy kernel (`expert_pager._copy_kernel`, chunks dealt to a grid, each
    weight's size 16-byte aligned as `PagedExperts` requires) reads host memory only in
    128-bit loads that bypass L1 and writes 128-bit stores: its chunk offsets and the weight
    chosen per chunk must not lose the alignment the vector width needs."""
    ptx = sm90_ptx(
        "expert_pager", "_copy_kernel", {"BLOCK": 1024, "PDL": True}, 4,
        {"copy_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i64"}, {"W0", "W1", "W2"},
    )  # fmt: skip
    data_loads = set(re.findall(r"ld\.global(?:\.\w+)*\.b32", ptx)) - {"ld.global.b32"}
    assert data_loads == {"ld.global.cg.v4.b32"}, data_loads  # (b32: the list, b64: tables)
    assert set(re.findall(r"st\.global(?:\.\w+)*", ptx)) == {"st.global.v4.b32"}


GROUPED_POINTERS = {
    "xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "sorted_ptr": "*i32",
    "block_expert_ptr": "*i32", "slot_ptr": "*i32", "g_ptr": "*u8", "u_ptr": "*u8",
    "h_ptr": "*fp32",
}  # fmt: skip
GROUPED_ALIGNED = {"stride_xq", "stride_ge", "stride_gn", "stride_ue", "stride_un"}


def grouped_float_ops(block_n: int, num_warps: int) -> Counter:
    """The float multiply-adds (`fma.rn.f32`) per source line of mmvq_once.py in the sm_90 PTX
    of moe_grouped's gate/up kernel (Q4_K, the Qwen3-30B-A3B shapes, 2 assignments a block)."""
    constexprs = dict(F=768, QG=12, QU=12, H_GROUPS=8, TOPK=8, G=8, BLOCK_M=2, BLOCK_N=block_n,
                      ASM=True, PDL=False)  # fmt: skip
    ptx = sm90_ptx("moe_grouped", "_gate_up_grouped_kernel", constexprs, num_warps,
                   GROUPED_POINTERS, GROUPED_ALIGNED)  # fmt: skip
    ops, line = Counter(), None
    for text in ptx.splitlines():
        if text.strip().startswith(".loc"):
            loc = re.search(r"//\s*mmvq_once\.py:(\d+)", text)
            line = loc.group(1) if loc else None
        if "fma.rn.f32" in text and line:
            ops[f"fma.rn.f32:{line}"] += 1
    return ops


def test_q4_k_min_term_rounds_once_in_every_layout():
    """The Q4_K partial sum's last step, `part - dmin * m` on the half that holds the min term,
    is one fma in every build of the grouped gate/up, whatever its rows and warps. Written as a
    multiply, a select and a subtract, the compiler contracted it into an fma only where the
    layout let it fold the select (one warp: neg + fma.rn; two: selp + sub): one rounding in
    some builds, two in others, and the bits changed with the launch shape on the H200. (A
    `neg.f32` of dmin itself is fine: Triton 3.9 negates with it, 3.6 with a subtract.)"""
    import inspect

    from moestream.kernels import mmvq_once

    src, first = inspect.getsourcelines(mmvq_once._once_q4_k.fn)
    scale_line = first + next(i for i, s in enumerate(src) if "tl.fma(d * sc0" in s)
    min_line = first + next(i for i, s in enumerate(src) if "-dmin" in s)
    for block_n, warps in ((8, 2), (8, 1), (16, 4)):
        ops = grouped_float_ops(block_n, warps)
        scale_fmas = ops.get(f"fma.rn.f32:{scale_line}", 0)
        assert scale_fmas > 0, ops
        # per output element one fma for the scales and two for the min term (its m and the
        # term itself), on the h == 0 half only: as many as the scale fmas in every layout
        assert ops.get(f"fma.rn.f32:{min_line}", 0) == 2 * scale_fmas, ops


# The decode MoE kernels of both paths and the q8 rounding, at the Qwen3-30B-A3B shapes (Q4_K
# gate/up, Q6_K and Q4_K down), as they launch (`kernels.exact.FP_EXACT`).
ONCE = dict(F=768, QG=12, QU=12, H_GROUPS=8, TOPK=8, G=8, BLOCK_N=4, ADDR=False, ASM=True)
ONCE.update(PDL=True, HOST=False)
GROUPED_UP = dict(F=768, QG=12, QU=12, H_GROUPS=8, TOPK=8, G=8, BLOCK_M=2, BLOCK_N=8, ASM=True)
GROUPED_UP.update(PDL=True)
GROUPED_DOWN = dict(QD=14, F=768, G=4, BLOCK_M=2, BLOCK_N=8, ASM=True, PDL=True, TILES=1)
GROUPED_DOWN_POINTERS = {**GROUPED_POINTERS, "hq_ptr": "*i32", "hd_ptr": "*fp32",
                         "hs_ptr": "*fp32", "d_ptr": "*u8", "weights_ptr": "*fp32",
                         "y_ptr": "*fp32"}  # fmt: skip
Q8_POINTERS = {"x_ptr": "*fp32", "q_ptr": "*i32", "d_ptr": "*fp32", "s_ptr": "*fp32"}
EXACT_BUILDS = {
    "once gate/up": ("moe_mmvq", "_gate_up_once_kernel", ONCE, 1, MMVQ_POINTERS, MMVQ_ALIGNED),
    "tile gate/up": ("moe_mmvq", "_gate_up_mmvq_kernel", GATE_UP, 8, MMVQ_POINTERS,
                     MMVQ_ALIGNED),
    "down Q4_K": ("moe_mmvq", "_down_mmvq_kernel", {**DOWN, "ADDR": False}, 4, MMVQ_POINTERS,
                  MMVQ_ALIGNED),
    "down Q6_K": ("moe_mmvq", "_down_mmvq_kernel",
                  {**DOWN, "QD": 14, "BLOCK_N": 8, "ADDR": False}, 1, MMVQ_POINTERS,
                  MMVQ_ALIGNED),
    "grouped gate/up": ("moe_grouped", "_gate_up_grouped_kernel", GROUPED_UP, 1,
                        GROUPED_POINTERS, GROUPED_ALIGNED),
    "grouped down": ("moe_grouped", "_down_grouped_kernel", GROUPED_DOWN, 1,
                     GROUPED_DOWN_POINTERS, {"stride_de", "stride_dn"}),
    "grouped down in tiles": ("moe_grouped", "_down_grouped_kernel",
                              {**GROUPED_DOWN, "QD": 12, "TILES": 4}, 1, GROUPED_DOWN_POINTERS,
                              {"stride_de", "stride_dn"}),
    "q8 rounding": ("mmvq", "_quantize_q8_kernel", dict(BLOCKS=8, PDL=True), 4, Q8_POINTERS,
                    {"stride_xm", "stride_qm", "stride_dm"}),
    # with experts computed by the host (`fused_moe_mmvq(host_rows=...)`): the reproducible down
    "once gate/up, host experts": ("moe_mmvq", "_gate_up_once_kernel", {**ONCE, "HOST": True},
                                   1, MMVQ_POINTERS, MMVQ_ALIGNED),
    "down, host experts": ("moe_mmvq", "_down_mmvq_kernel",
                           {**DOWN, "QD": 270, "BLOCK_N": 4, "CHUNK": 8, "TREE": True,
                            "HOST": True, "EACH": True, "ADDR": False}, 4,
                           {**MMVQ_POINTERS, "each_ptr": "*fp32"},
                           MMVQ_ALIGNED),
    "down, host experts by address": ("moe_mmvq", "_down_mmvq_kernel",
                                      {**DOWN, "QD": 270, "BLOCK_N": 4, "CHUNK": 8, "TREE": True,
                                       "HOST": True, "EACH": True, "ADDR": True}, 4,
                                      {**MMVQ_POINTERS, "each_ptr": "*fp32"},
                                      MMVQ_ALIGNED),
    "host experts' rows added": ("moe_mmvq", "_add_rows_kernel", {"TOPK": 8, "BLOCK_N": 256},
                                 4, {**MMVQ_POINTERS, "each_ptr": "*fp32", "host_ptr": "*fp32"},
                                 {"stride_ot"}),
}  # fmt: skip


@pytest.mark.parametrize("build", sorted(EXACT_BUILDS))
def test_decode_moe_builds_round_every_float_op_as_written(build: str) -> None:
    """In the sm_90 builds of the decode MoE kernels, launched with `FP_EXACT`, every f32
    multiply, add and subtract rounds on its own (`.rn`: neither LLVM nor ptxas contracts it),
    and no approximate instruction is left (`tl.sigmoid` gave `ex2.approx` and `div.full`):
    their bits are a function of their source, which the CPU can reproduce
    (`kernels.exact`)."""
    from moestream.kernels.exact import FP_EXACT

    module, kernel, constexprs, warps, pointers, aligned = EXACT_BUILDS[build]
    ptx = sm90_ptx(module, kernel, constexprs, warps, pointers, aligned, FP_EXACT)
    ops = Counter(re.findall(r"^\s*(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M))
    loose = {op: n for op, n in ops.items() if re.fullmatch(r"(mul|add|sub)(\.ftz)?\.f32", op)}
    approx = {op: n for op, n in ops.items() if ".approx" in op or op.startswith("div.full")}
    assert not loose and not approx, (loose, approx)
    assert sum(n for op, n in ops.items() if op in ("mul.rn.f32", "add.rn.f32")) > 0, ops
