"""Speculative decoding on the trained tiny pair (CPU, or `--device cuda`): tau and speedup
over plain decode, in one process, for copy-heavy and prose prompts.

    OMP_NUM_THREADS=1 python bench/spec_figures.py [--tokens 128] [--prompts 3] [--rounds 3]
                                                   [--json out.json]

One engine over the embedded demo target (tiny Qwen3-MoE, Q4_K_M) with one speculator per mode,
swapped in between runs: plain, ngram, draft, auto (the cost picker, as `--speculative` runs
them), and ngram/draft "always" (a draft at every step, k = 4: what the proposers accept when
the picker does not choose). A run is `--prompts` prompts of one kind, each alone (concurrency
1), `--tokens` greedy tokens each, timed from each request's first token to its last. Each
round runs every mode once, in an order rotated and reversed from round to round; a warm-up
round (its figures dropped) lets each picker measure costs first. Reported: median tok/s (min
and max over rounds), the median of per-round speedups over the plain run of the same round,
tau, acceptance by draft position and the share of request-steps that carried drafts. Every
run's text is compared with plain decode's: on the CPU they are equal; on a GPU without
`--deterministic`, verification runs other kernels than a plain step, so each divergence is
reported with the plain model's margin at that token (exit status 1 unless all are near-ties:
a margin within `--tie` nats or two steps of the logits' dtype at that logit, whichever is
larger: bf16 logits of 16-32 are 0.125 apart). The markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moestream.bench.spec_section import KINDS, decode_run, prompts_of, summarize_spec
from moestream.cli import DEMO_DRAFT, DEMO_MODEL
from moestream.llm import LLM
from moestream.spec.base import SpecConfig

MODES = {
    "plain": None,
    "ngram": SpecConfig(mode="ngram"),
    "draft": SpecConfig(mode="draft", draft_model=str(DEMO_DRAFT)),
    "auto": SpecConfig(mode="auto", draft_model=str(DEMO_DRAFT)),
    "ngram always": SpecConfig(mode="ngram", always=True),
    "draft always": SpecConfig(mode="draft", draft_model=str(DEMO_DRAFT), always=True),
}


def commit() -> str:
    if os.environ.get("MOESTREAM_COMMIT"):  # a copy of the tree without .git
        return os.environ["MOESTREAM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    kv = {"kv_cache_gib": 2.0} if args.device != "cpu" else {}  # the draft needs room too
    llm = LLM(
        DEMO_MODEL, device=args.device, enable_prefix_caching=False,
        deterministic=args.deterministic, **kv,
    )  # fmt: skip
    engine = llm.engine
    specs = {name: engine.build_speculator(cfg) for name, cfg in MODES.items()}
    results: dict = {}
    for kind in args.kinds:
        prompts = [llm.tokenizer.encode(p) for p in prompts_of(kind, args.prompts)]
        runs: dict[str, list[dict]] = {name: [] for name in MODES}
        names = list(MODES)
        for r in range(args.rounds + 1):  # round 0 warms up
            order = names[r % len(names) :] + names[: r % len(names)]
            if r % 2:
                order.reverse()
            for name in order:
                engine.speculator = specs[name]
                res = decode_run(engine, prompts, args.tokens + 2)
                engine.speculator = None
                print(f"{kind} round {r} {name}: {res['tok_s']:.1f} tok/s", file=sys.stderr)
                if r:
                    runs[name].append(res)
        plain_outputs = runs["plain"][0]["outputs"]
        rows = {}
        for name, rs in runs.items():
            divergences = [
                divergence(llm, prompts[i], plain_outputs[i], out)
                for x in rs
                for i, out in enumerate(x["outputs"])
                if out != plain_outputs[i]
            ]
            tok_s = [x["tok_s"] for x in rs]
            speedup = [x["tok_s"] / p["tok_s"] for x, p in zip(rs, runs["plain"])]
            rows[name] = {
                "tok_s": tok_s,
                "speedup": speedup,
                "spec": summarize_spec([x["spec"] for x in rs]) if name != "plain" else None,
                "divergences": divergences,
            }
        results[kind] = rows
    return results


def divergence(llm: LLM, prompt: list[int], plain: list[int], other: list[int]) -> dict:
    """Where `other` first leaves plain decode's tokens, and the plain model's margin there:
    log p(plain token) - log p(other token) at that position (one forward over the prompt and
    the common tokens). A small margin is an argmax near-tie that other kernels may flip.
    `step_nats`: the spacing of the model's activation dtype at the larger of the two logits
    (the logits come out of the head in that dtype: bf16 on a GPU, 0.125 at logits of 16-32),
    below which no margin can be told apart."""
    i = next((j for j, (a, b) in enumerate(zip(plain, other, strict=False)) if a != b), None)
    if i is None:  # one is a prefix of the other (cannot happen with ignore_eos)
        return {"at": min(len(plain), len(other)), "margin_nats": None, "step_nats": 0.0}
    logits = llm.logits(list(prompt) + plain[:i])[-1].float()
    logp = torch.log_softmax(logits, -1)
    top = max(abs(float(logits[plain[i]])), abs(float(logits[other[i]])))
    step = dtype_step(llm.model.dtype, top)
    return {"at": i, "margin_nats": float(logp[plain[i]] - logp[other[i]]), "step_nats": step}


def dtype_step(dtype: torch.dtype, x: float) -> float:
    """The spacing of `dtype`'s values at magnitude x (the smallest normal's below it)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(x, info.tiny)))


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "| prompts | mode | tok/s median (min-max) | speedup vs plain | tau | accepted by "
        "position | steps with drafts |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, rows in results.items():
        for name, r in rows.items():
            t = r["tok_s"]
            sp = r["spec"]
            lines.append(
                f"| {kind} | {name} | {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) "
                f"| {statistics.median(r['speedup']):.2f}x ({min(r['speedup']):.2f}-"
                f"{max(r['speedup']):.2f}) "
                f"| {sp['tau']:.2f} | "
                + (" ".join(f"{a:.2f}" for a in sp["acceptance_by_position"]) or "-")
                + f" | {100 * sp['speculated_share']:.0f}% |"
                if sp
                else f"| {kind} | {name} | {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) "
                "| 1 | - | - | - |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=3, help="prompts per kind")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (plus one warm-up)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--json", default=None, help="also write the raw figures here")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tie", type=float, default=0.1, help="margin (nats) of a near-tie divergence")
    p.add_argument(
        "--deterministic", action="store_true", help="batch-invariant GPU kernels (exact text)"
    )
    args = p.parse_args()
    start = time.time()
    results = run(args)
    head = (
        f"commit {commit()}, {time.strftime('%Y-%m-%d')}, torch threads 1, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.prompts} prompts "
        f"x {args.tokens} tokens per run, {args.rounds} rounds + 1 warm-up, "
        f"{time.time() - start:.0f} s"
    )
    print(head)
    print(markdown(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"head": head, "results": results}, indent=1))
    bad = 0
    for kind, rows in results.items():
        for name, r in rows.items():
            for d in r["divergences"]:
                m, step = d["margin_nats"], d.get("step_nats", 0.0)
                bound = max(args.tie, 2 * step)  # two steps of the logits' dtype at least
                tie = m is not None and m <= bound
                bad += not tie
                print(f"divergence: {kind} {name} at token {d['at']}, plain model's margin "
                      f"{'?' if m is None else f'{m:.4f}'} nats (bound {bound:.4f}): "
                      f"{'near-tie' if tie else 'NOT a near-tie'}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
