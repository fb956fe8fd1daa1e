"""Zero-copy promotion (`ZeroCopyExperts.rebalance`) on simulated routing: swaps per rebalance
and the device's share of expert reads, for uniform routing (as random weights route) and
Zipf-skewed routing, with the rule's noise margin and without it. One layer in the shape of
Qwen3-30B-A3B's expert count (128 experts, 8 a token, half on the device), tiny stand-in
weights on the CPU: only the counting and the choice of swaps run.

    python bench/zero_copy_churn.py [--windows 60] [--steps 64] [--seed 0]

The share is measured over the second half of the windows (after the placement has settled).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moestream.experts import zero_copy as zc
from moestream.weights.qtensor import QTensor

E, N_DEVICE, TOPK = 128, 64, 8


def simulate(windows: int, steps: int, skew: float | None, seed: int) -> tuple[float, float]:
    """(swaps per rebalance, device share of reads over the second half)."""
    rng = np.random.default_rng(seed)
    stacks = [
        QTensor(torch.zeros(E, 8, 34, dtype=torch.uint8), GGMLQuantizationType.Q8_0, (E, 8, 32))
        for _ in range(3)
    ]
    layer = zc.ZeroCopyExperts(stacks, N_DEVICE, "cpu")
    p = None
    if skew is not None:
        p = rng.zipf(skew, E).astype(float)
        p /= p.sum()
    device = total = 0
    for w in range(windows):
        reads = np.zeros(E, dtype=np.int64)
        for _ in range(steps):
            reads[rng.choice(E, TOPK, replace=False, p=p)] += 1
        if w >= windows // 2:
            on = np.array([layer._on_device[e] for e in range(E)])
            device += int(reads[on].sum())
            total += int(reads.sum())
        layer._reads += torch.from_numpy(reads)
        layer.rebalance()
    return layer.swaps / windows, device / total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=60)
    p.add_argument("--steps", type=int, default=64, help="steps between rebalances")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print("| routing | noise margin | swaps per rebalance | device share of reads |")
    print("|---|---|---|---|")
    margin = zc.NOISE_SIGMAS
    for name, skew in (("uniform", None), ("Zipf s=1.2", 1.2), ("Zipf s=2", 2.0)):
        for sigmas in (0.0, margin):
            zc.NOISE_SIGMAS = sigmas
            swaps, share = simulate(args.windows, args.steps, skew, args.seed)
            print(f"| {name} | {sigmas:g} sigma | {swaps:.2f} | {share:.3f} |")
    zc.NOISE_SIGMAS = margin
    return 0


if __name__ == "__main__":
    sys.exit(main())
