"""The `concurrency` section of `moestream bench --concurrency 1,4,8,16,32`: c requests at
once, each with a random prompt of `--concurrency-prompt` tokens and `--decode-tokens` greedy
tokens, as llama-batched-bench measures it: the prefill phase (until every request has its
first token) is timed apart from the decode phase; aggregate decode tok/s is all generated
tokens of the decode phase over its time, per request that divided by c. The decode phase's
clock starts after one untimed step past the prefill phase (each request then asks one token
more), without a device sync: the step the engine queued behind it is running, so the timed
tokens are whole steps (see `runner`'s decode)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from moestream.bench.machine import synchronize

if TYPE_CHECKING:  # runner.py lists this section among its own
    from moestream.bench.runner import BenchContext, Metric

_SECTION_ID = 3  # seeds this section's prompts apart from the others'


class ConcurrencySection:
    name = "concurrency"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        levels = ctx.config.concurrency
        if not levels:
            return None
        rows = []
        for c in levels:
            need = ctx.config.concurrency_prompt + ctx.config.decode_tokens + 2
            if need > ctx.max_model_len:
                ctx.skip(self.name, c, f"prompt + {ctx.config.decode_tokens + 2} tokens")
                continue
            rows.append(self._row(ctx, c))
        return {"prompt_tokens": ctx.config.concurrency_prompt, "rows": rows} if rows else None

    def _row(self, ctx: BenchContext, c: int) -> dict[str, Any]:
        from moestream.bench.runner import _power_summary, decode_params, stats

        k = ctx.config.decode_tokens
        engine = ctx.llm.engine

        def measure(run: int) -> dict[str, Any]:
            ids = [
                engine.add_request(ctx.random_prompt(_SECTION_ID, ctx.config.concurrency_prompt,
                                                     run * 1000 + i),
                                   decode_params(ctx.config.temperature, k + 2, run * 1000 + i))
                for i in range(c)
            ]  # fmt: skip
            pending, done = set(ids), set()
            started: set[str] = set()
            total = 0  # tokens of every request, prefill phase included
            t0 = time.perf_counter()
            while len(started) < c:  # prefill phase: until every request has a token
                for out in engine.step():
                    total += len(out.new_token_ids)
                    if out.new_token_ids:
                        started.add(out.request_id)
                    if out.finished:
                        done.add(out.request_id)
            for out in engine.step():  # one decode step, untimed
                total += len(out.new_token_ids)
                if out.finished:
                    done.add(out.request_id)
            t1 = time.perf_counter()
            n = 0  # tokens of the decode phase alone
            with ctx.power.measure() as pm:
                while pending - done:
                    for out in engine.step():
                        n += len(out.new_token_ids)
                        if out.finished:
                            done.add(out.request_id)
                synchronize(ctx.device)
                t2 = time.perf_counter()
            if total + n != c * (k + 2):
                raise RuntimeError(f"concurrency {c}: {total + n} tokens, expected {c * (k + 2)}")
            decode_s = t2 - t1
            return {
                "prefill_s": t1 - t0,
                "decode_s": decode_s,
                "aggregate_tok_s": n / decode_s,
                "per_request_tok_s": n / decode_s / c,
                "power": pm.result(),
            }

        samples = ctx.repeat(measure)
        mean_w, j = _power_summary(samples, c * k)
        return {
            "concurrency": c,
            "decode_tokens": k,
            "aggregate_tok_s": stats([s["aggregate_tok_s"] for s in samples]),
            "per_request_tok_s": stats([s["per_request_tok_s"] for s in samples]),
            "prefill_s": stats([s["prefill_s"] for s in samples]),
            "mean_power_w": mean_w,
            "j_per_generated_token": j,
            "samples": samples,
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        from moestream.bench.runner import Metric

        return [
            Metric(
                f"c{r['concurrency']} aggregate tok/s", "tok/s", True,
                [s["aggregate_tok_s"] for s in r["samples"]],
            )
            for r in data["rows"]
        ]  # fmt: skip

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        head = ["concurrency", "aggregate tok/s (median)", "min-max", "per request tok/s",
                "prefill s", "board W", "J/token"]  # fmt: skip
        rows = []
        for r in data["rows"]:
            a = r["aggregate_tok_s"]
            rows.append([
                str(r["concurrency"]), f"{a['median']:,.1f}", f"{a['min']:,.1f}-{a['max']:,.1f}",
                f"{r['per_request_tok_s']['median']:,.1f}", f"{r['prefill_s']['median']:.3f}",
                "-" if r["mean_power_w"] is None else f"{r['mean_power_w']:.0f}",
                "-" if r["j_per_generated_token"] is None else f"{r['j_per_generated_token']:.3f}",
            ])  # fmt: skip
        return head, rows
