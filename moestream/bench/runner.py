"""`moestream bench`: prefill and decode throughput, measured through the engine's real paths.

What is measured
- prefill at N prompt tokens: one request of N random prompt tokens with max_tokens=1 through
  `LLM.generate` (scheduler, chunked prefill, runner, sampler); the time to its first token.
- decode at depth D: one request whose prompt of D tokens is prefilled first (not timed), one
  token decoded (not timed), then `decode_tokens` more through `LLM.stream`, timed from the
  arrival of that first decoded token to the last: in steady state. (Timed from the prefill's
  token, after a device sync, the step that the engine had already queued behind the prefill
  ran partly before the clock started: figures before 2026-11-30's ninth session were ~0.8 of a
  step too fast, ~2.5% at 32 tokens for Qwen3-30B-A3B on the H200; bench/RESULTS.md.)
- `warmup` runs per row are discarded, `repeats` runs are kept; each row reports median, min and
  max. On CUDA the device is synchronised at the end of every measured region, and at its start
  where nothing runs ahead into it (prefill; decode starts on a token's arrival, above).
- Prompt token ids are uniform over the vocabulary from
  `numpy.random.default_rng((seed, section, length, run))`: a fresh prompt for every run, so the
  prefix cache never serves a measured prompt.
- Memory: the peak of `torch.cuda.max_memory_allocated` per row and overall; the process's peak
  resident set (`ru_maxrss`) at the end.
- Power (CUDA + NVML): mean board power during each measured region and the energy per prompt
  token (prefill) or per generated token (decode); null with a stated reason elsewhere.
- Ceiling (decode): bytes one token must read = weight bytes per token (dense tensors, the
  active share of the experts, one embedding row; `moestream.info`) + KV bytes per token of
  context x (D + decode_tokens / 2), over the device's copy bandwidth (bytes read + written,
  `measure_copy_bandwidth` or `--copy-bandwidth`).

Result (JSON, `"schema": "moestream.bench/1"`): `run`, `machine`, `git`, `model`, `config`,
`copy_bandwidth`, `power`, `memory`, `skipped`, then one key per section that ran: `prefill`
and `decode` (`{"rows": [...]}`, each row with `samples`, the raw measurements). A section that
does not apply is absent, never empty.

`speculative` (spec_section.py): plain vs speculative decode with tau, when the LLM speculates.
`prefix_reuse` (prefix_section.py, `--prefix-reuse LEN[:SHARED]`): cold vs warm time to first
token when the prefix cache serves SHARED tokens. `verify_cost` (verify_section.py,
`--verify-curve`): the cost of a step that scores k tokens per request, relative to k = 1.

Adding a section (concurrency sweep, expert-tier counters): write
a class with the `Section` members below (`run` returns the section's JSON or None when it does
not apply, `metrics` the per-sample figures that `--compare` sets side by side, `table` the
markdown table), and pass it in `run_bench(sections=...)` (the CLI appends it when its flag is
given). Reports and comparisons pick it up from those members; the schema version stays
`moestream.bench/1` as long as existing keys keep their meaning.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from moestream.bench.concurrency_section import ConcurrencySection
from moestream.bench.experts_section import ExpertsSection
from moestream.bench.machine import (
    git_info,
    machine_info,
    measure_copy_bandwidth,
    run_info,
    synchronize,
)
from moestream.bench.power import PowerSampler, open_power_sampler
from moestream.bench.prefix_section import PrefixReuseSection
from moestream.bench.spec_section import SpecSection
from moestream.bench.verify_section import VerifyCostSection
from moestream.errors import RequestError
from moestream.types import SamplingParams

SCHEMA = "moestream.bench/1"
DEFAULT_PROMPT_LENS = (512, 4096, 16384, 32768)
_WARMUP_RUN = 1_000_000  # run index of the first warm-up run (its own prompts)


@dataclass(frozen=True)
class BenchConfig:
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS
    decode_depths: tuple[int, ...] = (0, *DEFAULT_PROMPT_LENS)
    decode_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    copy_bandwidth_gbps: float | None = None  # None: measure it on the device
    concurrency: tuple[int, ...] = ()  # the concurrency sweep's levels (empty: no sweep)
    concurrency_prompt: int = 128  # prompt tokens of each request in the sweep (and verify)
    prefix_reuse: tuple[int, int] | None = None  # (LEN, SHARED) of the prefix-reuse section
    verify_ks: tuple[int, ...] = ()  # tokens per request of the verify-cost curve (empty: off)
    verify_batches: tuple[int, ...] = (1, 4, 16)  # requests per verify step
    verify_tau: tuple[float, ...] = (2.0, 3.0, 4.0)  # tau values for the implied speedup
    # Sampling temperature of the decode and concurrency runs: 0 greedy; above, each request
    # samples with a seed of its own (`decode_params`)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise RequestError(f"--repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise RequestError(f"--warmup must be >= 0, got {self.warmup}")
        if self.decode_tokens < 1:
            raise RequestError(f"--decode-tokens must be >= 1, got {self.decode_tokens}")
        if any(n < 1 for n in self.prompt_lens):
            raise RequestError(f"--prompt-lens must be >= 1, got {list(self.prompt_lens)}")
        if any(d < 0 for d in self.decode_depths):
            raise RequestError(f"--decode-depths must be >= 0, got {list(self.decode_depths)}")
        if any(c < 1 for c in self.concurrency) or self.concurrency_prompt < 1:
            raise RequestError("--concurrency levels and --concurrency-prompt must be >= 1")
        if self.prefix_reuse is not None:
            n, shared = self.prefix_reuse
            if not 1 <= shared < n:
                raise RequestError(f"--prefix-reuse needs 1 <= SHARED < LEN, got {n}:{shared}")
        if any(k < 1 for k in self.verify_ks) or any(b < 1 for b in self.verify_batches):
            raise RequestError("--verify-curve ks and --verify-batches must be >= 1")
        if any(not t >= 1 for t in self.verify_tau):
            raise RequestError(f"--verify-tau values must be >= 1, got {list(self.verify_tau)}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"--temperature must be finite and >= 0, got {self.temperature}")
        if self.copy_bandwidth_gbps is not None and self.copy_bandwidth_gbps <= 0:
            raise RequestError(f"--copy-bandwidth must be positive, got {self.copy_bandwidth_gbps}")


class Metric(NamedTuple):
    """Samples of one figure, as `--compare` sets them side by side."""

    name: str  # e.g. "prefill 512 tok/s"
    unit: str
    higher_is_better: bool
    samples: list[float]


def stats(values: Sequence[float]) -> dict[str, float | int]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


@dataclass
class BenchContext:
    """What sections share: the model, the settings, the power sampler and the facts derived
    from the model file once."""

    llm: Any  # moestream.llm.LLM
    config: BenchConfig
    power: PowerSampler
    max_model_len: int
    weight_bytes_per_token: int
    kv_bytes_per_token: int
    copy_bandwidth_gbps: float | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    peak_gpu_bytes: int | None = None  # the largest per-row peak so far

    @property
    def device(self) -> torch.device:
        return self.llm.device

    def random_prompt(self, section: int, length: int, run: int) -> list[int]:
        rng = np.random.default_rng((self.config.seed, section, length, run))
        return rng.integers(0, self.llm.config.vocab_size, size=length).tolist()

    def skip(self, section: str, tokens: int, what: str) -> None:
        """Record a row that does not fit the context (stated in the report, not measured)."""
        reason = f"{what} exceeds max_model_len {self.max_model_len}"
        self.skipped.append({"section": section, "tokens": tokens, "reason": reason})

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def gpu_peak(self) -> int | None:
        if self.device.type != "cuda":
            return None
        peak = int(torch.cuda.max_memory_allocated(self.device))
        self.peak_gpu_bytes = max(peak, self.peak_gpu_bytes or 0)
        return peak

    def repeat(self, measure: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
        """`warmup` discarded runs, then `repeats` kept runs of `measure(run_index)`."""
        for i in range(self.config.warmup):
            measure(_WARMUP_RUN + i)
        return [measure(i) for i in range(self.config.repeats)]


class Section(Protocol):
    """One part of a benchmark run. See the module docstring for how sections plug in."""

    name: str

    def run(self, ctx: BenchContext) -> dict[str, Any] | None: ...

    def metrics(self, data: dict[str, Any]) -> list[Metric]: ...

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]: ...


def _power_summary(samples: list[dict[str, Any]], tokens: int) -> tuple[float | None, float | None]:
    """(mean board power W, J per token) over the samples; (None, None) without power."""
    got = [s["power"] for s in samples if s["power"] is not None]
    if len(got) != len(samples):
        return None, None
    mean_w = statistics.median(p["mean_power_w"] for p in got)
    j_per_token = statistics.median(p["energy_j"] / tokens for p in got)
    return mean_w, j_per_token


def _fmt(x: float | None, spec: str = ",.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _range(s: dict[str, float]) -> str:
    return f"{s['min']:,.1f}-{s['max']:,.1f}"


class PrefillSection:
    name = "prefill"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        rows = []
        for n in ctx.config.prompt_lens:
            if n + 1 > ctx.max_model_len:
                ctx.skip(self.name, n, "prompt + 1 token")
                continue
            rows.append(self._row(ctx, n))
        return {"rows": rows} if rows else None

    def _row(self, ctx: BenchContext, n: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def measure(run: int) -> dict[str, Any]:
            ids = ctx.random_prompt(0, n, run)
            ctx.reset_peak()
            synchronize(ctx.device)
            with ctx.power.measure() as pm:
                t0 = time.perf_counter()
                ctx.llm.generate([ids], params)
                synchronize(ctx.device)
                seconds = time.perf_counter() - t0
            return {
                "seconds": seconds,
                "tok_s": n / seconds,
                "gpu_peak_bytes": ctx.gpu_peak(),
                "power": pm.result(),
            }

        samples = ctx.repeat(measure)
        mean_w, j = _power_summary(samples, n)
        peaks = [s["gpu_peak_bytes"] for s in samples if s["gpu_peak_bytes"] is not None]
        return {
            "prompt_tokens": n,
            "tok_s": stats([s["tok_s"] for s in samples]),
            "seconds": stats([s["seconds"] for s in samples]),
            "mean_power_w": mean_w,
            "j_per_prompt_token": j,
            "gpu_peak_bytes": max(peaks) if peaks else None,
            "samples": samples,
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        out = []
        for r in data["rows"]:
            n = r["prompt_tokens"]
            out.append(
                Metric(f"prefill {n} tok/s", "tok/s", True, [s["tok_s"] for s in r["samples"]])
            )
            if r["j_per_prompt_token"] is not None:
                out.append(
                    Metric(
                        f"prefill {n} J/token",
                        "J/token",
                        False,
                        [s["power"]["energy_j"] / n for s in r["samples"]],
                    )
                )
        return out

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        head = [
            "prompt tokens",
            "tok/s (median)",
            "min-max",
            "time s",
            "board W",
            "J/prompt token",
            "GPU peak GiB",
        ]
        rows = [
            [
                f"{r['prompt_tokens']:,}",
                _fmt(r["tok_s"]["median"]),
                _range(r["tok_s"]),
                _fmt(r["seconds"]["median"], ".3f"),
                _fmt(r["mean_power_w"]),
                _fmt(r["j_per_prompt_token"], ".4f"),
                _fmt(None if r["gpu_peak_bytes"] is None else r["gpu_peak_bytes"] / 2**30, ".2f"),
            ]
            for r in data["rows"]
        ]
        return head, rows


def decode_params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    """A timed decode request's parameters: `max_tokens` tokens, no early end; greedy, or
    sampled at `temperature` with `seed` (the same draws on every engine)."""
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=seed if temperature > 0 else None,
    )


class DecodeSection:
    name = "decode"

    def run(self, ctx: BenchContext) -> dict[str, Any] | None:
        rows = []
        k = ctx.config.decode_tokens
        for depth in ctx.config.decode_depths:
            if max(depth, 1) + k + 2 > ctx.max_model_len:
                ctx.skip(self.name, depth, f"depth + {k + 2} tokens")
                continue
            rows.append(self._row(ctx, depth))
        return {"rows": rows} if rows else None

    def bytes_per_token(self, ctx: BenchContext, depth: int) -> float:
        mean_context = max(depth, 1) + ctx.config.decode_tokens / 2
        return ctx.weight_bytes_per_token + ctx.kv_bytes_per_token * mean_context

    def _row(self, ctx: BenchContext, depth: int) -> dict[str, Any]:
        k = ctx.config.decode_tokens

        def measure(run: int) -> dict[str, Any]:
            ids = ctx.random_prompt(1, max(depth, 1), run)
            ctx.reset_peak()
            # Two tokens more than measured: the prefill step's, then one decoded untimed. The
            # clock starts when that one arrives (no device sync: the step the engine queued
            # behind it is running), so the k timed tokens are k whole steps.
            stream = ctx.llm.stream(ids, decode_params(ctx.config.temperature, k + 2, run))
            n_first = 0
            while n_first < 2:
                n_first += len(next(stream).new_token_ids)
            n = 0
            with ctx.power.measure() as pm:
                t0 = time.perf_counter()
                for out in stream:
                    n += len(out.new_token_ids)
                synchronize(ctx.device)
                seconds = time.perf_counter() - t0
            if n + n_first != k + 2:
                raise RuntimeError(f"decode run produced {n + n_first} tokens, expected {k + 2}")
            return {
                "seconds": seconds,
                "tok_s": n / seconds,
                "tokens": n,
                "gpu_peak_bytes": ctx.gpu_peak(),
                "power": pm.result(),
            }

        samples = ctx.repeat(measure)
        mean_w, j = _power_summary(samples, k)
        peaks = [s["gpu_peak_bytes"] for s in samples if s["gpu_peak_bytes"] is not None]
        tok_s = stats([s["tok_s"] for s in samples])
        nbytes = self.bytes_per_token(ctx, depth)
        ceiling = None
        if ctx.copy_bandwidth_gbps is not None:
            ceiling = ctx.copy_bandwidth_gbps * 1e9 / nbytes
        return {
            "depth": depth,
            "decode_tokens": k,
            "tok_s": tok_s,
            "seconds": stats([s["seconds"] for s in samples]),
            "bytes_per_token": int(nbytes),
            "ceiling_tok_s": ceiling,
            "pct_of_ceiling": None if ceiling is None else 100.0 * tok_s["median"] / ceiling,
            "mean_power_w": mean_w,
            "j_per_generated_token": j,
            "gpu_peak_bytes": max(peaks) if peaks else None,
            "samples": samples,
        }

    def metrics(self, data: dict[str, Any]) -> list[Metric]:
        out = []
        for r in data["rows"]:
            d, k = r["depth"], r["decode_tokens"]
            out.append(
                Metric(f"decode @{d} tok/s", "tok/s", True, [s["tok_s"] for s in r["samples"]])
            )
            if r["j_per_generated_token"] is not None:
                out.append(
                    Metric(
                        f"decode @{d} J/token",
                        "J/token",
                        False,
                        [s["power"]["energy_j"] / k for s in r["samples"]],
                    )
                )
        return out

    def table(self, data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
        head = [
            "depth",
            "tok/s (median)",
            "min-max",
            "ceiling tok/s",
            "% of ceiling",
            "MB/token",
            "board W",
            "J/token",
            "GPU peak GiB",
        ]
        rows = [
            [
                f"{r['depth']:,}",
                _fmt(r["tok_s"]["median"]),
                _range(r["tok_s"]),
                _fmt(r["ceiling_tok_s"]),
                _fmt(r["pct_of_ceiling"]),
                _fmt(r["bytes_per_token"] / 1e6, ",.2f"),
                _fmt(r["mean_power_w"]),
                _fmt(r["j_per_generated_token"], ".4f"),
                _fmt(None if r["gpu_peak_bytes"] is None else r["gpu_peak_bytes"] / 2**30, ".2f"),
            ]
            for r in data["rows"]
        ]
        return head, rows


SECTIONS: tuple[Section, ...] = (
    PrefillSection(),
    DecodeSection(),
    ConcurrencySection(),
    SpecSection(),
    PrefixReuseSection(),
    VerifyCostSection(),
    ExpertsSection(),
)


def section_by_name(name: str, sections: Sequence[Section] = SECTIONS) -> Section | None:
    return next((s for s in sections if s.name == name), None)


def result_metrics(result: dict[str, Any], sections: Sequence[Section] = SECTIONS) -> list[Metric]:
    """Every comparable figure of a bench result, section by section."""
    out: list[Metric] = []
    for s in sections:
        if s.name in result:
            out.extend(s.metrics(result[s.name]))
    return out


def _model_facts(llm: Any) -> dict[str, Any]:
    from moestream.info import model_info

    info = model_info(llm.source.path)
    kv = llm.engine.kv
    kv_bytes = kv.bytes_per_block // kv.block_size
    return {
        "path": str(llm.source.path),
        "format": info["format"],
        "architecture": info["architecture"],
        "name": info["name"],
        "file_type": info["file_type"],
        "file_size": info["file_size"],
        "params_total": info["params_total"],
        "params_active": info["params_active"],
        "bytes_dense": info["bytes_dense"],
        "bytes_experts": info["bytes_experts"],
        "weight_bytes_per_token": info["bytes_per_token"],
        "kv_bytes_per_token": kv_bytes,
        "kv_dtype": str(kv.dtype).removeprefix("torch."),
        "max_model_len": llm.engine.max_model_len,
    }


def _host_peak_rss() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS, which moestream does not target).
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def section_markdown(section: Section, data: dict[str, Any]) -> list[str]:
    """A section's heading and table, as the report and the run's log show it."""
    return [f"## {section.name}", "", *md_table(*section.table(data))]


def run_bench(
    llm: Any,
    config: BenchConfig,
    *,
    engine_config: dict[str, Any] | None = None,
    measured_bandwidth_gbps: float | None = None,
    sections: Sequence[Section] = SECTIONS,
    argv: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every section on `llm` (a `moestream.LLM`) and return the result JSON (see the
    module docstring). `engine_config` is recorded as given (the CLI's engine flags). Without
    `config.copy_bandwidth_gbps`, the copy bandwidth is `measured_bandwidth_gbps` (measured by
    the caller before the model took the device's memory) or measured now. `log` hears each
    section's start and, when it ends, its table."""
    device = llm.device
    facts = _model_facts(llm)
    bandwidth, bw_source = config.copy_bandwidth_gbps, "given"
    if bandwidth is None:
        bw_source = "measured"
        bandwidth = measured_bandwidth_gbps or measure_copy_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    power = open_power_sampler(device)
    ctx = BenchContext(
        llm=llm,
        config=config,
        power=power,
        max_model_len=facts["max_model_len"],
        weight_bytes_per_token=facts["weight_bytes_per_token"],
        kv_bytes_per_token=facts["kv_bytes_per_token"],
        copy_bandwidth_gbps=bandwidth,
    )
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "run": run_info(argv),
        "machine": machine_info(device),
        "git": git_info(),
        "model": facts,
        "config": {
            **asdict(config),
            "prompt_token_ids": "uniform over the vocabulary, numpy default_rng((seed, section, "
            "length, run)); a fresh prompt per run",
            "engine": engine_config or {},
        },
        "copy_bandwidth": {
            "gbps": bandwidth,
            "source": bw_source,
            "counts": "bytes read + written",
        },
        "power": {"available": power.available, "reason": power.reason},
    }
    try:
        for s in sections:
            if log:
                log(f"bench: {s.name} ...")
            data = s.run(ctx)
            if data is not None:
                result[s.name] = data
                if log:  # as measured: a run cut short (a time limit) keeps what it printed
                    log("\n".join([*section_markdown(s, data), ""]))
    finally:
        power.close()
    if device.type == "cuda":
        ctx.gpu_peak()
    result["memory"] = {
        "gpu_peak_bytes": ctx.peak_gpu_bytes,
        "host_peak_rss_bytes": _host_peak_rss(),
    }
    result["skipped"] = ctx.skipped
    return result
