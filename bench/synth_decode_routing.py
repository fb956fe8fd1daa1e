"""How much a synth file's greedy decode flatters an expert cache.

A GGUF of random weights (`moestream synth`) decodes greedily into loops: the same token again
and again, so the same experts every step, and a cache of device slots hits almost always. This
decodes random prompts through an `ExpertStore` (device slots only, the rest read from the file)
greedily and at temperature 1 (tokens drawn from the model's distribution, nearly uniform on
random weights), and prints per mode: the share of distinct tokens among those decoded, and the
store's decode-phase counters (device hit rate, prefetch accuracy, bytes from the file a token).

    python bench/synth_decode_routing.py [MODEL.gguf] [--slots 4] [--tokens 48] [--prompts 3]

MODEL defaults to a synth file in tiny-qwen3-moe's shapes, written to a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from moestream.experts import (  # noqa: E402
    ExpertBudgets,
    ExpertLayout,
    attach_expert_store,
    build_expert_store,
)
from moestream.llm import LLM  # noqa: E402
from moestream.types import SamplingParams  # noqa: E402
from moestream.weights.synth import synth_gguf  # noqa: E402


def run(model: str, slots: int, tokens: int, prompts: int, temperature: float) -> dict:
    llm = LLM(model, device="cpu", enable_prefix_caching=False)
    c = llm.config
    layout = ExpertLayout.from_gguf(llm.source.gguf, c.n_experts, c.n_experts_used)
    budgets = ExpertBudgets(slots * layout.slot_bytes / 2**30, 0.0)
    rng = np.random.default_rng(0)
    distinct = []
    with build_expert_store(llm.source, llm.config, budgets, "cpu") as store:
        attach_expert_store(llm.model, store)
        for p in range(prompts):
            ids = rng.integers(0, c.vocab_size, 32).tolist()
            params = SamplingParams(temperature=temperature, max_tokens=tokens, seed=p,
                                    ignore_eos=True)  # fmt: skip
            out = llm.generate([ids], params)[0].token_ids
            distinct.append(len(set(out)) / len(out))
        snap = store.counters.snapshot()["phases"]["decode"]
    n = max(snap["tokens"], 1)
    return {
        "distinct": float(np.mean(distinct)),
        "hit_rate": snap["device_hit_rate"],
        "prefetch_accuracy": snap["prefetch_accuracy"],
        "kib_per_token": snap["bytes_from_disk"] / n / 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--slots", type=int, default=4, help="device slots per layer")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per prompt")
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = args.model
    if model is None:
        model = str(Path(tempfile.mkdtemp()) / "synth-tiny.gguf")
        synth_gguf("tiny-qwen3-moe", "Q4_K_M", model, progress=False)
    print(f"{model}: {args.slots} device slots a layer, {args.prompts} random prompts x "
          f"{args.tokens} tokens, decode steps only\n")  # fmt: skip
    print("| decode | distinct tokens | device hit rate | prefetch accuracy "
          "| KiB from file a token |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, t in (("greedy", 0.0), ("temperature 1", 1.0)):
        r = run(model, args.slots, args.tokens, args.prompts, t)
        print(f"| {name} | {r['distinct']:.0%} | {r['hit_rate']:.1%} | "
              f"{r['prefetch_accuracy']:.1%} | {r['kib_per_token']:,.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
