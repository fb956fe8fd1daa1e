"""Throughput of the native CPU expert code (`moestream/native`) in the Qwen3-30B-A3B shapes.

Usage: python bench/native_experts.py [--threads 1,2,4,8,16] [--experts 96] [--rounds 5]
    [--memory numpy|small|huge|pinned] [--per-token 2,4,8] [--gap-us 0,100] [--spinners 0,1]

Each round computes one token through `--experts` distinct random experts (Q4_K gate and up
[768, 2048], Q6_K down [2048, 768]: 3.0 MB each, together far more than the CPU's caches), the
experts spread over a pool of threads (the native calls release the GIL); it reports the
median rate of expert weights read (GB/s, 1e9 B/s), min-max over the rounds, per thread count,
and what that rate means for a 30B token whose host-placed experts the CPU computes: 1.097 GB
of active expert weights a token (bench/RESULTS.md, "Ceilings") over the rate. `--memory`: where
the experts live: numpy arrays (the allocator's pages), one arena of 4 KiB pages ("small",
MADV_NOHUGEPAGE), of transparent 2 MiB pages ("huge", MADV_HUGEPAGE), or torch's pinned memory
("pinned": the host tier's, needs CUDA).

One thread's time for an expert's gate/up and for its down, apart. Then a layer's host experts
of one token in one call (`native.moe_host_rows`, its threads OpenMP's): `--per-token` of the
token's 8 experts (2: half the experts on the host and half of those on the CPU, a batch-1
decode step's call; 4; all 8), the median time a call over `--rounds` x 12 calls (each call
other experts), and 48 layers of it: the host's share of a 30B token. `--gap-us` puts that many
microseconds between calls, the calling thread spinning meanwhile as one waiting on the GPU
does (a decode step's layers are ~0.1-0.3 ms apart): the cost of waking the threads a call.
`--spinners` runs that many busy processes beside the calls, as a thread spinning on a GPU
wait beside the host's experts: a stalled call shows in the mean, not the median."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream import native  # noqa: E402
from moestream.kernels.tuner import random_weight  # noqa: E402

H, F = 2048, 768
EXPERT_BYTES_PER_TOKEN = 1.097e9  # the 30B's 8 of 128 experts x 48 layers (RESULTS ceilings)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,16", help="thread counts, comma separated")
    ap.add_argument("--experts", type=int, default=96, help="distinct experts per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", choices=("numpy", "small", "huge", "pinned"), default="numpy")
    ap.add_argument("--per-token", default="4,8", help="host experts a call, comma separated")
    ap.add_argument("--gap-us", default="0", help="spin between calls (us), comma separated")
    ap.add_argument("--spinners", default="0", help="busy processes beside the calls, arms")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")

    def weight(label: str, shape: tuple[int, int], seed: int) -> np.ndarray:
        return random_weight(label, shape, cpu, seed).data.numpy()  # [rows, row bytes]

    experts = [(weight("Q4_K", (F, H), 3 * i), weight("Q4_K", (F, H), 3 * i + 1),
                weight("Q6_K", (H, F), 3 * i + 2)) for i in range(args.experts)]  # fmt: skip
    nbytes = sum(g.nbytes + u.nbytes + d.nbytes for g, u, d in experts)
    if args.memory != "numpy":
        experts = in_arena(experts, nbytes, args.memory)
    xq = rng.integers(-127, 128, H, dtype=np.int8)
    xd = np.full(H // 32, 0.01, np.float32)
    xs = (xd * 3).astype(np.float32)

    def one(e: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
        hq, hd, hs = native.gate_up_q4_k(e[0], e[1], xq, xd, xs, 8)
        return native.down_rows(e[2], True, hq, hd, hs, 0.125, 4)

    one(experts[0])  # builds the library
    print(f"{args.experts} experts, {nbytes / 1e6:.0f} MB of weights a round")
    split(experts, xq, xd, xs, args.rounds)
    print("| threads | GB/s of expert weights (median, min-max) | 30B token's experts, ms |")
    print("|---|---|---|")
    for n in (int(v) for v in args.threads.split(",")):
        with ThreadPoolExecutor(n) as pool:
            rates = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                list(pool.map(one, experts))
                rates.append(nbytes / (time.perf_counter() - t) / 1e9)
        med = statistics.median(rates)
        print(f"| {n} | {med:.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
              f"{EXPERT_BYTES_PER_TOKEN / med / 1e6:.1f} |")  # fmt: skip
    cols = ("threads", "busy processes beside", "host experts a token and layer",
            "gap between calls, us", "ms a layer (median, min-max)", "mean ms", "48 layers, ms",
            "GB/s")  # fmt: skip
    print("\n| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|---|")
    x_rows = (xq[None], xd[None], xs[None])
    arms = [(n, int(b), int(p), float(g)) for n in (int(v) for v in args.threads.split(","))
            for b in args.spinners.split(",") for p in args.per_token.split(",")
            for g in args.gap_us.split(",")]  # fmt: skip
    for n, busy, per_token, gap_us in arms:
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.2 if busy else 0.0)  # the spinners running
            times = []
            for r in range(args.rounds * 12):
                chosen = [experts[(r * per_token + i) % len(experts)] for i in range(per_token)]
                layer = [(g, u, d, True) for g, u, d in chosen]
                until = time.perf_counter() + gap_us * 1e-6
                while time.perf_counter() < until:  # the caller spins, as on a GPU wait
                    pass
                t = time.perf_counter()
                native.moe_host_rows(layer, [0] * per_token, [0.125] * per_token, *x_rows,
                                     8, 4, threads=n)  # fmt: skip
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            gbs = per_token * nbytes / len(experts) / med / 1e9
            mean = statistics.fmean(times)  # a stalled call shows here, not in the median
            print(f"| {n} | {busy} | {per_token} | {gap_us:g} | {med * 1e3:.3f} "
                  f"({min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}) | {mean * 1e3:.3f} | "
                  f"{48 * med * 1e3:.1f} | {gbs:.2f} |")  # fmt: skip
        finally:
            for proc in spin:
                proc.kill()
                proc.wait()
    return 0


def in_arena(experts: list, nbytes: int, memory: str) -> list:
    """The experts copied into one arena of `memory` pages (module docstring)."""
    import mmap

    if memory == "pinned":
        arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    else:
        huge = 2 << 20
        m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE if memory == "huge" else mmap.MADV_NOHUGEPAGE)
        raw = np.frombuffer(m, dtype=np.uint8)
        start = -raw.ctypes.data % huge
        arena = raw[start : start + nbytes]
    out, at = [], 0
    for e in experts:
        views = []
        for w in e:
            v = arena[at : at + w.nbytes].reshape(w.shape)
            v[...] = w
            views.append(v)
            at += w.nbytes
        out.append(tuple(views))
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        huge_kb = [ln for ln in meminfo.read_text().splitlines() if ln.startswith("AnonHugePages")]
        print(f"memory {memory}: {' '.join(huge_kb)}")
    return out


def split(experts: list, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, rounds: int) -> None:
    """One thread: an expert's gate/up and its Q6_K down timed apart (median over `rounds` of
    the mean over the experts)."""

    def gate_up() -> tuple[float, tuple[np.ndarray, ...]]:
        t = time.perf_counter()
        for g, u, _ in experts:
            h = native.gate_up_q4_k(g, u, xq, xd, xs, 8)
        return (time.perf_counter() - t) / len(experts), h

    def down(h: tuple[np.ndarray, ...]) -> float:
        t = time.perf_counter()
        for _, _, d in experts:
            native.down_rows(d, True, *h, 0.125, 4)
        return (time.perf_counter() - t) / len(experts)

    h = gate_up()[1]
    t_up = statistics.median(gate_up()[0] for _ in range(rounds))
    t_down = statistics.median(down(h) for _ in range(rounds))
    g, u, d = experts[0]
    up_rate, down_rate = (g.nbytes + u.nbytes) / t_up / 1e9, d.nbytes / t_down / 1e9
    print(
        f"one thread: gate/up {t_up * 1e3:.3f} ms an expert ({up_rate:.2f} GB/s), "
        f"Q6_K down {t_down * 1e3:.3f} ms ({down_rate:.2f} GB/s)"
    )


if __name__ == "__main__":
    sys.exit(main())
