"""Does running one speculative mode slow down plain decode afterwards in the same process?
Plain greedy decode of the tiny pair's target, timed before and after a run of forced
draft-model drafting (and of forced n-gram drafting), then after emptying torch's caching
allocator and a garbage collection.

    python bench/spec_after_draft.py [--device cuda] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from moestream.bench.machine import synchronize
from moestream.bench.spec_section import prompts_of
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from moestream.spec.base import SpecConfig
from moestream.types import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = {"kv_cache_gib": 2.0} if args.device != "cpu" else {}
    llm = LLM(DEMO_MODEL, device=args.device, enable_prefix_caching=False, **kv)
    engine = llm.engine
    prompts = [llm.tokenizer.encode(t) for t in prompts_of("prose", 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    modes = {
        name: engine.build_speculator(SpecConfig(mode=m, draft_model=str(DEMO_DRAFT), always=True))
        for name, m in (("draft always", "draft"), ("ngram always", "ngram"))
    }

    def rate(spec=None) -> float:
        engine.speculator = spec
        rates = []
        for _ in range(args.repeats):
            synchronize(torch.device(args.device))
            t0 = time.perf_counter()
            for q in prompts:
                llm.generate([q], params)
            synchronize(torch.device(args.device))
            rates.append(len(prompts) * args.tokens / (time.perf_counter() - t0))
        return statistics.median(rates)

    rate()  # warm-up: compile, capture
    print(f"plain, first: {rate():.0f} tok/s")
    for name, spec in modes.items():
        print(f"{name}: {rate(spec):.0f} tok/s")
        print(f"plain, after {name}: {rate():.0f} tok/s")
    if args.device != "cpu":
        torch.cuda.empty_cache()
    gc.collect()
    print(f"plain, after empty_cache + gc: {rate():.0f} tok/s")
    print(f"plain, again: {rate():.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
