"""Host-to-GPU bandwidth, the ceiling of every expert that lives in host memory: DMA copies of
pinned memory (what the streamed tier's copies get) against a copy kernel whose loads read
pinned memory directly (zero-copy, what `experts.zero_copy` placement gets), over a sweep of
launch shapes. Expert reads of the fused MoE over the host link measured 27-29 GB/s
(bench/RESULTS.md); this says how much more the link gives.

    python bench/host_link.py [--sizes-mib 3,24,96,512] [--repeats 5] [--json PATH]

Medians of `--repeats` timed runs (CUDA events) after one untimed run; each copy is checked
against its source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

MIB = 1 << 20


@triton.jit
def copy_kernel(src_addr, dst_ptr, n_words, iters, BLOCK: tl.constexpr):
    """Words [pid * BLOCK + i * grid * BLOCK, ...) for i < iters: a grid-stride copy whose
    loads bypass L1 (`.cg`) and come straight from the source address (host memory)."""
    src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16)  # pinned: 16-byte aligned
    offs = tl.arange(0, BLOCK)
    for i in range(iters):
        o = (tl.program_id(0) + i * tl.num_programs(0)).to(tl.int64) * BLOCK + offs
        ok = o < n_words
        tl.store(dst_ptr + o, tl.load(src + o, mask=ok, cache_modifier=".cg"), mask=ok)


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, after one untimed run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", default="3,24,96,512", help="bytes per copy (MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_link: needs a CUDA device", file=sys.stderr)
        return 2
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    src = torch.randint(-(2**31), 2**31 - 1, (max(sizes) // 4,), dtype=torch.int32)
    src = src.pin_memory()
    dst = torch.empty_like(src, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; GB/s = 1e9 bytes per second")
    print("| copy | MiB | shape | GB/s |")
    print("|---|---|---|---|")
    for size in sizes:
        n = size // 4
        dma = timed(lambda n=n: dst[:n].copy_(src[:n], non_blocking=True), args.repeats)
        assert torch.equal(dst[:n].cpu(), src[:n])
        rows.append({"copy": "dma", "mib": size // MIB, "gbps": size / dma / 1e9})
        print(f"| DMA (pinned) | {size // MIB} | - | {size / dma / 1e9:.1f} |")
        best = None
        for block in (1024, 4096):
            for per_sm in (1, 2, 4, 8, 16):
                for warps in (4, 8):
                    grid = sms * per_sm
                    iters = triton.cdiv(n, block * grid)
                    dst[:n].zero_()

                    def run(grid=grid, iters=iters, block=block, warps=warps, n=n):
                        copy_kernel[(grid,)](
                            src.data_ptr(), dst, n, iters, BLOCK=block, num_warps=warps
                        )

                    seconds = timed(run, args.repeats)
                    assert torch.equal(dst[:n].cpu(), src[:n])
                    shape = f"{per_sm}/SM x {warps} warps, {block * 4} B"
                    row = {"copy": "zero-copy", "mib": size // MIB, "shape": shape}
                    row["gbps"] = size / seconds / 1e9
                    rows.append(row)
                    if best is None or row["gbps"] > best["gbps"]:
                        best = row
        print(f"| zero-copy kernel, best of 20 shapes | {size // MIB} | {best['shape']} | "
              f"{best['gbps']:.1f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
