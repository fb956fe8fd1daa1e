"""Profile batch-1 decode steps of a model: where a step's time goes (torch.profiler tables).

python bench/profile_decode.py MODEL.gguf [--device cuda] [--steps 10] [--prompt 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--device", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, kv_cache_gib=args.kv_cache_gib)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    ids = [(i * 7919) % (llm.config.vocab_size - 10) + 5 for i in range(args.prompt)]
    engine.add_request(ids, params)
    for _ in range(20):  # prefill and warm-up decode steps
        engine.step()
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    print(f"plain: {(time.perf_counter() - t) / args.steps * 1e3:.2f} ms per decode step")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    key = "self_cuda_time_total" if llm.device.type == "cuda" else "self_cpu_time_total"
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
        )
    )
    if llm.device.type == "cuda":
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
