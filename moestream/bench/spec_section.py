"""The `speculative` bench section: plain vs speculative decode in the same process, with tau.

Runs when the benchmarked LLM speculates (`moestream bench --speculative ngram|draft|auto`).
For each prompt kind (copy-heavy: a function of the held-out Python sample, then a request to
rewrite it with its variables renamed and the start of the rewrite; prose: natural-language
openings), `decode_tokens` greedy tokens are generated for each of `num_prompts` prompts, one
request at a time, once with speculation off and once on, on the same engine (the speculator is
swapped between runs; its cost and acceptance estimates carry over, as in a server). Runs are
interleaved A B B A A B ... so that drift hits both sides alike; `warmup` rounds are dropped.
Time counts from each request's first token to its last (prefill is the same on both sides).

Per kind: tok/s of both sides (median, min, max over rounds), the median per-round speedup,
tau (tokens per verify step), acceptance by draft position, and the share of request-steps
that ran plain decode (the picker's choice). Greedy outputs of both sides must be equal; the
row counts the prompt runs where they were not (`outputs_differ`, "DIFFERS" in the table: a
backend whose kernels are not batch-invariant), since a speed figure of a lossy run means
nothing.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moestream.spec.stats import ArmStats

if TYPE_CHECKING:  # runner.py lists this section among its own
    from moestream.bench.runner import BenchContext, Metric

PROSE = (
    "The history of the city goes back to a small fishing village on the river. Over the years",
    "Dear members of the committee, thank you for your letter of last week. We have read it",
    "Once upon a time, in a small village by the sea, there lived an old woman who",
    "The weather this spring has been unusually warm, and the farmers in the valley say that",
    "In this chapter we describe how the survey was carried out and what the people we met",
    "She opened the door slowly and looked into the room. Nobody was there, but the lamp on",
    "Abstract. We describe a method for measuring the throughput of a small web service and",
    "My grandfather used to tell us stories about the war, about the winters and about the",
)
REWRITE = "\n\n# Rewrite the function above, renaming its variables:\n"
KINDS = ("copy", "prose")


def heldout_functions(
    text: str | None = None, min_lines: int = 4, max_lines: int = 14
) -> list[str]:
    """Functions (and methods, dedented) of the bundled held-out Python sample with
    `min_lines`..`max_lines` lines, in file order."""
    if text is None:
        text = (Path(__file__).parents[1] / "data" / "heldout-python.txt").read_text()
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)def \w+\(", lines[i])
        if not m:
            i += 1
            continue
        indent, j = len(m.group(1)), i + 1
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
        ):
            j += 1
        body = "\n".join(lines[i:j]).rstrip()
        if min_lines <= body.count("\n") + 1 <= max_lines and "<|endoftext|>" not in body:
            out.append(textwrap.dedent(body))
        i = j
    return out


def copy_prompts(n: int | None = None) -> list[str]:
    """Copy-heavy prompts: a function, a request to rewrite it renaming its variables, and the
    rewrite's first line (its `def` line), which the model then tends to continue by copying."""
    return [f + REWRITE + f.split("\n")[0] + "\n" for f in heldout_functions()[:n]]


def prose_prompts(n: int | None = None) -> list[str]:
    return list(PROSE[:n])


def prompts_of(kind: str, n: int | None = None) -> list[str]:
    if kind == "copy":
        return copy_prompts(n)
    if kind == "prose":
        return prose_prompts(n)
    raise ValueError(f"unknown prompt kind {kind!r} (known: {', '.join(KINDS)})")


def decode_run(
    engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0
) -> dict[str, Any]:
    """Each prompt alone through `engine` (greedy, or sampled at `temperature` with seed i for
    prompt i; `max_tokens`): decode seconds and the tokens they produced (summed), outputs, and
    what the speculator counted (`SpecCounts` of this run, None when the engine does not
    speculate). The clock of a prompt starts when its first decode step's tokens arrive (the
    prefill's token and that step untimed): from then on every timed token came out of a step
    that ran inside the clock, with run-ahead or without (`runner`'s decode section)."""
    from moestream.bench.runner import decode_params  # runner lists this section

    before = _counters(engine)
    seconds, tokens, outputs = 0.0, 0, []
    for i, ids in enumerate(prompts):
        rid = engine.add_request(list(ids), decode_params(temperature, max_tokens, i))
        out: list[int] = []
        steps = 0  # steps that gave this request tokens
        start, untimed = None, 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid and o.new_token_ids:
                    out += o.new_token_ids
                    steps += 1
            if start is None and steps == 2:
                start, untimed = time.perf_counter(), len(out)
        if start is None or len(out) == untimed:
            raise RuntimeError(f"decode run: max_tokens {max_tokens} leaves no timed token")
        seconds += time.perf_counter() - start
        tokens += len(out) - untimed
        outputs.append(out)
    after = _counters(engine)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "outputs": outputs,
        "spec": None if after is None else _minus(after, before),
    }


@dataclass
class SpecCounts:
    """What a speculator counted over some span: verify steps (`ArmStats`, all proposers) and
    request-steps that ran plain decode instead."""

    verified: ArmStats = field(default_factory=ArmStats)
    plain_steps: int = 0

    def add(self, other: SpecCounts) -> None:
        self.verified.merge(other.verified)
        self.plain_steps += other.plain_steps


def _counters(engine: Any) -> SpecCounts | None:
    spec = engine.speculator
    if spec is None:
        return None
    return SpecCounts(spec.stats.total, spec.stats.num_plain_steps)


def _minus(after: SpecCounts, before: SpecCounts | None) -> SpecCounts:
    if before is None:
        return after
    a, b = after.verified, before.verified
    out = ArmStats(
        a.num_verify_steps - b.num_verify_steps,
        a.num_draft_tokens - b.num_draft_tokens,
        a.num_accepted_tokens - b.num_accepted_tokens,
        a.num_explore_steps - b.num_explore_steps,
        [x - (b.proposed_by_position[j] if j < len(b.proposed_by_position) else 0)
         for j, x in enumerate(a.proposed_by_position)],
        [x - (b.accepted_by_position[j] if j < len(b.accepted_by_position) else 0)
         for j, x in enumerate(a.accepted_by_position)],
    )  # fmt: skip
    while out.proposed_by_position and not out.proposed_by_position[-1]:  # not reached this run
        out.proposed_by_position.pop()
        out.accepted_by_position.pop()
    return SpecCounts(out, after.plain_steps - before.plain_steps)


def summarize_spec(runs: Sequence[SpecCounts | None]) -> dict[str, Any]:
    """tau, acceptance (overall and by draft position) and the share of request-steps that
    carried drafts, over the runs' counters."""
    total = SpecCounts()
    for r in runs:
        if r is not None:
            total.add(r)
    steps, plain = total.verified.num_verify_steps, total.plain_steps
    return {
        **total.verified.as_dict(),
        "tau": total.verified.tau if steps else 1.0,
        "plain_steps": plain,
        "speculated_share": steps / (steps + plain) if steps + plain else 0.0,
    }


class SpecSection:
    """`speculative`: see the module docstring. Absent when the LLM does not speculate."""

    name = "speculative"

    def __init__(self, kinds: Sequence[str] = KINDS, num_prompts: int = 3) -> None:
        self.kinds = tuple(kinds)
        self.num_prompts = num_prompts

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        engine = ctx.llm.engine
        spec = engine.speculator
        if spec is None:
            return None
        try:
            rows = [self._row(ctx, kind, spec) for kind in self.kinds]
        finally:
            engine.speculator = spec
        cfg = spec.config
        return {
            "mode": cfg.mode,
            "proposers": list(spec.proposers),
            "max_k": cfg.max_k,
            "always": cfg.always,
            "concurrency": 1,
            "rows": rows,
        }

    def _row(self, ctx: BenchContext, kind: str, spec: Any) -> dict[str, Any]:
        from moestream.bench.runner import stats

        engine, n = ctx.llm.engine, ctx.config.decode_tokens + 2
        prompts = [ctx.llm.tokenizer.encode(p) for p in prompts_of(kind, self.num_prompts)]
        samples = []
        differ = 0  # prompt runs whose speculative text differed from plain decode's
        rounds = ctx.config.warmup + ctx.config.repeats
        for r in range(rounds):
            runs = {}
            for side in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):  # A B B A ...
                engine.speculator = spec if side == "spec" else None
                runs[side] = decode_run(engine, prompts, n)
            differ += sum(a != b for a, b in zip(runs["plain"]["outputs"], runs["spec"]["outputs"]))
            if r >= ctx.config.warmup:
                samples.append(
                    {
                        "plain_tok_s": runs["plain"]["tok_s"],
                        "spec_tok_s": runs["spec"]["tok_s"],
                        "speedup": runs["spec"]["tok_s"] / runs["plain"]["tok_s"],
                        "spec": runs["spec"]["spec"],
                    }
                )
        return {
            "kind": kind,
            "prompts": len(prompts),
            "decode_tokens": ctx.config.decode_tokens,
            "plain_tok_s": stats([s["plain_tok_s"] for s in samples]),
            "spec_tok_s": stats([s["spec_tok_s"] for s in samples]),
            "speedup": stats([s["speedup"] for s in samples]),
            "spec": summarize_spec([s["spec"] for s in samples]),
            "outputs_differ": differ,
            "samples": [{**s, "spec": summarize_spec([s["spec"]])} for s in samples],
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        from moestream.bench.runner import Metric

        out = []
        for r in data["rows"]:
            k, ss = r["kind"], r["samples"]
            out += [
                Metric(f"plain {k} tok/s", "tok/s", True, [s["plain_tok_s"] for s in ss]),
                Metric(f"speculative {k} tok/s", "tok/s", True, [s["spec_tok_s"] for s in ss]),
                Metric(f"speculative {k} speedup", "x", True, [s["speedup"] for s in ss]),
            ]
        return out

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        head = [
            "prompts",
            "plain tok/s",
            f"{data['mode']} tok/s",
            "speedup (min-max)",
            "tau",
            "accepted by position",
            "steps speculated",
            "greedy text",
        ]
        rows = []
        for r in data["rows"]:
            sp = r["spec"]
            by_pos = " ".join(f"{a:.2f}" for a in sp["acceptance_by_position"]) or "-"
            rows.append(
                [
                    f"{r['kind']} ({r['prompts']} x {r['decode_tokens']} tok)",
                    f"{r['plain_tok_s']['median']:.1f}",
                    f"{r['spec_tok_s']['median']:.1f}",
                    f"{r['speedup']['median']:.2f}x ({r['speedup']['min']:.2f}-"
                    f"{r['speedup']['max']:.2f})",
                    f"{sp['tau']:.2f}",
                    by_pos,
                    f"{100 * sp['speculated_share']:.0f}%",
                    "as plain" if not r["outputs_differ"] else f"DIFFERS ({r['outputs_differ']})",
                ]
            )
        return head, rows
