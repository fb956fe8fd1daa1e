"""Exactness gates: `moestream eval --lossless` and `--determinism N` (DESIGN.md invariant 4).

With greedy sampling a request's tokens must not depend on how it was run. The baseline is
plain decode: each prompt of the set alone, prefix cache off, default step budget. Every mode
must give token-identical outputs:
- batched: all prompts in one `generate` call (continuous batching);
- chunked: each prompt alone with a 32-token step budget (prefill in chunks);
- chunked-batched: all prompts together with the 32-token budget (chunks mixed with decodes);
- prefix-cache: prefix cache on; every prompt once to fill the cache, then again (the second
  pass is compared, and must have been served partly from the cache).
- speculative: n-gram drafts at every step (each prompt alone, and 8 at a time), the cost
  picker as `--speculative auto` runs it (8 at a time), and, when a draft model is at hand
  (`--draft-model`, or the embedded one for the demo target), draft-model drafts alone and 8 at
  a time and both proposers mixed (`spec_modes`). "At every step" (`SpecConfig.always`) drafts
  whenever a proposer has a guess, so that many drafts are verified, accepted and rejected;
  each entry reports its verify steps, tau and acceptance rate.

`--determinism N`: N fresh `LLM` instances each run the set batched; all outputs identical.
Only one `LLM` lives at a time (each allocates its own KV pool).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moestream.eval.prompts import LOSSLESS_PROMPTS
from moestream.spec.base import SpecConfig
from moestream.types import SamplingParams

CHUNK_TOKENS = 32
SPEC_CONCURRENCY = 8


@dataclass
class ModeRun:
    outputs: list[list[int]]
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache, when relevant
    spec: dict[str, Any] | None = None  # speculation counters of the run, when it speculated


@dataclass(frozen=True)
class Mode:
    """One way of running the prompt set. `run(llm, prompts, params)` returns the outputs in
    prompt order; `overrides` are LLM keyword arguments that differ from the baseline's."""

    name: str
    description: str
    run: Callable[[Any, list[str], SamplingParams], ModeRun]
    overrides: dict[str, Any] = field(default_factory=dict)


def one_at_a_time(llm: Any, prompts: list[str], params: SamplingParams) -> ModeRun:
    return ModeRun([llm.generate([p], params)[0].token_ids for p in prompts])


def all_together(llm: Any, prompts: list[str], params: SamplingParams) -> ModeRun:
    return ModeRun([o.token_ids for o in llm.generate(prompts, params)])


def cached_second_pass(llm: Any, prompts: list[str], params: SamplingParams) -> ModeRun:
    for p in prompts:
        llm.generate([p], params)
    outs = [llm.generate([p], params)[0] for p in prompts]
    return ModeRun([o.token_ids for o in outs], sum(o.num_cached_tokens for o in outs))


def _speculating(run: Callable[[Any, list[str], SamplingParams], ModeRun]):
    """`run`, with the speculation counters of what it ran."""

    def wrapped(llm: Any, prompts: list[str], params: SamplingParams) -> ModeRun:
        before = llm.engine.spec_stats()["total"]
        result = run(llm, prompts, params)
        after = llm.engine.spec_stats()["total"]
        steps = after["verify_steps"] - before["verify_steps"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        drafts = after["draft_tokens"] - before["draft_tokens"]
        result.spec = {
            "verify_steps": steps,
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "tau": 1.0 + accepted / steps if steps else 0.0,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
        }
        return result

    return wrapped


_PLAIN = {"enable_prefix_caching": False, "speculative": "off"}
BASELINE = Mode("plain", "each prompt alone, prefix cache off", one_at_a_time, _PLAIN)
EXECUTION_MODES: tuple[Mode, ...] = (
    Mode("batched", "all prompts in one generate call", all_together, _PLAIN),
    Mode(
        "chunked",
        f"each prompt alone, {CHUNK_TOKENS}-token step budget",
        one_at_a_time,
        {**_PLAIN, "max_num_batched_tokens": CHUNK_TOKENS},
    ),
    Mode(
        "chunked-batched",
        f"all prompts together, {CHUNK_TOKENS}-token step budget",
        all_together,
        {**_PLAIN, "max_num_batched_tokens": CHUNK_TOKENS},
    ),
    Mode(
        "prefix-cache",
        "prefix cache on, second pass over the set",
        cached_second_pass,
        {"enable_prefix_caching": True, "speculative": "off"},
    ),
)


def spec_modes(draft_model: str | Path | None, max_k: int = 4) -> tuple[Mode, ...]:
    """The speculative modes (module docstring); the draft-model ones only with a draft."""
    c = SPEC_CONCURRENCY

    def mode(name: str, what: str, run: Callable, spec: SpecConfig, batched: bool) -> Mode:
        overrides: dict[str, Any] = {**_PLAIN, "speculative": spec}
        if batched:
            overrides["max_num_seqs"] = c
        return Mode(name, what, _speculating(run), overrides)

    def always(proposer: str) -> SpecConfig:
        draft = str(draft_model) if proposer != "ngram" else None
        return SpecConfig(mode=proposer, draft_model=draft, max_k=max_k, always=True)

    modes = [
        mode("spec-ngram", "n-gram drafts every step, each prompt alone",
             one_at_a_time, always("ngram"), False),
        mode("spec-ngram-c8", f"n-gram drafts every step, {c} at a time",
             all_together, always("ngram"), True),
        mode("spec-auto-c8", f"the cost picker (--speculative auto), {c} at a time",
             all_together, SpecConfig(mode="auto", draft_model=draft_model and str(draft_model),
                                      max_k=max_k), True),
    ]  # fmt: skip
    if draft_model is not None:
        modes += [
            mode("spec-draft", "draft-model drafts every step, each prompt alone",
                 one_at_a_time, always("draft"), False),
            mode("spec-draft-c8", f"draft-model drafts every step, {c} at a time",
                 all_together, always("draft"), True),
            mode("spec-mixed-c8", f"n-gram, else draft-model drafts every step, {c} at a time",
                 all_together, always("auto"), True),
        ]  # fmt: skip
    return tuple(modes)


# Every model can run these; `run_lossless` adds the draft-model modes when it has a draft.
MODES: tuple[Mode, ...] = EXECUTION_MODES + spec_modes(None)


def default_modes(model: str | Path, engine: dict[str, Any]) -> tuple[Mode, ...]:
    """The execution modes and the speculative ones, with draft-model modes when `engine`
    names a draft model or `model` is the demo target (its embedded draft)."""
    from moestream.llm import default_draft_model

    draft = engine.get("draft_model") or default_draft_model(model)
    return EXECUTION_MODES + spec_modes(draft, engine.get("num_speculative_tokens") or 4)


def first_mismatches(
    expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]], limit: int = 5
) -> list[dict[str, Any]]:
    """Where outputs differ: prompt index, first differing position, the two tokens there
    (None past an end) and both lengths; at most `limit` entries."""
    out = []
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if list(a) == list(b):
            continue
        diff = (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        pos = next(diff, min(len(a), len(b)))
        out.append(
            {
                "prompt": i,
                "position": pos,
                "expected": a[pos] if pos < len(a) else None,
                "got": b[pos] if pos < len(b) else None,
                "expected_len": len(a),
                "got_len": len(b),
            }
        )
        if len(out) >= limit:
            break
    return out


def _check(name: str, description: str, expected: list[list[int]], run: ModeRun) -> dict[str, Any]:
    identical = sum(list(a) == list(b) for a, b in zip(expected, run.outputs, strict=False))
    entry: dict[str, Any] = {
        "mode": name,
        "description": description,
        "identical": identical,
        "total": len(expected),
        "mismatches": first_mismatches(expected, run.outputs),
    }
    ok = identical == len(expected) and len(run.outputs) == len(expected)
    if run.spec is not None:
        entry["spec"] = run.spec
    if run.cached_tokens is not None:
        entry["cached_tokens"] = run.cached_tokens
        if run.cached_tokens == 0:
            ok = False
            entry["error"] = "the prefix cache served no token on the second pass"
    entry["passed"] = ok
    return entry


class _OneLLM:
    """Builds LLMs one at a time: a new configuration frees the previous instance first."""

    def __init__(self, model: str | Path, engine: dict[str, Any]):
        self.model, self.engine = model, engine
        self._key: tuple | None = None
        self._llm: Any = None

    def get(self, overrides: dict[str, Any], fresh: bool = False) -> Any:
        from moestream.llm import LLM

        kwargs = {**self.engine, **overrides}
        key = tuple(sorted(kwargs.items()))
        if fresh or key != self._key:
            self.release()
            self._llm, self._key = LLM(self.model, **kwargs), key
        return self._llm

    def release(self) -> None:
        if self._llm is not None:
            device = self._llm.device
            self._llm = self._key = None
            gc.collect()
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_lossless(
    model: str | Path,
    engine: dict[str, Any],
    prompts: Sequence[str] = LOSSLESS_PROMPTS,
    max_tokens: int = 32,
    modes: Sequence[Mode] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the baseline and every mode (default: `default_modes`); JSON-able report with
    `passed`."""
    prompts, params = list(prompts), _params(max_tokens)
    if modes is None:
        modes = default_modes(model, engine)
    llms = _OneLLM(model, engine)
    try:
        if log:
            log(f"lossless: {BASELINE.name} ({BASELINE.description})")
        expected = BASELINE.run(llms.get(BASELINE.overrides), prompts, params).outputs
        results = []
        for m in modes:
            if log:
                log(f"lossless: {m.name} ({m.description})")
            run = m.run(llms.get(m.overrides), prompts, params)
            results.append(_check(m.name, m.description, expected, run))
    finally:
        llms.release()
    return {
        "baseline": f"{BASELINE.name}: {BASELINE.description}",
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "modes": results,
        "passed": all(r["passed"] for r in results),
    }


def run_determinism(
    model: str | Path,
    engine: dict[str, Any],
    n_runs: int,
    prompts: Sequence[str] = LOSSLESS_PROMPTS,
    max_tokens: int = 32,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`n_runs` fresh LLM instances run the set batched; each compared with the first."""
    if n_runs < 2:
        raise ValueError(f"--determinism needs at least 2 runs, got {n_runs}")
    prompts, params = list(prompts), _params(max_tokens)
    llms = _OneLLM(model, engine)
    runs = []
    try:
        for i in range(n_runs):
            if log:
                log(f"determinism: fresh instance {i + 1}/{n_runs}")
            runs.append(all_together(llms.get({}, fresh=True), prompts, params))
    finally:
        llms.release()
    checks = [
        _check(f"run {i + 1}", "fresh LLM instance", runs[0].outputs, r)
        for i, r in enumerate(runs[1:], start=1)
    ]
    return {
        "runs": n_runs,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }


def format_exactness(report: dict[str, Any], title: str) -> str:
    key = "modes" if "modes" in report else "checks"
    lines = [f"{title}: {report['prompts']} prompts x {report['max_tokens']} greedy tokens"]
    if "baseline" in report:
        lines.append(f"baseline: {report['baseline']}")
    for r in report[key]:
        extra = f", {r['cached_tokens']} cached prompt tokens" if "cached_tokens" in r else ""
        if "spec" in r:
            sp = r["spec"]
            extra = (
                f", {sp['verify_steps']} verify steps, tau {sp['tau']:.2f}, "
                f"{100 * sp['acceptance_rate']:.0f}% of drafts accepted"
            )
        lines.append(
            f"  {r['mode']:16} {r['identical']}/{r['total']} identical{extra}  "
            f"{'pass' if r['passed'] else 'FAIL'}"
        )
        if r.get("error"):
            lines.append(f"    {r['error']}")
        for m in r["mismatches"]:
            lines.append(
                f"    prompt {m['prompt']}: first difference at token {m['position']} "
                f"(expected {m['expected']}, got {m['got']}; lengths "
                f"{m['expected_len']}/{m['got_len']})"
            )
    lines.append(f"{title}: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)
