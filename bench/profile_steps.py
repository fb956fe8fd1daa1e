"""Where a step's time goes: the kernels of one prefill and of a few decode steps, by device time.

    python bench/profile_steps.py MODEL.gguf [--device cuda] [--prefill 512,2048] [--batch 8]
                                  [--decode-tokens 8] [--rows 25] [--kv-cache-gib 8]
                                  [--weight-cache-gib 0] [--prefix-reuse 32768:31744]

Runs a warm-up of each case first (kernel compilation, autotuning, CUDA graph capture), then
profiles it with `torch.profiler` and prints the top kernels by self device time (CPU time on a
CPU run), with call counts, and the wall time of the profiled call; on CUDA also where the GPU
waited (before its first kernel, between kernels, after its last; the longest gaps), and the
dequantizing kernel's launch shapes. `--prefix-reuse N:S` profiles the prefill of an N-token
prompt whose first S tokens the prefix cache holds (after a cold N-token prompt and a warm-up
with another tail): the warm time to first token of `moestream bench --prefix-reuse`.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream.llm import LLM
from moestream.types import SamplingParams


def profiled(
    llm: LLM,
    warmup: list[list[int]],
    prompts: list[list[int]],
    max_tokens: int,
    device: str,
    rows: int,
) -> str:
    """Profile `prompts` after a warm-up on `warmup` (prompts of the same lengths but other
    tokens: the same prompts would hit the prefix cache and skip the prefill)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(warmup, params)  # warm-up: compile, tune, capture
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=key, row_limit=rows)
    head = f"wall {wall * 1e3:.1f} ms"
    if device == "cuda":
        # device time of the kernels (no two run at once here): the rest of the wall time is
        # the GPU waiting for the host
        busy = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA")
        head += f", kernels {busy / 1e3:.1f} ms ({100 * busy / 1e3 / (wall * 1e3):.0f}% busy)"
        events = prof.events()
        kernels = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in events
            if e.device_type.name == "CUDA"
        ]
        span = [e.time_range for e in events if e.device_type.name == "CPU"]
        if span:
            first, last = min(r.start for r in span), max(r.end for r in span)
            head += "\n" + idle_gaps(kernels, first, last)
    return f"{head}\n{table}"


def idle_gaps(
    kernels: list[tuple[float, float, str]], start: float, end: float, top: int = 5
) -> str:
    """Where the GPU waited between `start` and `end` (us, the profile's clock), from its
    kernels (start, end, name): before the first, in the gaps between them (overlapping
    kernels merged), after the last; then the `top` longest gaps with the kernels on either
    side. The host's share of a step: what a faster host or fewer syncs could win back."""
    if not kernels:
        return "GPU idle: no kernels"
    spans = sorted(kernels)
    merged: list[list] = []  # [start, end, first name, last name]
    for k0, k1, name in spans:
        if merged and k0 <= merged[-1][1]:
            if k1 > merged[-1][1]:
                merged[-1][1], merged[-1][3] = k1, name
        else:
            merged.append([k0, k1, name, name])
    gaps = [(b[0] - a[1], a[3], b[2]) for a, b in zip(merged, merged[1:])]
    before, after = max(0.0, merged[0][0] - start), max(0.0, end - merged[-1][1])
    between = sum(g for g, _, _ in gaps)
    lines = [
        f"GPU idle: {before / 1e3:.2f} ms before the first kernel, {between / 1e3:.2f} ms in"
        f" {len(gaps)} gaps between kernels, {after / 1e3:.2f} ms after the last"
    ]
    for gap, left, right in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:8.1f} us between {left[:50]} and {right[:50]}")
    return "\n".join(lines)


def host_profile(llm: LLM, n: int, prompt, device: str, rows: int) -> str:
    """The host side of one prefill of n tokens under cProfile (after a warm-up on another
    prompt): wall time, then functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(n)], params)
    ids = [prompt(n)]
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(ids, params)
    if device == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - start
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return f"wall {wall * 1e3:.1f} ms (under cProfile)\n{buf.getvalue()}"


def tuned_configs() -> list[str]:
    """The dequantizing kernel's launch shapes (a fixed table per type)."""
    from moestream.kernels.dequant_mm import DEQUANT_SHAPES

    return [f"{qtype.name} K={k}: {shape}" for (qtype, k), shape in DEQUANT_SHAPES.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="GGUF file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--prefill", default="512", help="prompt tokens of the prefill cases (comma-separated)"
    )
    p.add_argument("--batch", type=int, default=8, help="requests of the decode case")
    p.add_argument("--decode-tokens", type=int, default=8, help="tokens per request (decode)")
    p.add_argument("--rows", type=int, default=25, help="kernels listed per case")
    p.add_argument("--kv-cache-gib", type=float, default=8.0)
    p.add_argument("--weight-cache-gib", type=float, default=0.0)
    p.add_argument(
        "--cprofile", type=int, default=0, help="also profile the host of a prefill of N tokens"
    )
    p.add_argument(
        "--prefix-reuse", default="", metavar="N:S",
        help="also profile an N-token prefill whose first S tokens are cached",
    )  # fmt: skip
    args = p.parse_args()
    llm = LLM(
        args.model,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib,
        weight_cache_gib=args.weight_cache_gib,
    )
    vocab = llm.engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, min(vocab, 30000), (n,), generator=gen).tolist()

    for n in (int(v) for v in args.prefill.split(",") if v):
        print(f"## prefill, {n} tokens (one token generated)")
        print(profiled(llm, [prompt(n)], [prompt(n)], 1, args.device, args.rows))
    if args.prefix_reuse:
        n, shared = (int(v) for v in args.prefix_reuse.split(":"))
        print(f"## prefill, {n} tokens, the first {shared} cached (one token generated)")
        cold = prompt(n)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([cold], params)  # fills the prefix cache; not profiled
        warm, tail = (cold[:shared] + prompt(n - shared) for _ in range(2))
        print(profiled(llm, [warm], [tail], 1, args.device, args.rows))
    if args.cprofile:
        print(f"## host (cProfile), prefill of {args.cprofile} tokens")
        print(host_profile(llm, args.cprofile, prompt, args.device, args.rows))
    if args.batch > 0:
        print(f"## decode, {args.batch} requests x {args.decode_tokens} tokens (16-token prompts)")
        warm, batch = ([prompt(16) for _ in range(args.batch)] for _ in range(2))
        print(profiled(llm, warm, batch, args.decode_tokens, args.device, args.rows))
    if args.device == "cuda":
        print("## dequantizing kernel: launch shapes")
        print("\n".join(tuned_configs()) or "(none used)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
