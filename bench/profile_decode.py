"""Profile batch-1 decode steps of a model: where a step's time goes (torch.profiler tables),
and on CUDA the GPU's timeline: its busy time, and its idle gaps summed by the pair of
operations around them (where a step waits for the host: host-computed experts, launches).

python bench/profile_decode.py MODEL.gguf [--device cuda] [--steps 10] [--prompt 128]
    [--gpu-expert-cache-gib G --host-expert-cache-gib H --expert-zero-copy
     --expert-cpu-fraction F --expert-cpu-threads N]   # an expert placement, as `moestream
                                                       # bench` takes it

With streamed experts on CUDA (decode steps as chains of CUDA graphs, runner/piecewise.py) the
host's part between pieces is timed too, per cut: the wait for the piece before it (a stream
sync), the hook (`before`: the routing read, loads, prefetch, slot table), the next piece's
launch and the `after` hook; and the step outside the chain (the engine's own work).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream import LLM, SamplingParams


def short(name: str) -> str:
    return name.split("(")[0][:48]


def gpu_timeline(prof, steps: int) -> None:
    """GPU busy time per step and the idle gaps between GPU operations, by neighbours."""
    from torch.autograd import DeviceType

    ops = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
         if e.device_type == DeviceType.CUDA),
    )  # fmt: skip
    if not ops:
        print("no GPU operations recorded")
        return
    busy, gaps = 0.0, collections.Counter()
    counts: collections.Counter = collections.Counter()
    end, prev = ops[0][0], None
    for start, stop, name in ops:
        if start > end and prev is not None:
            gaps[(short(prev), short(name))] += start - end
            counts[(short(prev), short(name))] += 1
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - ops[0][0]
    print(f"GPU: span {span / steps / 1e3:.3f} ms a step, busy {busy / steps / 1e3:.3f} ms "
          f"({busy / span:.0%}), idle {(span - busy) / steps / 1e3:.3f} ms")  # fmt: skip
    print("| idle after | before | ms a step | gaps a step | us a gap |\n|---|---|---|---|---|")
    for (a, b), us in gaps.most_common(12):
        n = counts[(a, b)]
        print(f"| {a} | {b} | {us / steps / 1e3:.3f} | {n / steps:.1f} | {us / n:.1f} |")


def time_cuts() -> dict[str, list[float]]:
    """Time the host's part of every replayed chain of graphs (module doc): patches
    `piecewise.Cutter.replay` (before any capture, so every chain gets the timed replay)."""
    from moestream.runner import piecewise

    times: dict[str, list[float]] = {"chains": [], "sync": [], "before": [], "launch": [],
                                     "after": []}  # fmt: skip
    clock = time.perf_counter

    def replay(self: piecewise.Cutter) -> None:
        start = clock()
        self.graphs[0].replay()
        stream = torch.cuda.current_stream()
        for (before, after), graph in zip(self.hooks, self.graphs[1:], strict=True):
            t0 = clock()
            stream.synchronize()  # the wait `before` starts with; its own sync then returns
            t1 = clock()
            before()
            t2 = clock()
            graph.replay()
            t3 = clock()
            after()
            t4 = clock()
            for name, dt in zip(
                ("sync", "before", "launch", "after"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            ):
                times[name].append(dt)
        times["chains"].append(clock() - start)

    piecewise.Cutter.replay = replay  # type: ignore[method-assign]
    return times


def report_cuts(times: dict[str, list[float]], step_ms: float) -> None:
    """Medians per cut and sums per step of the chains replayed in the plain run."""
    chains = len(times["chains"])
    per = len(times["sync"]) / chains
    chain_ms = statistics.median(times["chains"]) * 1e3
    print(f"chains of graphs: {per:.0f} cuts a step, {chain_ms:.2f} ms a chain (median), "
          f"{step_ms - chain_ms:.2f} ms of the step outside it")  # fmt: skip
    print("| at each cut | median us | mean us | ms a step |")
    print("|---|---|---|---|")
    for name in ("sync", "before", "launch", "after"):
        v = times[name]
        print(f"| {name} | {statistics.median(v) * 1e6:.1f} | {statistics.fmean(v) * 1e6:.1f} | "
              f"{sum(v) / chains * 1e3:.2f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--device", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--gpu-expert-cache-gib", type=float, default=None)
    p.add_argument("--host-expert-cache-gib", type=float, default=0.0)
    p.add_argument("--expert-zero-copy", action="store_true")
    p.add_argument(
        "--expert-paging", choices=["auto", "on", "off"], default="off",
        help="as moestream's option; off by default here: the cut timing is the streamed store's",
    )  # fmt: skip
    p.add_argument("--expert-cpu-fraction", type=float, default=0.0)
    p.add_argument("--expert-cpu-threads", type=int, default=None)
    p.add_argument("--tables", action="store_true", help="also torch.profiler's op tables")
    args = p.parse_args()
    llm = LLM(
        args.model, device=args.device, kv_cache_gib=args.kv_cache_gib,
        gpu_expert_cache_gib=args.gpu_expert_cache_gib,
        host_expert_cache_gib=args.host_expert_cache_gib, expert_zero_copy=args.expert_zero_copy,
        expert_cpu_fraction=args.expert_cpu_fraction, expert_cpu_threads=args.expert_cpu_threads,
        expert_rebalance_steps=0,
        expert_paging={"auto": None, "on": True, "off": False}[args.expert_paging],
    )  # fmt: skip
    cuts = time_cuts() if llm.device.type == "cuda" else None
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps * 3 + 40, ignore_eos=True)
    ids = [(i * 7919) % (llm.config.vocab_size - 10) + 5 for i in range(args.prompt)]
    engine.add_request(ids, params)
    for _ in range(20):  # prefill and warm-up decode steps
        engine.step()
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    host = [z.host_work.compute for z in (llm.zero_copy or [])[:1] if z.host_work is not None]
    before = host[0].counters if host else None
    for v in (cuts or {}).values():
        v.clear()  # the warm-up's
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    print(f"plain: {step_ms:.2f} ms per decode step")
    if cuts is not None and cuts["chains"]:
        report_cuts(cuts, step_ms)
    if host:
        after = host[0].counters
        calls = (after["calls"] - before["calls"]) / args.steps
        spent = (after["compute_s"] - before["compute_s"]) / args.steps * 1e3
        print(f"host experts: {calls:.1f} host functions a step, {spent:.3f} ms of host "
              f"compute a step ({spent / max(calls, 1) * 1e3:.1f} us a call)")  # fmt: skip
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    if llm.device.type == "cuda":
        gpu_timeline(prof, args.steps)
    if args.tables or llm.device.type != "cuda":
        key = "self_cuda_time_total" if llm.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
