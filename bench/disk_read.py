"""The disk tier's ceiling: how fast the expert store's own reader brings whole experts in from
the model file, and what that allows a decoded token when every miss is a disk read.

Usage: python bench/disk_read.py MODEL.gguf [--threads 1,4,8] [--experts 256] [--rounds 3]
    [--buffered] [--on-device 0.5,0.25,0.1]

Each round reads `--experts` experts drawn at random (layer and expert, without repeats) with
`ExpertFileReader.read_expert` from a pool of `--threads` threads, into buffers of the experts'
sizes, as the store's demand and prefetch pools do; O_DIRECT unless `--buffered` (the page cache
is then dropped for the file before each round, so the reads come from the device). It prints
the median rate (GB/s, 1e9 B/s) with min-max over the rounds, per thread count. Then, for each
share of experts on the GPU in `--on-device` and uniform routing (random weights: a token's
top-k experts miss the device with probability 1 - share), the bytes a decoded token reads from
disk and the tok/s ceiling that the best rate gives: what `moestream bench ...
--host-expert-cache-gib 0 --expert-direct-io` can at most decode at batch 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream.experts import ExpertLayout  # noqa: E402
from moestream.experts.disk import ExpertFileReader, drop_page_cache  # noqa: E402
from moestream.weights.loader import open_model  # noqa: E402


def read_round(reader: ExpertFileReader, picks: list[tuple[int, int]], threads: int) -> float:
    """Seconds to read `picks` ((layer, expert) pairs) on `threads` threads, each reading into
    buffers of its own that it reuses, as the store's reads land in slots it reuses."""
    layout = reader.layout
    local = threading.local()

    def one(pick: tuple[int, int]) -> None:
        layer, e = pick
        sizes = tuple(t.expert_bytes for t in layout.layers[layer])
        buffers = local.__dict__.setdefault("buffers", {})
        if sizes not in buffers:
            buffers[sizes] = [torch.zeros(n, dtype=torch.uint8) for n in sizes]  # touched
        reader.read_expert(layer, e, buffers[sizes])  # raises on a short read

    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(one, picks[:threads]):  # each thread's buffers, before the clock
            pass
        start = time.perf_counter()
        for _ in pool.map(one, picks):
            pass
        return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a MoE GGUF file (e.g. one `moestream synth` wrote)")
    ap.add_argument("--threads", default="1,4,8", help="reader threads, comma separated")
    ap.add_argument("--experts", type=int, default=256, help="experts read per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffered", action="store_true", help="page-cache reads, not O_DIRECT")
    ap.add_argument("--on-device", default="0.5,0.25,0.1", help="shares of experts on the GPU")
    args = ap.parse_args()
    source = open_model(args.model)
    c = source.config
    layout = ExpertLayout.from_gguf(source.gguf, c.n_experts, c.n_experts_used)
    pairs = [(i, e) for i in range(layout.n_layers) for e in range(c.n_experts)]
    if args.experts > len(pairs):
        ap.error(f"--experts {args.experts}: the file has {len(pairs)}")
    rng = random.Random(0)
    reader = ExpertFileReader(layout, args.model, direct=not args.buffered)
    mode = "O_DIRECT" if reader.direct_active else "buffered (page cache dropped each round)"
    print(f"{args.model}: {layout.n_layers} layers x {c.n_experts} experts, reads {mode}\n")
    print("| threads | GB/s (median) | min-max | rounds |")
    print("|---|---|---|---|")
    best = 0.0
    for threads in (int(t) for t in args.threads.split(",")):
        rates = []
        for _ in range(args.rounds):
            picks = rng.sample(pairs, args.experts)
            nbytes = sum(sum(t.expert_bytes for t in layout.layers[i]) for i, _ in picks)
            if not reader.direct_active:
                drop_page_cache(args.model)
            rates.append(nbytes / read_round(reader, picks, threads) / 1e9)
        best = max(best, statistics.median(rates))
        print(f"| {threads} | {statistics.median(rates):.2f} | {min(rates):.2f}-{max(rates):.2f} "
              f"| {len(rates)} |", flush=True)  # fmt: skip
    reader.close()
    per_layer = [sum(t.expert_bytes for t in layer) for layer in layout.layers]
    mean_expert = sum(per_layer) / len(per_layer)
    print(f"\nA decoded token at batch 1, uniform routing (top-{c.n_experts_used}), every miss "
          f"from disk, at the best rate ({best:.2f} GB/s):\n")  # fmt: skip
    print("| experts on the GPU | disk MB a token | ceiling tok/s |")
    print("|---|---|---|")
    for share in (float(s) for s in args.on_device.split(",")):
        token = c.n_experts_used * (1 - share) * layout.n_layers * mean_expert
        ceiling = best * 1e9 / token if token else float("inf")
        print(f"| {share:.0%} | {token / 1e6:,.1f} | {ceiling:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
