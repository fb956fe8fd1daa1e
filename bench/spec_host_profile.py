"""Where the host time of one speculative mode goes on the tiny pair: cProfile of greedy
generation (after a warm-up of the same prompts), moestream functions by cumulative time.

    python bench/spec_host_profile.py [--device cuda] [--mode draft] [--kind prose]
                                      [--tokens 128] [--rows 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from moestream.bench.spec_section import prompts_of
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from moestream.spec.base import SpecConfig
from moestream.types import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="draft", help="off, ngram, draft or auto")
    p.add_argument("--kind", default="prose", help="copy or prose prompts")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = {"kv_cache_gib": 2.0} if args.device != "cpu" else {}
    llm = LLM(DEMO_MODEL, device=args.device, enable_prefix_caching=False, **kv)
    if args.mode != "off":
        llm.engine.speculator = llm.engine.build_speculator(
            SpecConfig(mode=args.mode, draft_model=str(DEMO_DRAFT))
        )
    prompts = [llm.tokenizer.encode(t) for t in prompts_of(args.kind, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for _ in range(2):  # warm-up: compile, capture, picker measurements
        for q in prompts:
            llm.generate([q], params)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for q in prompts:
        llm.generate([q], params)
    prof.disable()
    wall = time.perf_counter() - start
    rate = len(prompts) * args.tokens / wall
    print(f"mode {args.mode}, {args.kind}: {rate:.0f} tok/s under cProfile")
    if llm.engine.speculator is not None:
        print(llm.engine.spec_stats())
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(r"moestream", args.rows)
    print(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
