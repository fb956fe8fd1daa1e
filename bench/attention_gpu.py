"""Time the paged decode-attention kernel at Qwen3-30B-A3B shapes on a CUDA device.

Usage (repository root, on a machine with a CUDA GPU and triton):
    python bench/attention_gpu.py [--quick]

Shapes: 32 query heads over 4 KV heads of 128, bfloat16 K/V in blocks of 16 tokens (the
engine's CacheConfig default); batches 1, 4, 8, 32 at context 512, 4k and 32k (every sequence
at full depth, its query at the last position). The K/V pool is random; each sequence's block
table is a random draw of distinct blocks from it.

Timing as bench/kernels_gpu.py does it: the call is launched C times in one CUDA graph, each
launch on its own block tables (disjoint blocks) so that the C launches together read twice
the L2 cache and every launch reads cold K/V, as a decode step does layer after layer; "us" is
the median replay time / C. GB/s counts the K + V bytes read; "%copy" divides it by the
device-to-device copy bandwidth (bytes read + written by `Tensor.copy_` of 1 GiB).

Variants (see moestream/kernels/paged_attention.py): the split count ("old": the fixed 16 and
3 pipeline stages of the previous launch, with today's merge kernel; "rule": `decode_num_splits`
at 2 programs per SM, "pps1"/"pps4" at 1 and 4), the merge ("merge": second kernel; "fused":
the last split to finish merges, on a persistent counter buffer), tile size (bn), warps (w)
and pipeline stages (st). Every variant is checked against `paged_decode_ref` (float32) on the
first copy's tables where the reference fits (B * context <= 256k): "err" is the max
|out - ref|; FAIL above 2e-2 (or non-finite output where there is no reference), or when the
counter buffer is not zero after the run. Exits with status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.kernels_gpu import copies_for, copy_bandwidth, graph_time_us  # noqa: E402
from moestream.kernels import paged_attention as pa  # noqa: E402
from moestream.layers.attention import paged_decode_ref  # noqa: E402

N_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
BATCHES = (1, 4, 8, 32)
CONTEXTS = (512, 4096, 32768)
REF_LIMIT = 1 << 18  # B * context up to which the reference is computed


@dataclass(frozen=True)
class Variant:
    name: str
    splits: str = "rule"  # "old" (16), "rule" (2 programs / SM), "pps1", "pps4"
    fused: bool = False
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = pa.NUM_STAGES

    def num_splits(self, batch: int, num_sms: int) -> int:
        if self.splits == "old":
            return pa.NUM_SPLITS
        per_sm = {"rule": pa.PROGRAMS_PER_SM, "pps1": 1, "pps4": 4}[self.splits]
        return pa.decode_num_splits(batch, KV_HEADS, num_sms, per_sm)


VARIANTS = [
    Variant("old: 16 splits, merge, bn64 w4 st3", "old", num_stages=3),
    Variant("rule, merge, bn64 w4 st3", num_stages=3),
    Variant("rule, merge, bn64 w4 st5 (default)"),
    Variant("rule, fused, bn64 w4 st5", fused=True),
    Variant("rule, merge, bn64 w8 st5", num_warps=8),
    Variant("rule, merge, bn128 w8 st3", block_n=128, num_warps=8, num_stages=3),
    Variant("rule, fused, bn128 w8 st5", fused=True, block_n=128, num_warps=8),
]
SWEEP = [  # batch 1 only: how many programs per SM
    Variant("pps1, merge, bn64 w4 st5", "pps1"),
    Variant("pps4, fused, bn64 w4 st5", "pps4", fused=True),
]


def block_tables(
    batch: int, context: int, copies: int, num_blocks: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """`copies` tables [B, context / 16] int32 of distinct random blocks, disjoint between
    copies (as far as the pool allows)."""
    width = context // BLOCK_SIZE
    need = batch * width
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = []
    for c in range(copies):
        start = (c * need) % (num_blocks - need + 1)
        tables.append(perm[start : start + need].view(batch, width).contiguous())
    return tables


def attention_call(q, k_cache, v_cache, table, lens, out, kw: dict) -> Callable[[], object]:
    """One launch of the decode kernel into `out`, as a closure for `graph_time_us`."""
    scale = HEAD_DIM**-0.5
    return lambda: pa.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, out=out, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, four variants")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    t_start = time.perf_counter()
    batches = (1, 8) if args.quick else BATCHES
    variants = VARIANTS[:4] if args.quick else VARIANTS
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    copy_bw = copy_bandwidth()
    print(f"{props.name}: {num_sms} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"copy bandwidth {copy_bw:.0f} GB/s (read + write)")  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens_needed = max(
        copies_for(b * c * KV_HEADS * HEAD_DIM * 4) * b * c for b in batches for c in CONTEXTS
    )
    num_blocks = math.ceil(tokens_needed / BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(max(batches) * KV_HEADS, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    failed = False
    best: list[tuple[int, int, str, float]] = []
    for batch in batches:
        for context in CONTEXTS:
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
            copies = copies_for(kv_bytes)
            tables = block_tables(batch, context, copies, num_blocks, gen)
            q = torch.randn(batch, N_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            outs = [torch.empty_like(q) for _ in range(copies)]
            ref = None
            if batch * context <= REF_LIMIT:
                ref = paged_decode_ref(q.float(), k_cache, v_cache, tables[0], lens, scale)
            print(f"\nB={batch} context={context}: K+V {kv_bytes / 2**20:.1f} MiB per call, "
                  f"{copies} copies")  # fmt: skip
            print(f"  {'variant':40s} {'splits':>6s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} "
                  f"{'err':>9s}")  # fmt: skip
            rows = []
            for v in variants + (SWEEP if batch == 1 else []):
                splits = v.num_splits(batch, num_sms)
                kw = dict(
                    num_splits=splits, counters=counters if v.fused else None,
                    block_n=v.block_n, num_warps=v.num_warps, num_stages=v.num_stages,
                )  # fmt: skip
                calls = [
                    attention_call(q, k_cache, v_cache, t, lens, o, kw)
                    for t, o in zip(tables, outs)
                ]
                outs[0].fill_(float("nan"))
                us = graph_time_us(calls)
                torch.cuda.synchronize()
                err = float("nan")
                if ref is not None:
                    err = (outs[0].float() - ref).abs().max().item()
                bad = not err <= 2e-2 if ref is not None else not torch.isfinite(outs[0]).all()
                if v.fused and counters.any():
                    bad = True
                    counters.zero_()
                failed |= bool(bad)
                gbs = kv_bytes / us / 1e3
                rows.append((us, v.name))
                print(f"  {v.name:40s} {splits:6d} {us:8.2f} {gbs:7.0f} {100 * gbs / copy_bw:6.1f} "
                      f"{err:9.2e}{'  FAIL' if bad else ''}", flush=True)  # fmt: skip
            us, name = min(rows)
            best.append((batch, context, name, us))
    print("\nfastest per case:")
    for batch, context, name, us in best:
        print(f"  B={batch:2d} context={context:5d}: {us:8.2f} us  {name}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; {'FAIL' if failed else 'all checks ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
