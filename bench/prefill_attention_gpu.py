"""Time the paged prefill-attention kernel's launch configs at Qwen3-30B-A3B shapes (CUDA), or
build them for sm_90 offline (no GPU) and report registers, spills and shared memory.

Usage (repository root):
    python bench/prefill_attention_gpu.py [--quick]   # on a CUDA GPU, < 3 min on an H200
    python bench/prefill_attention_gpu.py --build      # anywhere with triton's ptxas

Shapes: 32 query heads over 4 KV heads of 128, bfloat16 K/V in blocks of 16 tokens, one
sequence: 2048 new tokens over contexts of 2048, 16k and 32k (the 1st, 8th and 16th chunk of
a cold 32k prompt), 1024 new tokens over 32k (a warm prompt sharing its first 31,744 tokens),
512 new tokens over 512.

Timing as bench/attention_gpu.py does it: the call is launched C times in one CUDA graph, each
launch on its own random block table into a K/V pool so that the C launches together read twice
the L2 cache; "us" is the median replay time / C. TFLOP/s counts causal FLOPs: 4 * D * heads *
(sum over queries of the keys each one sees). "err" is max |out - ref| over a subsample of query
rows (first, last and random ones) against torch SDPA in float32 on the sequence's gathered
K/V (repeated for GQA, causal mask offset by the cached context); FAIL above 2e-2. "bits" says
whether a 3000-token prompt gives the same bits prefilled in one chunk as in chunks of
1000/1337/663 and its last token alone (the kernel's chunking invariance, on the real
compiler); FAIL when not.

Configs: the `CONFIGS` list (labels: rows, tile keys, warps, stages, `split` = unmasked tiles
before the diagonal ones, `bt` = one block-table load per tile); the first is the shape of the
kernel before PrefillAttnConfig (64 rows, 64-key tiles, 4 warps, 2 stages, mask on every tile),
the baseline of the summary. (That kernel itself, with its own exponent arithmetic, ran 4,038 us
against this shape's 4,253 at 2048 new tokens over 32k on the H200: bench/RESULTS.md.) Prints
the fastest per case and the config with the least geometric-mean slowdown over all cases.
Exits with status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream.kernels import prefill_attention as pfa  # noqa: E402
from moestream.kernels.prefill_attention import PrefillAttnConfig as C  # noqa: E402

N_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
CASES = [(2048, 2048), (2048, 16384), (2048, 32768), (1024, 32768), (512, 512)]  # (new, ctx)
QUICK_CASES = [(2048, 32768), (1024, 32768), (512, 512)]
REF_ROWS = 48  # query rows checked against the reference per case
CONFIGS = [  # every one builds for sm_90 without spills (--build)
    C(rows=64, block_n=64, num_warps=4, num_stages=2, split_loop=False),  # the old shape
    C(rows=64, block_n=64, num_warps=4, num_stages=3),
    C(rows=64, block_n=64, num_warps=4, num_stages=5),
    C(rows=64, block_n=64, num_warps=4, num_stages=5, bt_tile=True),
    C(rows=128, block_n=64, num_warps=8, num_stages=3),
    C(rows=128, block_n=64, num_warps=8, num_stages=4),
    C(rows=128, block_n=64, num_warps=8, num_stages=5),  # DEFAULT_CONFIG
    C(rows=128, block_n=64, num_warps=8, num_stages=5, bt_tile=True),
    C(rows=128, block_n=64, num_warps=8, num_stages=5, split_loop=False),
    C(rows=128, block_n=128, num_warps=8, num_stages=3),
    C(rows=128, block_n=128, num_warps=8, num_stages=4),
    C(rows=128, block_n=128, num_warps=8, num_stages=5),  # 225 KiB of shared memory
]
QUICK_CONFIGS = [CONFIGS[i] for i in (0, 2, 4, 6, 7, 11)]


# ---- offline sm_90 build --------------------------------------------------------------------
def build_sm90(cfg: C) -> dict:
    """Registers, spill (stack) bytes, shared memory and convert_layout count of the kernel
    built for sm_90 at the 30B shapes (bf16); no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget

    rep = N_HEADS // KV_HEADS
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32",
            "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"}  # fmt: skip
    strides = ("stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
               "stride_vt", "stride_vh", "stride_bt", "stride_ot", "stride_oh")  # fmt: skip
    consts = dict(
        REP=rep, R_PAD=rep, D=HEAD_DIM, D_PAD=HEAD_DIM, KV_BLOCK=BLOCK_SIZE,
        BLOCK_Q=cfg.rows // rep, BLOCK_N=cfg.block_n, DOT_F32=False, WHILE_LOOP=False,
        SPLIT=cfg.split_loop, BT_TILE=cfg.bt_tile,
    )  # fmt: skip
    sig = {**ptrs, "scale_log2e": "fp32", **dict.fromkeys(strides, "i32"),
           **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in (*ptrs, *strides)}
    src = triton.compiler.ASTSource(
        fn=pfa._prefill_kernel, signature=sig, constexprs=consts, attrs=attrs
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )  # fmt: skip
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    return {
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "smem": compiled.metadata.shared,
        "cvt": compiled.asm["ttgir"].count("ttg.convert_layout"),
        "wgmma": compiled.asm["ttgir"].count("ttng.warp_group_dot "),
    }


def run_build() -> int:
    print(f"{'config':28s} {'regs':>5s} {'stack':>6s} {'smem KiB':>9s} {'cvt':>4s} {'wgmma':>6s}")
    for cfg in CONFIGS:
        try:
            r = build_sm90(cfg)
        except Exception as e:  # noqa: BLE001 (out of resources and the like: report, go on)
            print(f"{cfg.label:28s} build failed: {str(e).splitlines()[0][:80]}")
            continue
        flag = "" if r["stack"] == 0 and r["smem"] <= 227 * 1024 else "  DROP"
        print(f"{cfg.label:28s} {r['regs']:5d} {r['stack']:6d} {r['smem'] / 1024:9.1f} "
              f"{r['cvt']:4d} {r['wgmma']:6d}{flag}", flush=True)  # fmt: skip
    return 0


# ---- GPU timing -------------------------------------------------------------------------------
def causal_flops(new: int, ctx: int) -> float:
    """4 * D * heads * sum over the new queries of their visible keys."""
    keys = new * (ctx - new) + new * (new + 1) // 2
    return 4.0 * HEAD_DIM * N_HEADS * keys


def reference_rows(q, k_cache, v_cache, table, ctx: int, rows: torch.Tensor, scale: float):
    """float32 SDPA of the new-token rows `rows` of q [N, n, D] over the sequence's gathered
    K/V (context ctx, the new tokens last) -> [len(rows), n, D]."""
    new = q.shape[0]
    k = k_cache[table.long()].flatten(0, 1)[:ctx].float()  # [L, g, D]
    v = v_cache[table.long()].flatten(0, 1)[:ctx].float()
    k = k.repeat_interleave(N_HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [n, L, D]
    v = v.repeat_interleave(N_HEADS // KV_HEADS, dim=1).transpose(0, 1)
    qs = q[rows].float().transpose(0, 1)  # [n, S, D]
    pos = ctx - new + rows  # [S]
    visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]  # [S, L]
    o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale)
    return o.transpose(0, 1)  # [S, n, D]


def chunk_bits_same(call: Callable, q, k_cache, v_cache, table) -> bool:
    """One 3000-token prompt whole vs in chunks 1000/1337/663 and its last token alone."""
    prompt = q.shape[0]
    whole = call(q, table, [(0, prompt)])
    parts = [call(q[a:b].contiguous(), table, [(a, b)]) for a, b in
             ((0, 1000), (1000, 2337), (2337, prompt), (prompt - 1, prompt))]  # fmt: skip
    chunked = torch.cat(parts[:3])
    return torch.equal(chunked, whole) and torch.equal(parts[3], whole[-1:])


def run_gpu(quick: bool) -> int:
    from bench.kernels_gpu import copies_for, graph_time_us

    t_start = time.perf_counter()
    cases = QUICK_CASES if quick else CASES
    configs = QUICK_CONFIGS if quick else CONFIGS
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB")
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    token_bytes = KV_HEADS * HEAD_DIM * 2 * 2
    copies = {c: copies_for(c[1] * token_bytes) for c in cases}
    num_blocks = max(copies[c] * c[1] for c in cases) // BLOCK_SIZE + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dt)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dt)
    scale = HEAD_DIM**-0.5

    def launcher(cfg):
        return lambda *a: pfa.paged_prefill_attention(*a[:-1], out=a[-1], config=cfg)

    names = [c.label for c in configs]
    base = names[0]  # the shape before PrefillAttnConfig
    failed = False
    results: dict[str, dict] = {n: {} for n in names}
    for new, ctx in cases:
        n_copy = copies[(new, ctx)]
        perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
        width = ctx // BLOCK_SIZE
        tables = [perm[c * width : (c + 1) * width].view(1, width) for c in range(n_copy)]
        q = torch.randn(new, N_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=dt)
        out = torch.empty_like(q)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=dev)
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        rows = torch.randperm(new, generator=gen, device=dev)[: REF_ROWS - 2]
        rows = torch.cat([rows, torch.tensor([0, new - 1], device=dev)]).sort().values
        ref = reference_rows(q, k_cache, v_cache, tables[0][0], ctx, rows, scale)
        flops = causal_flops(new, ctx)
        print(f"\n{new} new tokens over context {ctx}: {flops / 1e12:.2f} TFLOP, {n_copy} "
              f"tables")  # fmt: skip
        print(f"  {'config':28s} {'us':>9s} {'TFLOP/s':>8s} {'err':>9s}")
        for name, cfg in zip(names, configs, strict=True):
            fn = launcher(cfg)
            args = (k_cache, v_cache)
            calls = [partial(fn, q, *args, t, qsl, lens, scale, new, out) for t in tables]
            out.fill_(float("nan"))
            fn(q, k_cache, v_cache, tables[0], qsl, lens, scale, new, out)
            err = (out[rows].float() - ref).abs().max().item()
            us = graph_time_us(calls, reps=10)
            bad = not err <= 2e-2
            failed |= bad
            results[name][(new, ctx)] = us
            print(f"  {name:28s} {us:9.1f} {flops / us / 1e6:8.1f} {err:9.2e}"
                  f"{'  FAIL' if bad else ''}", flush=True)  # fmt: skip
        del ref
    print("\nfastest per case:")
    for c in cases:
        us, name = min((results[n][c], n) for n in names)
        print(f"  {c[0]:5d} new over {c[1]:5d}: {us:9.1f} us {causal_flops(*c) / us / 1e6:6.1f} "
              f"TFLOP/s  {name}  ({base}: {results[base][c]:.1f} us)")  # fmt: skip
    best = {c: min(results[n][c] for n in names) for c in cases}
    slow = {n: math.exp(sum(math.log(results[n][c] / best[c]) for c in cases) / len(cases))
            for n in names}  # fmt: skip
    print("\ngeometric-mean slowdown against the fastest per case:")
    for n in sorted(names, key=slow.get):
        print(f"  {n:28s} {slow[n]:6.3f}")
    print(f"best overall: {min(names, key=slow.get)}  (default: {pfa.DEFAULT_CONFIG.label})")

    print("\nchunking invariance (3000-token prompt, chunks 1000/1337/663, last token alone):")
    prompt = 3000
    q = torch.randn(prompt, N_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=dt)
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    table = perm[: -(-prompt // BLOCK_SIZE)].view(1, -1)
    for name, cfg in zip(names, configs, strict=True):
        fn = launcher(cfg)

        def call(qq, tbl, spans, fn=fn):
            (a, b), o = spans[0], torch.empty_like(qq)
            qsl = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
            lens = torch.tensor([b], dtype=torch.int32, device=dev)
            return fn(qq, k_cache, v_cache, tbl, qsl, lens, scale, b - a, o)

        same = chunk_bits_same(call, q, k_cache, v_cache, table)
        failed |= not same
        print(f"  {name:28s} bits {'same' if same else 'DIFFER  FAIL'}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; {'FAIL' if failed else 'all checks ok'}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 cases, 6 configs")
    parser.add_argument("--build", action="store_true", help="offline sm_90 build of each config")
    args = parser.parse_args()
    if args.build:
        return run_build()
    if not torch.cuda.is_available():
        print("needs a CUDA device (or --build)")
        return 2
    return run_gpu(args.quick)


if __name__ == "__main__":
    sys.exit(main())
