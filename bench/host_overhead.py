"""Host time per decode step: `Engine.step` minus the model forward, at several batch sizes.

Usage (repository root; about a minute on the CPU with the demo model):
    python bench/host_overhead.py [MODEL.gguf] [--device cpu|cuda] [--batches 1,8,32]
                                  [--steps 50] [--warmup 8] [--prompt 16] [--top 12]

MODEL defaults to the embedded demo model. For each batch size B, B greedy requests are
prefilled, then every timed step is a pure decode step of B sequences (CUDA graphs on a GPU
when the model can be captured). Three passes over `--steps` steps each:

1. natural: `Engine.step` as the server runs it; ms per step and tok/s.
2. split: the forward call (eager `model.forward` + `model.compute_logits`, or the graph's
   `DecodeGraphs.replay`) is timed on its own; on CUDA the device is synchronised before and
   after it, so its time is the device's and the rest of the step is what the host adds (input
   preparation and copies, sampling and its one read-back, scheduling, detokenization). Host
   time is the per-step median of step minus forward.
3. profile: cProfile over the same steps with the profiler off inside the forward call: the
   top entries of the host time by own time, in microseconds per step.

On CUDA with graphs, the captured graph is also replayed back to back (CUDA events) for the
forward's GPU time, and `exposed host` = natural step - graph GPU time: the time the GPU waits
for the host in the natural pass. Output: one table per pass and the profile per batch size.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream import LLM, SamplingParams  # noqa: E402


class ForwardClock:
    """Wraps an engine's forward calls (instance attributes over the bound methods) and records
    the wall time spent inside them; `profiler`, when set, is disabled inside them. With
    `sync`, the device is synchronised before and after each call."""

    def __init__(self, llm: LLM, sync: bool):
        self.llm, self.sync = llm, sync
        self.seconds = 0.0
        self.calls = 0
        self.profiler: cProfile.Profile | None = None
        self._wrapped: list[tuple[Any, str]] = []
        model, graphs = llm.model, llm.engine.runner.graphs
        for obj, name in ((model, "forward"), (model, "compute_logits"), (graphs, "replay")):
            if obj is not None:
                setattr(obj, name, self._wrap(getattr(obj, name)))
                self._wrapped.append((obj, name))

    def _sync(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.profiler is not None:
                self.profiler.disable()
            self._sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.seconds += time.perf_counter() - t
            self.calls += 1
            if self.profiler is not None:
                self.profiler.enable()
            return out

        return timed

    def remove(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)  # the instance attribute: back to the method


def prompt_ids(llm: LLM, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, llm.config.vocab_size - 10, (n,), generator=g).tolist()


def graph_gpu_ms(llm: LLM, batch: int, reps: int = 20) -> float | None:
    """GPU time of one graph replay of `batch`'s bucket, back to back; None without graphs."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    bucket = graphs.bucket_for(batch)
    if bucket not in graphs.captured:
        return None
    from decode_gpu import forward_gpu_ms  # bench/decode_gpu.py, beside this script

    return forward_gpu_ms(graphs, bucket, reps)["forward_gpu_ms"]


def measure(llm: LLM, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.engine
    cuda = llm.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    total = args.warmup + 3 * args.steps + 4
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    rids = [
        engine.add_request(prompt_ids(llm, args.prompt, seed=100 + i), params) for i in range(batch)
    ]
    row: dict[str, Any] = {"batch": batch}
    try:
        while any(engine.scheduler.get(r).num_output_tokens == 0 for r in rids):
            engine.step()  # prefill and the first token
        for _ in range(args.warmup):
            engine.step()  # captures the bucket's graph on a GPU
        # 1. natural
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        step_s = (time.perf_counter() - t) / args.steps
        row["ms_per_step"] = 1e3 * step_s
        row["tok_per_s"] = batch / step_s
        # 2. split
        clock = ForwardClock(llm, sync=cuda)
        host, fwd = [], []
        try:
            for _ in range(args.steps):
                before = clock.seconds
                t = time.perf_counter()
                engine.step()
                sync()
                step = time.perf_counter() - t
                fwd.append(clock.seconds - before)
                host.append(step - fwd[-1])
            if clock.calls < args.steps:
                raise RuntimeError(f"only {clock.calls} forward calls in {args.steps} steps")
            # 3. profile
            prof = cProfile.Profile()
            clock.profiler = prof
            prof.enable()
            for _ in range(args.steps):
                engine.step()
            prof.disable()
        finally:
            clock.remove()
        fwd_s, host_s = statistics.median(fwd), statistics.median(host)
        row["forward_ms"] = 1e3 * fwd_s
        row["host_us"] = 1e6 * host_s
        row["host_us_min"] = 1e6 * min(host)
        row["host_pct"] = 100 * host_s / (fwd_s + host_s)
        row["profile"] = top_entries(prof, args.steps, args.top)
        if cuda:
            gpu = graph_gpu_ms(llm, batch)
            if gpu is not None:
                row["graph_gpu_ms"] = gpu
                row["exposed_host_us"] = 1e3 * max(0.0, row["ms_per_step"] - gpu)
        return row
    finally:
        for rid in rids:
            engine.abort(rid)


def top_entries(prof: cProfile.Profile, steps: int, top: int) -> list[tuple[float, float, str]]:
    """(own µs per step, cumulative µs per step, function) of the `top` costliest entries."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append((1e6 * tottime / steps, 1e6 * cumtime / steps, f"{where} x{ncalls / steps:g}"))
    rows.sort(reverse=True)
    return rows[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="GGUF (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--top", type=int, default=12, help="profile entries per batch size")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: 4 on CUDA")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        args.model,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib or (4.0 if args.device.startswith("cuda") else None),
        max_num_seqs=max(batches),
        enforce_eager=args.enforce_eager,
    )
    graphs = llm.engine.runner.graphs
    print(
        f"model {args.model or 'demo'}: {llm.config.n_layers} layers, device {llm.device}, "
        f"torch threads {torch.get_num_threads()}, "
        f"{'CUDA graphs' if graphs is not None else 'eager'}, {args.steps} steps per pass"
    )
    rows = [measure(llm, b, args) for b in batches]
    head = "| batch | ms/step | tok/s | forward ms | host µs (median, min) | host % |"
    line = "|---|---|---|---|---|---|"
    if any("graph_gpu_ms" in r for r in rows):
        head += " graph GPU ms | exposed host µs |"
        line += "---|---|"
    print()
    print(head)
    print(line)
    for r in rows:
        s = (
            f"| {r['batch']} | {r['ms_per_step']:.2f} | {r['tok_per_s']:.0f} | "
            f"{r['forward_ms']:.2f} | {r['host_us']:.0f} ({r['host_us_min']:.0f}) | "
            f"{r['host_pct']:.1f}% |"
        )
        if "graph_gpu_ms" in r:
            s += f" {r['graph_gpu_ms']:.3f} | {r['exposed_host_us']:.0f} |"
        print(s)
    for r in rows:
        print(f"\nbatch {r['batch']}: host time by function (µs per step, cProfile; own / cum)")
        for own, cum, name in r["profile"]:
            print(f"  {own:8.1f} {cum:8.1f}  {name}")


if __name__ == "__main__":
    main()
