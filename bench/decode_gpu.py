"""Decode on a CUDA GPU: CUDA graphs against eager steps, exactness first, then speed.

Usage (repository root, a machine with a CUDA GPU and triton; about 2-4 minutes):
    python bench/decode_gpu.py [MODEL.gguf] [--like qwen3-30b-a3b --layers 12 --quant Q4_K_M]
                               [--batches 1,4,8,16,32] [--steps 32] [--check-steps 64]

Without MODEL it synthesizes `--like` cut to `--layers` layers (random valid blocks in the real
shapes; speed does not depend on the values) into --cache-dir, once.

1. Logits (model level): one decode step of B sequences with random contexts (B = 1, 3, 8, 32:
   on and off the buckets) through `DecodeGraphs.run` and through the eager forward on the same
   inputs and cache: bitwise equality, max |difference| and argmax agreement.
2. Greedy tokens (engine level): --check-steps tokens for 1 and 4 prompts with graphs and with
   `--enforce-eager`: identical token ids required.
3. Speed, per batch size, eager then graphs, through `Engine.step` (scheduler, runner, sampler,
   detokenizer): ms per step and tok/s over --steps decode steps after warm-up (the first
   graph step of a bucket captures it). For graphs also: the forward's GPU time (the captured
   graph replayed back to back, CUDA events), the host time the GPU waits for per step
   (step - forward), and where the host time goes (schedule + prepare, graph input copy +
   launch).
4. Kernel launches in one batch-1 step, eager and graph (torch.profiler).

Exit status 1 when a check fails. --json PATH also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream import LLM, SamplingParams  # noqa: E402
from moestream.layers.attention import AttentionMetadata  # noqa: E402
from moestream.runner.cuda_graph import decode_graphs_for  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def model_path(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from moestream.weights.synth import synth_gguf

    path = Path(args.cache_dir) / f"{args.like}-L{args.layers}-{args.quant}.gguf"
    if not path.exists():
        log(f"synthesizing {path}")
        synth_gguf(args.like, args.quant, path, n_layers=args.layers, progress=False)
    return path


def prompt_ids(llm: LLM, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, llm.config.vocab_size - 10, (n,), generator=g).tolist()


# ---- 1. logits ----------------------------------------------------------------------------
@torch.inference_mode()
def check_logits(llm: LLM, batches: list[int]) -> tuple[bool, list[dict]]:
    """Graph replay vs eager forward for one decode step of B sequences (own small KV pool)."""
    model, bs, dev = llm.model, 16, llm.device
    longest = 300
    per_seq = -(-longest // bs)
    kv = model.make_kv_cache(per_seq * max(batches) + 1, bs)
    graphs = decode_graphs_for(model, kv, bs)
    if graphs is None:
        log("FAIL: the model cannot run as CUDA graphs (supports_cuda_graphs is False)")
        return False, []
    ok, rows = True, []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        lens = torch.randint(2, longest, (b,), generator=g).tolist()
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        for i, n in enumerate(lens):  # prefill each context but its last token
            ids = torch.tensor(prompt_ids(llm, n - 1, seed=100 * b + i), device=dev)
            attn = AttentionMetadata.build([(0, n - 1, tables[i])], bs, dev)
            model.forward(ids, torch.arange(n - 1, device=dev), attn, kv)
        step = AttentionMetadata.build([(n - 1, 1, tables[i]) for i, n in enumerate(lens)], bs, dev)
        ids = torch.randint(10, 1000, (b,), generator=g).to(dev)
        pos = torch.tensor([n - 1 for n in lens], device=dev)
        eager = model.compute_logits(model.forward(ids, pos, step, kv))  # [B, V]
        graph = graphs.run(ids, pos, step.block_tables, step.seq_lens, step.slot_mapping).clone()
        diff = (graph - eager).abs().max().item()
        agree = (graph.argmax(-1) == eager.argmax(-1)).float().mean().item()
        same = torch.equal(graph, eager)
        rows.append({"batch": b, "bucket": graphs.bucket_for(b), "bitwise_equal": same,
                     "max_abs_diff": diff, "argmax_agreement": agree,
                     "logit_scale": eager.abs().max().item()})  # fmt: skip
        good = (
            torch.isfinite(graph).all().item()
            and agree == 1.0
            and diff <= 0.02 * max(1.0, rows[-1]["logit_scale"])
        )
        ok &= bool(good)
        log(f"logits B={b:>2} (bucket {graphs.bucket_for(b)}): bitwise equal {same}, max |diff| "
            f"{diff:.3g} (max |logit| {rows[-1]['logit_scale']:.3g}), argmax agreement "
            f"{agree:.3f} -> {'ok' if good else 'FAIL'}")  # fmt: skip
    del graphs, kv
    torch.cuda.empty_cache()
    return ok, rows


# ---- 2. greedy tokens ---------------------------------------------------------------------
def greedy(llm: LLM, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def check_tokens(llm: LLM, steps: int) -> tuple[bool, list[dict]]:
    runner = llm.engine.runner
    graphs = runner.graphs
    ok, rows = True, []
    for b in (1, 4):
        prompts = [prompt_ids(llm, 24 + 7 * i, seed=b * 10 + i) for i in range(b)]
        with_graphs = greedy(llm, prompts, steps)
        runner.graphs = None
        try:
            eager = greedy(llm, prompts, steps)
        finally:
            runner.graphs = graphs
        same = with_graphs == eager
        first = next(
            (j for a, e in zip(with_graphs, eager) for j, (x, y) in enumerate(zip(a, e)) if x != y),
            None,
        )
        ok &= same
        rows.append({"batch": b, "steps": steps, "identical": same, "first_difference": first})
        log(f"greedy tokens B={b}, {steps} steps: graphs == eager: {same}"
            + ("" if same else f" (first difference at token {first})"))  # fmt: skip
    return ok, rows


# ---- 3. speed ------------------------------------------------------------------------------
class RunTimer:
    """Wraps DecodeGraphs.run to time the host's input copy + launch inside each step."""

    def __init__(self, graphs):
        self.graphs, self.inner, self.enter, self.spent = graphs, graphs.run_decode, [], []

    def __call__(self, *args):
        t = time.perf_counter()
        self.enter.append(t)
        out = self.inner(*args)
        self.spent.append(time.perf_counter() - t)
        return out


def measure(llm: LLM, b: int, use_graphs: bool, steps: int, warmup: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    runner.graphs = graphs if use_graphs else None
    params = SamplingParams(temperature=0, max_tokens=steps + warmup + 8, ignore_eos=True)
    rids = [engine.add_request(prompt_ids(llm, 64, seed=1000 + i), params) for i in range(b)]
    try:
        while any(r.num_output_tokens == 0 for r in map(engine.scheduler.get, rids)):
            engine.step()  # prefill (and the first token)
        for _ in range(warmup):
            engine.step()  # compiles kernels, captures the bucket
        timer = None
        if use_graphs:
            timer = RunTimer(graphs)
            graphs.run_decode = timer
        starts = []
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            starts.append(time.perf_counter())
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        row = {"batch": b, "mode": "graph" if use_graphs else "eager",
               "ms_per_step": 1e3 * wall / steps, "tok_per_s": b * steps / wall}  # fmt: skip
        if use_graphs:
            assert len(timer.spent) == steps, "a timed step did not run as a graph"
            row["host_prepare_ms"] = 1e3 * statistics.median(
                e - s for e, s in zip(timer.enter, starts, strict=True)
            )
            row["host_copy_launch_ms"] = 1e3 * statistics.median(timer.spent)
            row.update(forward_gpu_ms(graphs, graphs.bucket_for(b)))
            row["host_exposed_ms"] = max(0.0, row["ms_per_step"] - row["forward_gpu_ms"])
            row["host_exposed_pct"] = 100 * row["host_exposed_ms"] / row["ms_per_step"]
        return row
    finally:
        if graphs is not None and "run_decode" in vars(graphs):
            del graphs.run_decode  # the instance attribute: back to the method
        for rid in rids:
            engine.abort(rid)
        runner.graphs = graphs


def forward_gpu_ms(graphs, bucket: int, reps: int = 20) -> dict:
    """GPU time of one decode forward: the captured graph replayed back to back."""
    graphs.replay(bucket)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graphs.replay(bucket)
    end.record()
    end.synchronize()
    return {"forward_gpu_ms": start.elapsed_time(end) / reps}


# ---- 4. launches ---------------------------------------------------------------------------
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def count_launches(llm: LLM, use_graphs: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    runner.graphs = graphs if use_graphs else None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rid = engine.add_request(prompt_ids(llm, 64, seed=7), params)
    try:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        counts = {e.key: e.count for e in prof.key_averages()}
    finally:
        engine.abort(rid)
        runner.graphs = graphs
    kernels = sum(counts.get(k, 0) for k in LAUNCH_EVENTS)
    return {"mode": "graph" if use_graphs else "eager", "kernel_launches": kernels,
            "graph_launches": counts.get("cudaGraphLaunch", 0),
            "memcpy": counts.get("cudaMemcpyAsync", 0)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: synthesize)")
    p.add_argument("--like", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--cache-dir", default="/tmp/moestream-bench")
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--check-steps", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    path = model_path(args)
    log(f"loading {path}")
    llm = LLM(path, device="cuda", kv_cache_gib=args.kv_cache_gib, max_num_seqs=max(batches),
              enable_prefix_caching=False)  # fmt: skip
    c = llm.config
    log(f"{c.name or c.arch}: {c.n_layers} layers, hidden {c.hidden_size}, {c.n_experts} "
        f"experts top-{c.n_experts_used}; {torch.cuda.get_device_name()}; torch "
        f"{torch.__version__}; graphs {'on' if llm.engine.runner.graphs else 'OFF'}")  # fmt: skip
    results: dict = {"model": str(path), "device": torch.cuda.get_device_name()}

    ok_logits, results["logits"] = check_logits(llm, [1, 3, 8, 32])
    ok_tokens, results["tokens"] = check_tokens(llm, args.check_steps)

    rows = []
    for b in batches:
        for use_graphs in (False, True):
            rows.append(measure(llm, b, use_graphs, args.steps, args.warmup))
            r = rows[-1]
            log(f"B={b:>2} {r['mode']:>5}: {r['ms_per_step']:7.2f} ms/step {r['tok_per_s']:8.1f} "
                "tok/s")  # fmt: skip
    results["speed"] = rows
    results["launches"] = [count_launches(llm, False), count_launches(llm, True)]

    print()
    print(f"decode, {c.name or c.arch} cut to {c.n_layers} layers, {torch.cuda.get_device_name()}")
    print(
        "| batch | eager ms/step | eager tok/s | graph ms/step | graph tok/s | speedup | "
        "fwd GPU ms | host exposed ms (% of step) | host: prepare / copy+launch ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        e = next(r for r in rows if r["batch"] == b and r["mode"] == "eager")
        g = next(r for r in rows if r["batch"] == b and r["mode"] == "graph")
        print(f"| {b} | {e['ms_per_step']:.2f} | {e['tok_per_s']:.1f} | {g['ms_per_step']:.2f} | "
              f"{g['tok_per_s']:.1f} | {e['ms_per_step'] / g['ms_per_step']:.1f}x | "
              f"{g['forward_gpu_ms']:.2f} | {g['host_exposed_ms']:.2f} "
              f"({g['host_exposed_pct']:.0f}%) | {g['host_prepare_ms']:.2f} / "
              f"{g['host_copy_launch_ms']:.2f} |")  # fmt: skip
    for r in results["launches"]:
        print(f"launches in one batch-1 step, {r['mode']}: {r['kernel_launches']} kernels "
              f"({r['kernel_launches'] / c.n_layers:.1f} per layer), {r['graph_launches']} "
              f"graph launches, {r['memcpy']} memcpy")  # fmt: skip
    ok = ok_logits and ok_tokens
    print(
        f"checks: logits {'ok' if ok_logits else 'FAIL'}, greedy tokens "
        f"{'ok' if ok_tokens else 'FAIL'}; total {time.perf_counter() - T0:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
