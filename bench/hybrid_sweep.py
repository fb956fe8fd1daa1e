"""Decode speed of zero-copy placement with host-computed experts across CPU shares and thread
counts, one model load: which share of the host-placed experts the host's cores should take.

    python bench/hybrid_sweep.py MODEL.gguf --gpu-expert-cache-gib 8.8 \\
        [--host-expert-cache-gib 24] [--fractions 0,0.33,0.5,0.67] [--threads 16] \\
        [--batches 1,8] [--tokens 32] [--rounds 3] [--modes poll,host] [--wait spin,block]

The model is placed once with every host slot marked for the host (`--expert-cpu-fraction
1`); each arm then re-marks the first share of each layer's host slots
(`ZeroCopyExperts.set_cpu_slots`) and sets the threads (`HostCompute.set_threads`); CUDA graphs
read both at every replay, so no arm recaptures. `--modes poll,host` also puts the host's two
ways of answering side by side (`HostCompute.set_poll`: the poller thread, CUDA host
functions); a change of mode drops the captured graphs and warms up again before any timing.
`--wait spin,block` sets per arm how the step's thread waits for its tokens
(`HostReader.set_blocking`: a spin, CUDA's default, takes a core from the host experts' threads;
with host experts the LLM blocks by default).
The arms run in turn (modes alternating their order each round), `--rounds` times; each arm's
rate is printed when measured, so a run cut short keeps what it measured. An
arm's decode rate at batch B: B greedy requests of N + 2 tokens (fresh random 32-token
prompts, so no prefix is reused) are stepped until each has its first two tokens (the
prefill's and one decoded untimed, as `moestream bench` times decode), then the clock runs over
the steps that give the other B * N tokens. Output: a table of medians (min-max) of aggregate
decode tok/s per arm and batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream import LLM, SamplingParams  # noqa: E402


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-expert-cache-gib", type=float, required=True)
    ap.add_argument("--host-expert-cache-gib", type=float, default=24.0)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--fractions", type=floats, default=floats("0,0.33,0.5,0.67"))
    ap.add_argument("--threads", type=ints, default=None, help="default: the process's cores")
    ap.add_argument("--batches", type=ints, default=ints("1,8"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--modes", default=None,
        help="poll,host: both ways of answering the GPU's posts side by side (default: the "
        "default mode only)",
    )  # fmt: skip
    ap.add_argument(
        "--wait", default=None,
        help="spin,block: how the step's thread waits for its tokens, one arm each (default: "
        "the LLM's, a blocking wait beside host experts)",
    )  # fmt: skip
    args = ap.parse_args()
    waits = args.wait.split(",") if args.wait else [None]
    if not {w for w in waits if w} <= {"spin", "block"}:
        raise SystemExit(f"--wait: spin and/or block, got {args.wait}")

    llm = LLM(
        args.model, device=args.device, kv_cache_gib=args.kv_cache_gib,
        gpu_expert_cache_gib=args.gpu_expert_cache_gib,
        host_expert_cache_gib=args.host_expert_cache_gib, expert_zero_copy=True,
        expert_cpu_fraction=1.0,
    )  # fmt: skip
    layers = llm.zero_copy
    compute = layers[0].host_work.compute  # type: ignore[union-attr]
    host_slots = layers[0].num_experts - layers[0].n_device
    threads = args.threads or [compute.threads]
    modes = args.modes.split(",") if args.modes else ["poll" if compute.poll else "host"]
    if not set(modes) <= {"poll", "host"}:
        raise SystemExit(f"--modes: poll and/or host, got {args.modes}")
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)

    def sync() -> None:
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)

    def decode_rate(batch: int) -> float:
        """Aggregate decode tok/s of `batch` requests (module docstring)."""
        sp = SamplingParams(max_tokens=args.tokens + 2, temperature=0.0, ignore_eos=True)
        ids = [
            llm.engine.add_request(rng.integers(100, vocab - 100, 32).tolist(), sp)
            for _ in range(batch)
        ]
        got = dict.fromkeys(ids, 0)

        def step() -> None:
            for out in llm.engine.step():
                got[out.request_id] += len(out.new_token_ids)

        while min(got.values()) < 2:
            step()
        before = sum(got.values())
        t = time.perf_counter()
        while llm.engine.has_unfinished():
            step()
        sync()
        seconds = time.perf_counter() - t
        if sum(got.values()) != batch * (args.tokens + 2):
            raise RuntimeError(f"{sum(got.values())} tokens, expected {batch * (args.tokens + 2)}")
        return (sum(got.values()) - before) / seconds

    arms = [(f, n, w) for f in args.fractions for n in threads for w in waits]
    rates: dict[tuple[str, str, float, int, int], list[float]] = {}

    warm: str | None = None  # the mode whose graphs are captured

    def set_mode(mode: str) -> None:
        """The mode, its graphs captured and kernels compiled before any timing."""
        nonlocal warm
        if warm == mode:
            return
        sync()
        if compute.poll != (mode == "poll"):
            compute.set_poll(mode == "poll")
            llm.engine.runner.drop_graphs()
        for b in args.batches:
            decode_rate(b)
        warm = mode

    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else reversed(modes):
            set_mode(mode)
            for f, n, w in arms if r % 2 == 0 else reversed(arms):
                sync()
                for layer in layers:
                    layer.set_cpu_slots(round(f * host_slots))
                compute.set_threads(n)
                if w is not None:
                    llm.engine.runner.reader.set_blocking(w == "block")
                for b in args.batches:
                    rate = decode_rate(b)
                    rates.setdefault((mode, w or "-", f, n, b), []).append(rate)
                    print(f"round {r}: {mode}, wait {w or '-'}, share {f:g}, {n} threads, "
                          f"batch {b}: {rate:.1f} tok/s", flush=True)  # fmt: skip
    print(f"{host_slots} host slots a layer of {layers[0].num_experts}; "
          f"{args.tokens} tokens, {args.rounds} rounds")  # fmt: skip
    cols = ["mode", "wait", "CPU share of host slots", "threads", "batch"]
    print("\n| " + " | ".join(cols + ["decode tok/s (median)", "min-max"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for (mode, w, f, n, b), v in sorted(rates.items(), key=lambda kv: kv[0][4]):
        print(f"| {mode} | {w} | {f:g} | {n} | {b} | {statistics.median(v):.1f} | "
              f"{min(v):.1f}-{max(v):.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
