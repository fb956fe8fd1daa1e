"""Greedy text of a model on the GPU against the CPU reference, and what each divergence is.

    python bench/greedy_gpu_vs_cpu.py [MODEL] [--tokens 200] [--prompts 8] [--device cuda]
                                      [--tie 0.1] [--deterministic] [--json out.json]

For each prompt (held-out code to rewrite and prose, `bench.spec_section.prompts_of`), both
devices generate `--tokens` greedy tokens. Where the texts first differ at token i, the CPU
reference's own log-probabilities at that position (prompt + the common i tokens, one forward)
say what the choice was: the margin between its top token and the token the GPU chose. A
divergence is an argmax near-tie when that margin is at most `--tie` nats or two steps of the
other model's activation dtype at the larger of the two logits, whichever is larger (the rule
of `bench/spec_figures.py`: the GPU's logits leave the head in bf16, 0.0625 apart at logits of
8-16, so it cannot order two tokens a step apart; and its kernels round activations to 8 bits
per block of 32, `docs/kernels.md`). Exit status 1 when some divergence is not a near-tie.

With `--device cpu` both runs are the CPU reference (a self-check: no divergence).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_figures import dtype_step  # noqa: E402

from moestream.bench.spec_section import prompts_of  # noqa: E402
from moestream.cli import DEMO_MODEL  # noqa: E402
from moestream.llm import LLM  # noqa: E402
from moestream.types import SamplingParams  # noqa: E402


def near_tie_bound(tie: float, dtype: torch.dtype, logit: float) -> float:
    """The largest margin (nats) counted as a near-tie: `tie`, or two steps of `dtype` at the
    magnitude `logit`, whichever is larger."""
    return max(tie, 2.0 * dtype_step(dtype, abs(logit)))


def compare(
    ref: LLM, other: LLM, prompts: list[str], tokens: int, tie: float
) -> list[dict[str, object]]:
    """One row per prompt: tokens equal, or the first divergence and its reference margin."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    a = ref.generate(prompts, params)
    b = other.generate(prompts, params)
    rows = []
    for prompt, ra, rb in zip(prompts, a, b, strict=True):
        ta, tb = list(ra.token_ids), list(rb.token_ids)
        i = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        row: dict[str, object] = {"prompt": prompt[:60], "tokens": len(ta), "diverged_at": i}
        if i is not None:
            logits = ref.logits(list(ra.prompt_token_ids) + ta[:i])[-1]
            logp = torch.log_softmax(logits, -1)
            margin = float(logp[ta[i]] - logp[tb[i]])
            rank = int((logp > logp[tb[i]]).sum())
            top = max(abs(float(logits[ta[i]])), abs(float(logits[tb[i]])))
            bound = near_tie_bound(tie, other.model.dtype, top)
            row.update(ref_token=ta[i], other_token=tb[i], margin_nats=margin, other_rank=rank,
                       logit=top, bound_nats=bound, near_tie=margin <= bound)  # fmt: skip
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEMO_MODEL))
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8, help="prompts of each kind")
    parser.add_argument("--device", default="cuda", help="the device compared with the CPU")
    parser.add_argument("--tie", type=float, default=0.1, help="near-tie margin, nats")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = prompts_of("copy", args.prompts) + prompts_of("prose", args.prompts)
    ref = LLM(args.model, device="cpu", num_threads=1)
    other = LLM(args.model, device=args.device, deterministic=args.deterministic)
    rows = compare(ref, other, prompts, args.tokens, args.tie)
    print("| prompt | diverged at | CPU token | other token | margin (nats) | rank | logit |"
          " bound (nats) | near-tie |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["diverged_at"] is None:
            print(f"| {r['prompt']!r} | - (all {r['tokens']} equal) | | | | | | | |")
        else:
            print(
                f"| {r['prompt']!r} | {r['diverged_at']} | {r['ref_token']} | {r['other_token']}"
                f" | {r['margin_nats']:.4f} | {r['other_rank']} | {r['logit']:.2f}"
                f" | {r['bound_nats']:.4f} | {r['near_tie']} |"
            )
    same = sum(r["diverged_at"] is None for r in rows)
    bad = [r for r in rows if r["diverged_at"] is not None and not r["near_tie"]]
    print(f"\n{same}/{len(rows)} identical; {len(bad)} divergences beyond a near-tie")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
