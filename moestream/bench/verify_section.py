"""The `verify_cost` section of `moestream bench --verify-curve 1,2,4,8,16`: what one target
step costs when each of b requests feeds k tokens (its last token and k - 1 drafts), relative
to a plain decode step (k = 1), at a context depth of `--concurrency-prompt` tokens.

Path measured: the engine's own verify step. b requests with fresh random prompts are prefilled
(untimed); then, before each timed `engine.step()`, every request gets k - 1 random draft tokens
in `Request.draft_token_ids`, exactly where the speculator puts its proposals. The scheduler
feeds them, the runner runs one forward over all b * k tokens and verifies the drafts
(`spec.verify`), the scheduler commits the accepted ones. The timed region is the whole step
(plan, forward, sampling or verification, commit) with the device synchronised at both ends;
the proposer's own cost is not in it, nor does the runner queue a step ahead (a plain step,
k = 1, is timed with its host work; run-ahead hides that in plain decode, so the ratios are
slightly in speculation's favour). Every k runs as the engine runs it: on CUDA a decode
(k = 1) or verify (k > 1) CUDA graph where the model and the runner's buckets allow one, else
eagerly; a row's `cuda_graph` is True when every kept step of it replayed a graph (read from
`ModelRunner.last_step_graph` after each step). Random drafts are nearly always rejected, so the
context grows by about one token per step. Rounds interleave the ks (1 2 4, 4 2 1, ...) so
that drift reaches every k alike; `warmup` rounds are dropped (on CUDA they also take the
first-use costs: Triton compiles, graph capture of the batch's bucket), `repeats` kept.

Per (b, k): step ms (median, min, max) and cost(k) = median step ms at k / median at k = 1.
Implied speedup for a mean accepted length tau (tokens per verify step, `--verify-tau`):

    speedup(tau) = max over measured k >= tau of  tau / cost(k)

the best case where tau tokens come out of each verify step at that k and drafting is free
(a k-token step emits at most k tokens, hence k >= tau). None when no measured k reaches tau.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from moestream.bench.machine import synchronize
from moestream.types import SamplingParams

if TYPE_CHECKING:  # runner.py lists this section among its own
    from moestream.bench.runner import BenchContext, Metric

_PROMPT_ID = 6  # seeds this section's prompts apart from the other sections'
_DRAFT_ID = 7  # seeds the random drafts
FORMULA = "speedup(tau) = max over measured k >= tau of tau / (cost(k) / cost(1))"


def implied_speedup(cost_ratio: dict[int, float], tau: float) -> tuple[float, int] | None:
    """(speedup, k) of the module docstring's formula for `cost_ratio` {k: cost(k)/cost(1)};
    None when no k reaches `tau`."""
    options = [(tau / r, k) for k, r in cost_ratio.items() if k >= tau]
    return max(options) if options else None


def _skip(ctx: BenchContext, batch: int, reason: str) -> None:
    ctx.skipped.append({"section": "verify_cost", "tokens": batch, "reason": reason})


class VerifyCostSection:
    """`verify_cost`: see the module docstring. Absent without `--verify-curve`."""

    name = "verify_cost"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        if not ctx.config.verify_ks:
            return None
        ks = sorted(set(ctx.config.verify_ks) | {1})  # k = 1 is the baseline of every ratio
        engine = ctx.llm.engine
        spec = engine.speculator
        engine.speculator = None  # drafts come from here; the speculator must not see them
        rows: list[dict[str, Any]] = []
        try:
            for b in ctx.config.verify_batches:
                rows += self._batch(ctx, b, ks)
        finally:
            engine.speculator = spec
        if not rows:
            return None
        speedup = []
        for b in dict.fromkeys(r["batch"] for r in rows):
            ratios = {r["k"]: r["cost_ratio"] for r in rows if r["batch"] == b}
            for tau in ctx.config.verify_tau:
                best = implied_speedup(ratios, tau)
                speedup.append({
                    "batch": b, "tau": tau,
                    "speedup": None if best is None else best[0],
                    "best_k": None if best is None else best[1],
                })  # fmt: skip
        return {
            "depth": ctx.config.concurrency_prompt,
            "ks": ks,
            "formula": FORMULA,
            "rows": rows,
            "speedup": speedup,
        }

    def _batch(self, ctx: BenchContext, b: int, ks: list[int]) -> list[dict[str, Any]]:
        """Rows of batch size `b` (one per k that fits), or none with a stated skip."""
        from moestream.bench.runner import stats

        engine, sched = ctx.llm.engine, ctx.llm.engine.scheduler
        budget = engine.sched_config.max_num_batched_tokens
        if b > engine.sched_config.max_num_seqs:
            _skip(ctx, b, f"batch {b} exceeds --max-num-seqs {engine.sched_config.max_num_seqs}")
            return []
        for k in [k for k in ks if b * k > budget]:
            _skip(ctx, b, f"batch {b} x k {k} tokens exceed --max-num-batched-tokens {budget}")
        ks = [k for k in ks if b * k <= budget]
        rounds = ctx.config.warmup + ctx.config.repeats
        depth = ctx.config.concurrency_prompt
        # Room for the tokens decoded while others still prefill, for every round to accept
        # all its drafts, and for k - 1 drafts at the last step.
        max_tokens = 2 + -(-b * depth // budget) + rounds * sum(ks) + max(ks)
        if depth + max_tokens > ctx.max_model_len:
            ctx.skip("verify_cost", b, f"prompt + {max_tokens} tokens")
            return []
        need = b * sched.allocator.blocks_needed(depth + max_tokens)
        if need > sched.allocator.num_blocks:
            _skip(ctx, b, f"batch {b} needs {need} KV blocks, the pool has "
                          f"{sched.allocator.num_blocks}")  # fmt: skip
            return []
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [
            engine.add_request(ctx.random_prompt(_PROMPT_ID, depth, b * 1000 + i), params)
            for i in range(b)
        ]
        try:
            times = self._rounds(ctx, ids, ks, rounds)
        finally:
            for rid in ids:
                engine.abort(rid)
        base = stats(times[1]["ms"])["median"]
        rows = []
        for k in ks:
            step_ms = stats(times[k]["ms"])
            rows.append({
                "batch": b, "k": k, "drafts_per_request": k - 1, "tokens_per_step": b * k,
                "step_ms": step_ms, "cost_ratio": step_ms["median"] / base,
                "accepted_drafts": times[k]["accepted"],
                "cuda_graph": times[k]["graph"],
                "samples": [{"step_ms": t} for t in times[k]["ms"]],
            })  # fmt: skip
        return rows

    def _rounds(
        self, ctx: BenchContext, ids: list[str], ks: list[int], rounds: int
    ) -> dict[int, dict[str, Any]]:
        """Prefill `ids` (untimed), then `rounds` rounds of one timed step per k: per k the
        kept step times in ms, the drafts the target accepted, and whether every kept step
        ran as a CUDA graph."""
        runner = ctx.llm.engine.runner
        # No run-ahead: a plain step (k = 1) would queue the next step's forward, which the
        # synchronised end of its timing would include, and the k > 1 step after it would drop
        # (on the H200 the 30B's k = 1 steps were timed at 2.8 and 5.1 ms, k = 2 at 3.3).
        ahead, runner.run_ahead = runner.run_ahead, False
        try:
            return self._timed_rounds(ctx, ids, ks, rounds)
        finally:
            runner.run_ahead = ahead

    def _timed_rounds(
        self, ctx: BenchContext, ids: list[str], ks: list[int], rounds: int
    ) -> dict[int, dict[str, Any]]:
        engine = ctx.llm.engine
        started: set[str] = set()
        while len(started) < len(ids):
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        rng = np.random.default_rng((ctx.config.seed, _DRAFT_ID, len(ids)))
        vocab = ctx.llm.config.vocab_size
        out: dict[int, dict[str, Any]] = {k: {"ms": [], "accepted": 0, "graph": True} for k in ks}
        preemptions = engine.scheduler.num_preemptions
        for r in range(rounds):
            for k in ks if r % 2 == 0 else ks[::-1]:
                running = {req.request_id: req for req in engine.scheduler.running}
                for rid in ids:
                    req = running[rid]
                    if req.sampling_params.max_tokens - req.num_output_tokens - 1 < k - 1:
                        raise RuntimeError(f"{rid}: no room left for {k - 1} drafts")
                    req.draft_token_ids = rng.integers(0, vocab, size=k - 1).tolist()
                synchronize(ctx.device)
                t0 = time.perf_counter()
                outputs = engine.step()
                synchronize(ctx.device)
                ms = 1e3 * (time.perf_counter() - t0)
                got = {o.request_id: len(o.new_token_ids) for o in outputs}
                if sorted(got) != sorted(ids) or any(o.finished for o in outputs):
                    raise RuntimeError(f"verify step of k={k} did not advance all {len(ids)} "
                                       f"requests once: {got}")  # fmt: skip
                if r >= ctx.config.warmup:
                    out[k]["ms"].append(ms)
                    out[k]["accepted"] += sum(got.values()) - len(ids)
                    out[k]["graph"] &= engine.runner.last_step_graph is not None
        if engine.scheduler.num_preemptions != preemptions:
            raise RuntimeError("a request was preempted during the verify-cost steps")
        return out

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        from moestream.bench.runner import Metric

        return [
            Metric(f"verify b{r['batch']} k{r['k']} step ms", "ms", False,
                   [s["step_ms"] for s in r["samples"]])
            for r in data["rows"]
        ]  # fmt: skip

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        """One row per batch size: cost(k) (median step ms) per k, then the implied speedup
        per tau at its best k."""
        ks = data["ks"]
        taus = list(dict.fromkeys(s["tau"] for s in data["speedup"]))
        head = [f"batch (depth {data['depth']:,}; cost(k) = step ms / k=1 step ms)"]
        head += [f"k={k} cost (ms)" for k in ks]
        head += [f"speedup tau={t:g} (k)" for t in taus]
        rows = []
        for b in dict.fromkeys(r["batch"] for r in data["rows"]):
            by_k = {r["k"]: r for r in data["rows"] if r["batch"] == b}
            row = [str(b)]
            for k in ks:
                r = by_k.get(k)
                graph = ", graph" if r and r["cuda_graph"] else ""
                row.append(
                    "-" if r is None
                    else f"{r['cost_ratio']:.2f}x ({r['step_ms']['median']:.2f}{graph})"
                )  # fmt: skip
            for t in taus:
                s = next(x for x in data["speedup"] if x["batch"] == b and x["tau"] == t)
                row.append("-" if s["speedup"] is None else f"{s['speedup']:.2f}x ({s['best_k']})")
            rows.append(row)
        rows.append([f"speedup: {FORMULA}"] + [""] * (len(head) - 1))
        return head, rows
