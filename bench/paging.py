"""The device pager's own cost (`kernels.expert_pager.page`) at a real layer's shapes: the pager
and copy kernels for a forward whose routed experts are all in slots (what every layer of a
decode step pays), and for forwards with 1, 2, 4 and 8 of them missing (each then copied from
pinned host memory), over launch shapes of the copy kernel; GB/s of the copies against a DMA of
the same bytes (8 experts, and 1). Then the fixed part of a forward that admits: the same
forwards with 16-byte experts (the decision and the launches, no bytes to speak of), over the
pager program's warps.

    python bench/paging.py [--experts 128] [--slots 64] [--ffn 768] [--hidden 2048]
                           [--shapes 1x4,2x4,4x4,8x4,4x8] [--pager-warps 4,8,16] [--repeats 20]

The weights are random bytes at Q4_K gate/up and Q6_K down sizes (the synth qwen3-30b-a3b
Q4_K_M layer by default). Medians over `--repeats` CUDA-graph replays of 8 forwards each (a
graph, as decode runs them; the host's launch cost is not in the figure), less the same graph
of only the four small copies that put the placement back after each forward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_gpu import graph_time_us  # noqa: E402

from moestream.kernels import expert_pager  # noqa: E402
from moestream.kernels.expert_pager import gather, page  # noqa: E402


def _layer(experts: int, slots: int, ffn: int, hidden: int):
    """Pinned host stacks and device slots of one layer: bytes per expert of each weight."""
    q4k = ffn * hidden // 256 * 144  # gate and up
    q6k = hidden * ffn // 256 * 210  # down
    sizes = (q4k, q4k, q6k + (-q6k) % 16)
    host = [torch.randint(-(2**31), 2**31 - 1, (experts, n // 4), dtype=torch.int32).pin_memory()
            for n in sizes]  # fmt: skip
    dev = [torch.empty(slots, n // 4, dtype=torch.int32, device="cuda") for n in sizes]
    return host, dev, sizes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--shapes", default="1x4,2x4,4x4,8x4,4x8", help="programs per SM x warps")
    p.add_argument("--pager-warps", default="4,8,16", help="warps of the deciding program")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("paging: needs a CUDA device", file=sys.stderr)
        return 2
    e, s = args.experts, args.slots
    host, dev, sizes = _layer(e, s, args.ffn, args.hidden)
    host_addr = torch.tensor([[h[i].data_ptr() for i in range(e)] for h in host]).cuda()
    slot_addr = torch.tensor([[d[i].data_ptr() for i in range(s)] for d in dev]).cuda()
    words = tuple(n // 4 for n in sizes)
    expert_mib = sum(sizes) / 2**20
    dma_src = torch.cat([h[:8].flatten() for h in host]).pin_memory()
    dma_dst = torch.empty_like(dma_src, device="cuda")
    print(f"{torch.cuda.get_device_name()}; E {e}, S {s}, {expert_mib:.2f} MiB an expert")

    dma = graph_time_us([lambda: dma_dst.copy_(dma_src, non_blocking=True)], args.repeats)
    print(f"DMA of 8 experts: {dma:.1f} us, {dma_src.numel() * 4 / dma / 1e3:.1f} GB/s")
    one = dma_src.numel() // 8
    dma1 = graph_time_us(
        [lambda: dma_dst[:one].copy_(dma_src[:one], non_blocking=True)], args.repeats
    )
    print(f"DMA of 1 expert: {dma1:.1f} us, {one * 4 / dma1 / 1e3:.1f} GB/s")
    print("| copy shape | missing | us a forward | GB/s of copies |")
    print("|---|---|---|---|")
    runs = [(shape, 4, words) for shape in args.shapes.split(",")]
    runs += [("4x4", int(w), (4, 4, 4)) for w in args.pager_warps.split(",")]
    for shape, pager_warps, run_words in runs:
        per_sm, warps = (int(x) for x in shape.split("x"))
        expert_pager.COPY_PROGRAMS_PER_SM, expert_pager.COPY_WARPS = per_sm, warps
        expert_pager.PAGER_WARPS = pager_warps
        expert_pager._copy_grid.cache_clear()
        if run_words == (4, 4, 4) and pager_warps == int(args.pager_warps.split(",")[0]):
            print("| 16-byte experts: pager warps | missing | us a forward | |\n|---|---|---|---|")
        for missing in (0, 1, 2, 4, 8):
            # slots hold experts 0..s-1; each forward routes 8 experts of which `missing` are
            # outside the slots, and the next forward puts the placement back (the state is
            # restored by a copy inside the graph, so every replay pages the same way)
            slot_of = torch.full((e,), -1, dtype=torch.int32, device="cuda")
            slot_of[:s] = torch.arange(s, dtype=torch.int32, device="cuda")
            owner = torch.arange(s, dtype=torch.int32, device="cuda")
            heat = torch.zeros(e, device="cuda")
            heat[:s] = 100.0  # slots hotter than the missing ones, but slot s-1.. coldest
            heat[s - 8 : s] = 0.0
            addr = host_addr.clone()
            addr[:, :s] = slot_addr
            saved = [t.clone() for t in (slot_of, owner, heat, addr)]
            ids = torch.tensor([[*range(8 - missing), *range(s, s + missing)]], device="cuda")
            copies = torch.zeros(1 + 2 * s, dtype=torch.int32, device="cuda")
            stats = torch.zeros(8, dtype=torch.int64, device="cuda")
            mark = torch.zeros(e, dtype=torch.int8, device="cuda")
            gate = torch.zeros(2, device="cuda")

            def forward(ids=ids, slot_of=slot_of, owner=owner, heat=heat, addr=addr,
                        saved=saved, copies=copies, stats=stats, words=run_words,
                        mark=mark, gate=gate):  # fmt: skip
                page(ids, heat, slot_of, owner, addr, host_addr, slot_addr, copies, stats,
                     mark, gate, words, 0.99)  # fmt: skip
                for t, v in zip((slot_of, owner, heat, addr), saved, strict=True):
                    t.copy_(v)

            def restore(slot_of=slot_of, owner=owner, heat=heat, addr=addr, saved=saved):
                for t, v in zip((slot_of, owner, heat, addr), saved, strict=True):
                    t.copy_(v)

            reps = args.repeats  # the pager's part of a forward:
            us = graph_time_us([forward] * 8, reps) - graph_time_us([restore] * 8, reps)
            if run_words == (4, 4, 4):
                print(f"| {pager_warps} | {missing} | {us:.1f} | |")
                continue
            rate = missing * sum(sizes) / us / 1e3 if missing else 0.0
            print(f"| {per_sm}/SM x {warps} warps | {missing} | {us:.1f} | {rate:.1f} |")
    # the gather of forwards beyond the slots: n routed experts, half of them in slots
    expert_pager.COPY_PROGRAMS_PER_SM, expert_pager.COPY_WARPS = 4, 4
    expert_pager.PAGER_WARPS = 4
    expert_pager._copy_grid.cache_clear()
    stage = [torch.empty(e, n // 4, dtype=torch.int32, device="cuda") for n in sizes]
    stage_addr = torch.tensor([[t[i].data_ptr() for i in range(e)] for t in stage]).cuda()
    addr = host_addr.clone()
    addr[:, : s // 2] = slot_addr[:, : s // 2]  # experts 0.. s/2-1 in slots
    stage_slot = torch.zeros(e, dtype=torch.int32, device="cuda")
    copies = torch.zeros(1 + 2 * e, dtype=torch.int32, device="cuda")
    print("\n| gather: routed experts (half in slots) | us a forward | GB/s |\n|---|---|---|")
    for n in (8, 32, 64):
        half = n // 2
        ids = torch.tensor([[*range(half), *range(s, s + n - half)]], device="cuda")

        def gathered(ids=ids):
            gather(ids, addr, stage_addr, stage_slot, copies, words)

        us = graph_time_us([gathered] * 4, args.repeats)
        print(f"| {n} | {us:.1f} | {n * sum(sizes) / us / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
