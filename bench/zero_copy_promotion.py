"""Zero-copy placement with and without promotion on a model's real routing: the share of expert
reads served from the device, measured on a second batch of prompts after a first one has
warmed the placement up (steady state), against the best fixed placement in hindsight (each
layer's most-read experts of the whole run on the device).

    python bench/zero_copy_promotion.py [MODEL] [--fractions 0.25,0.5] [--steps 0,16,64,256]
                                        [--tokens 128] [--device cpu]

MODEL defaults to the embedded demo MoE (trained: its routing is uneven, as real models' is);
prompts are slices of the held-out Python text shipped with it. Four prompts decode at once,
so an engine step routes four tokens.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moestream.cli import DEMO_MODEL
from moestream.experts.zero_copy import zero_copy_snapshot
from moestream.llm import LLM
from moestream.types import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default=str(DEMO_MODEL))
    p.add_argument(
        "--fractions", default="0.25,0.5", help="share of each layer's experts on the device"
    )
    p.add_argument(
        "--steps", default="0,16,64,256", help="--expert-rebalance-steps values (0: fixed)"
    )
    p.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(2)
    text = (DEMO_MODEL.parent / "heldout-python.txt").read_text()
    warm = [text[i : i + 400] for i in (0, 5000, 12000, 20000)]
    test = [text[i : i + 400] for i in (26000, 31000, 35000, 38000)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    common = dict(device=args.device, max_model_len=512, host_expert_cache_gib=64.0,
                  expert_zero_copy=True)  # fmt: skip
    probe = LLM(args.model, gpu_expert_cache_gib=1e-9, **common)
    all_experts = sum(p.nbytes["host"] for p in probe.zero_copy)  # bytes of every expert
    del probe
    print("| experts on the device | rebalance every | device share, second batch | "
          "best fixed placement | swaps |")  # fmt: skip
    print("|---|---|---|---|---|")
    for frac in (float(f) for f in args.fractions.split(",")):
        for steps in (int(s) for s in args.steps.split(",")):
            gib = frac * all_experts / 2**30 + 1e-9
            llm = LLM(args.model, gpu_expert_cache_gib=gib, expert_rebalance_steps=steps, **common)
            llm.generate(warm, params)
            before = zero_copy_snapshot(llm.zero_copy)
            llm.generate(test, params)
            after = zero_copy_snapshot(llm.zero_copy)
            device = after["device_reads"] - before["device_reads"]
            host = after["host_reads"] - before["host_reads"]
            best = total = 0
            for z in llm.zero_copy:  # whole run's reads per expert
                reads = sorted(z._reads.tolist(), reverse=True)
                best += sum(reads[: z.n_device])
                total += sum(reads)
            print(f"| {frac:.0%} | {steps or 'never'} | {device / (device + host):.3f} | "
                  f"{best / total:.3f} | {after['swaps']} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
