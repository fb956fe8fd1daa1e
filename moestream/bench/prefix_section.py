"""The `prefix_reuse` section of `moestream bench --prefix-reuse LEN[:SHARED]`: time to first
token of a prompt the prefix cache has never seen (cold) against one that shares its first
SHARED tokens with the prompt just before it (warm), as an agent client that rewrites the end
of a long prompt and sends it again.

Per run: a fresh random prompt A of LEN tokens goes through `LLM.generate` with max_tokens=1
(greedy, as the prefill section): its time is the cold TTFT. Then B = A[:SHARED] + fresh random
tokens up to LEN, the same way: the warm TTFT. The prefix cache serves B the whole KV blocks of
A[:SHARED] (SHARED rounded down to the block size; the engine always computes B's last token);
`cached_tokens` is what the engine reports for each request (`CompletionOutput.
num_cached_tokens`, the `usage.prompt_tokens_details.cached_tokens` of the server). The device
is synchronised at both ends of every timed call. `warmup` runs are dropped, `repeats` kept;
`warm_over_cold` is the ratio of the medians (the target at 32k with 31k shared: < 5%).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from moestream.bench.machine import synchronize
from moestream.types import SamplingParams

if TYPE_CHECKING:  # runner.py lists this section among its own
    from moestream.bench.runner import BenchContext, Metric

_PROMPT_ID = 4  # seeds prompt A apart from the other sections' prompts
_TAIL_ID = 5  # seeds the fresh tail of prompt B


def expected_cached_tokens(prompt_tokens: int, shared_tokens: int, block_size: int) -> int:
    """Tokens of B the prefix cache can serve: the whole blocks of the shared prefix, never
    B's last token (its logits must be computed)."""
    return min(shared_tokens // block_size, (prompt_tokens - 1) // block_size) * block_size


def _timed_first_token(ctx: BenchContext, ids: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens the engine reports) of one request."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    synchronize(ctx.device)
    t0 = time.perf_counter()
    (out,) = ctx.llm.generate([ids], params)
    synchronize(ctx.device)
    return time.perf_counter() - t0, out.num_cached_tokens


class PrefixReuseSection:
    """`prefix_reuse`: see the module docstring. Absent without `--prefix-reuse`."""

    name = "prefix_reuse"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        spec = ctx.config.prefix_reuse
        if spec is None:
            return None
        n, shared = spec
        engine = ctx.llm.engine
        if n + 1 > ctx.max_model_len:
            ctx.skip(self.name, n, "prompt + 1 token")
            return None
        allocator = engine.scheduler.allocator
        need = allocator.blocks_needed(n)
        if need > allocator.num_blocks:
            ctx.skipped.append({
                "section": self.name, "tokens": n,
                "reason": f"a prompt of {n} tokens needs {need} KV blocks, the pool has "
                          f"{allocator.num_blocks} (raise --kv-cache-gib)",
            })  # fmt: skip
            return None
        block_size = engine.cache_config.block_size
        return self._measure(ctx, n, shared, block_size, engine.scheduler.prefix_cache is not None)

    def _measure(
        self, ctx: BenchContext, n: int, shared: int, block_size: int, caching: bool
    ) -> dict[str, Any]:
        from moestream.bench.runner import stats

        def measure(run: int) -> dict[str, Any]:
            a = ctx.random_prompt(_PROMPT_ID, n, run)
            b = a[:shared] + ctx.random_prompt(_TAIL_ID, n - shared, run)
            cold_s, cold_cached = _timed_first_token(ctx, a)
            warm_s, warm_cached = _timed_first_token(ctx, b)
            return {
                "cold_s": cold_s,
                "warm_s": warm_s,
                "warm_over_cold": warm_s / cold_s,
                "cold_cached_tokens": cold_cached,
                "warm_cached_tokens": warm_cached,
            }

        samples = ctx.repeat(measure)
        cold = stats([s["cold_s"] for s in samples])
        warm = stats([s["warm_s"] for s in samples])
        rows = [
            {
                "prompt": kind,
                "prompt_tokens": n,
                "shared_tokens": 0 if kind == "cold" else shared,
                # the fewest any run got: a run the cache missed shows here
                "cached_tokens": min(s[f"{kind}_cached_tokens"] for s in samples),
                "ttft_s": ttft,
            }
            for kind, ttft in (("cold", cold), ("warm", warm))
        ]
        return {
            "prompt_tokens": n,
            "shared_tokens": shared,
            "block_size": block_size,
            "prefix_caching": caching,
            "expected_cached_tokens": expected_cached_tokens(n, shared, block_size)
            if caching
            else 0,
            "warm_over_cold": warm["median"] / cold["median"],
            "rows": rows,
            "samples": samples,
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        from moestream.bench.runner import Metric

        n, ss = data["prompt_tokens"], data["samples"]
        return [
            Metric(f"prefix {n} cold TTFT s", "s", False, [s["cold_s"] for s in ss]),
            Metric(f"prefix {n} warm TTFT s", "s", False, [s["warm_s"] for s in ss]),
            Metric(f"prefix {n} warm/cold", "x", False, [s["warm_over_cold"] for s in ss]),
        ]

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        head = ["prompt", "tokens", "shared", "cached (engine)", "TTFT s (median)", "min-max",
                "warm/cold"]  # fmt: skip
        rows = []
        for r in data["rows"]:
            t = r["ttft_s"]
            ratio = f"{100 * data['warm_over_cold']:.1f}%" if r["prompt"] == "warm" else "-"
            rows.append([
                r["prompt"], f"{r['prompt_tokens']:,}", f"{r['shared_tokens']:,}",
                f"{r['cached_tokens']:,}", f"{t['median']:.3f}",
                f"{t['min']:.3f}-{t['max']:.3f}", ratio,
            ])  # fmt: skip
        return head, rows
