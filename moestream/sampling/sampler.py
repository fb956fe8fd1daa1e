"""Batched sampling on the device: penalties, temperature, min-p, top-k, top-p, then a draw.

Order, as in vLLM v1: penalties -> greedy argmax -> temperature -> min-p -> top-k -> top-p ->
draw. (min-p and top-k commute; only top-p sees the others' renormalised distribution.)
Every step is a tensor op over the whole batch; a row whose feature is off is left unchanged.

Greedy rows (temperature < 1e-5, or top_k == 1 as `SamplingParams.greedy` says) take the argmax
of the penalised logits; ties go to the lowest token id.

Random rows draw with the exponential race: token = argmax(probs / E), E ~ Exponential(1) per
token, which picks token i with probability probs[i]. A row with a seed draws its E from its own
`torch.Generator`, seeded from (seed, step index within the request), so a seeded request gives
the same tokens alone or in any batch, and again after preemption. Unseeded rows share the
sampler's generator.

Host synchronisation: none on the device path. All branch decisions (any greedy row, largest
top-k, ...) are Python values computed by `SamplingBatch.from_params` from the parameters;
building the batch packs its per-row values into one host tensor per dtype and copies each
host -> device once (from pinned memory on CUDA). Seeded rows cost one generator and one noise
kernel each (a short Python loop over seeded rows; the math stays batched).

A batch whose every row is `argmax_only` (greedy, no penalty, no logprobs) needs no batch at
all: `Sampler.argmax` is the very op the greedy path runs on such rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from moestream.sampling.logprobs import LOGPROBS_MODES, LogprobsMode, gather_logprobs
from moestream.sampling.penalties import apply_penalties

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy (vLLM's _SAMPLING_EPS)
_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """Generator seed of a request seeded with `seed` at its `step`-th sampling step.

    A splitmix64 mix of the pair, so nearby seeds and steps give unrelated streams.
    """
    z = ((seed & _MASK64) + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: every torch generator accepts it


def _row_seed(params: Any, step: int) -> int | None:
    """A row's generator seed at its request's `step`-th sampling step (None: unseeded)."""
    return None if params.seed is None else step_seed(int(params.seed), int(step))


def argmax_only(params: Any) -> bool:
    """True when a row's token is the argmax of its logits and nothing else is asked of the
    sampler: greedy, no penalty, no logprobs (`SamplingParams`-like, attribute access)."""
    return (
        (params.temperature < GREEDY_TEMPERATURE or params.top_k == 1)
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`: one non-blocking copy from pinned memory on CUDA."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _int_tensor(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.int64, device="cpu").reshape(-1)


def _token_index(rows: list[int], token_lists: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each token, token id), flattened over `rows`, built on the host: int64 [n]."""
    parts = [_int_tensor(token_lists[i]) for i in rows]
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    lengths = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return row_ids, torch.cat(parts)


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Per-row sampling state of one step, as device tensors plus host-side flags.

    Rows are in the order of the logits. Greedy rows carry temperature 1 and no truncation
    (their parameters cannot change an argmax). Truncation "off" values: top_k 0, top_p 1,
    min_p 0. Output tokens are listed only for rows with a penalty, prompt tokens only for rows
    with a repetition penalty. The flags let the sampler skip work without reading the device.
    """

    device: torch.device
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    min_p: torch.Tensor  # [B] float32, 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1.0 = off
    presence_penalty: torch.Tensor  # [B] float32, 0.0 = off
    frequency_penalty: torch.Tensor  # [B] float32, 0.0 = off
    output_token_rows: torch.Tensor  # [n] int64
    output_token_ids: torch.Tensor  # [n] int64
    prompt_token_rows: torch.Tensor  # [m] int64
    prompt_token_ids: torch.Tensor  # [m] int64
    generator_seeds: tuple[int | None, ...]  # per row: step_seed(seed, step), None if unseeded
    num_logprobs: tuple[int | None, ...]  # per row: top logprobs asked for (None: none)
    # Host-side flags.
    all_greedy: bool
    any_greedy: bool
    any_penalties: bool
    any_repetition_penalty: bool
    max_top_k: int  # largest top-k of a random row, 0 if none
    any_top_p: bool
    any_min_p: bool
    max_token_id: int  # largest token id in the penalty lists, -1 if none

    @property
    def num_rows(self) -> int:
        return len(self.generator_seeds)

    @property
    def max_num_logprobs(self) -> int:
        """Largest top-logprobs count asked for by any row, 0 if none."""
        return max((n for n in self.num_logprobs if n), default=0)

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[Any],
        output_token_ids_list: Sequence[Sequence[int]],
        prompt_token_ids_list: Sequence[Sequence[int]],
        device: torch.device | str,
        step_seeds: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Build the batch from one `SamplingParams`-like object per row (attribute access only).

        Token lists are ints (lists, arrays or CPU tensors). `step_seeds[i]` is row i's step
        index within its request, mixed with the request's seed into its generator seed;
        None means `len(output_token_ids_list[i])` (the number of tokens sampled so far).
        """
        n = len(params_list)
        if len(output_token_ids_list) != n or len(prompt_token_ids_list) != n:
            raise ValueError("params, output and prompt token lists must have one entry per row")
        if step_seeds is not None and len(step_seeds) != n:
            raise ValueError("step_seeds must have one entry per row")
        device = torch.device(device)
        greedy, temp, top_k, top_p, min_p, rep, pres, freq = ([] for _ in range(8))
        seeds: list[int | None] = []
        for i, p in enumerate(params_list):
            is_greedy = p.temperature < GREEDY_TEMPERATURE or p.top_k == 1
            greedy.append(is_greedy)
            temp.append(1.0 if is_greedy else float(p.temperature))
            top_k.append(0 if is_greedy or p.top_k < 0 else int(p.top_k))
            top_p.append(1.0 if is_greedy else float(p.top_p))
            min_p.append(0.0 if is_greedy else float(p.min_p))
            rep.append(float(p.repetition_penalty))
            pres.append(float(p.presence_penalty))
            freq.append(float(p.frequency_penalty))
            step = len(output_token_ids_list[i]) if step_seeds is None else int(step_seeds[i])
            seeds.append(_row_seed(p, step))
        penalised = [i for i in range(n) if rep[i] != 1.0 or pres[i] != 0.0 or freq[i] != 0.0]
        repeating = [i for i in range(n) if rep[i] != 1.0]
        out_rows, out_ids = _token_index(penalised, output_token_ids_list)
        prompt_rows, prompt_ids = _token_index(repeating, prompt_token_ids_list)
        all_ids = torch.cat([out_ids, prompt_ids])
        if all_ids.numel() and int(all_ids.min()) < 0:
            raise ValueError("token ids for penalties must be >= 0")

        floats = _to_device(
            torch.tensor([temp, top_p, min_p, rep, pres, freq], dtype=torch.float32), device
        )  # [6, B]
        ints = _to_device(torch.tensor([top_k, greedy], dtype=torch.int64), device)  # [2, B]
        index = torch.cat([out_rows, out_ids, prompt_rows, prompt_ids])  # [2n + 2m]
        index = _to_device(index, device) if index.numel() else index.to(device)
        n_out, n_prompt = out_ids.numel(), prompt_ids.numel()
        return cls(
            device=device,
            greedy=ints[1] != 0,
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            output_token_rows=index[:n_out],
            output_token_ids=index[n_out : 2 * n_out],
            prompt_token_rows=index[2 * n_out : 2 * n_out + n_prompt],
            prompt_token_ids=index[2 * n_out + n_prompt :],
            generator_seeds=tuple(seeds),
            num_logprobs=tuple(p.logprobs for p in params_list),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_penalties=bool(penalised),
            any_repetition_penalty=bool(repeating),
            max_top_k=max(top_k, default=0),
            any_top_p=any(x < 1.0 for x in top_p),
            any_min_p=any(x > 0.0 for x in min_p),
            max_token_id=int(all_ids.max()) if all_ids.numel() else -1,
        )

    def reseeded(self, params_list: Sequence[Any], step_seeds: Sequence[int]) -> SamplingBatch:
        """This batch for the same rows (`params_list`: the parameters it was built from, no
        penalties) at other step indices: only the generator seeds change."""
        if self.any_penalties:
            raise ValueError("a batch with penalties depends on the output: build it anew")
        seeds = tuple(_row_seed(p, step) for p, step in zip(params_list, step_seeds, strict=True))
        return self if seeds == self.generator_seeds else replace(self, generator_seeds=seeds)

    def repeat_rows(self, repeats: int) -> SamplingBatch:
        """Each row repeated `repeats` times in place (row i -> rows i*r .. i*r+r-1).

        Used to process the k+1 verify positions of a speculative step as rows.
        """
        r = repeats

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(r)

        def rows(t: torch.Tensor) -> torch.Tensor:
            offsets = torch.arange(r, device=t.device)
            return (t.unsqueeze(1) * r + offsets).reshape(-1)

        return replace(
            self,
            greedy=rep(self.greedy),
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            repetition_penalty=rep(self.repetition_penalty),
            presence_penalty=rep(self.presence_penalty),
            frequency_penalty=rep(self.frequency_penalty),
            output_token_rows=rows(self.output_token_rows),
            output_token_ids=rep(self.output_token_ids),
            prompt_token_rows=rows(self.prompt_token_rows),
            prompt_token_ids=rep(self.prompt_token_ids),
            generator_seeds=tuple(s for s in self.generator_seeds for _ in range(r)),
            num_logprobs=tuple(x for x in self.num_logprobs for _ in range(r)),
        )


def check_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` [B, V] as float32, after checking it against the batch."""
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {batch.num_rows} rows")
    if batch.max_token_id >= logits.shape[1]:
        raise ValueError(f"token id {batch.max_token_id} >= vocabulary {logits.shape[1]}")
    return logits.to(torch.float32)


def apply_temperature(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return logits / batch.temperature.unsqueeze(1)  # greedy rows divide by 1: unchanged


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest.

    p_i < m * p_max  <=>  logit_i < logit_max + log(m), so no softmax is needed; m = 0 keeps all.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # [B, 1]
    return logits.masked_fill(logits < threshold, -math.inf)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int, any_top_p: bool
) -> torch.Tensor:
    """vLLM semantics: top-k keeps tokens >= the k-th largest logit (ties kept); top-p keeps
    the smallest set of most likely tokens whose mass reaches p (at least one). Rows with
    top_k 0 and top_p 1 are unchanged."""
    vocab = logits.shape[-1]
    if not any_top_p:
        if max_top_k <= 0:
            return logits
        kk = min(max_top_k, vocab)
        best = logits.topk(kk, dim=-1).values  # [B, kk], descending
        k = top_k.clamp(1, kk)
        kth = best.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        kth = kth.masked_fill((top_k <= 0).unsqueeze(1), -math.inf)
        return logits.masked_fill(logits < kth, -math.inf)
    ascending, order = logits.sort(dim=-1)  # [B, V]
    if max_top_k > 0:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = ascending.gather(1, (vocab - k).unsqueeze(1))  # [B, 1]
        ascending = ascending.masked_fill(ascending < kth, -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    drop &= (top_p < 1).unsqueeze(1)
    ascending = ascending.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on penalised logits [B, V]: the sampling logits."""
    logits = apply_temperature(logits, batch)
    if batch.any_min_p:
        logits = apply_min_p(logits, batch.min_p)
    return apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k, batch.any_top_p)


def row_generators(batch: SamplingBatch, device: torch.device) -> list[torch.Generator | None]:
    """A fresh generator per seeded row (seeded from (seed, step)), None for unseeded rows."""
    gens: list[torch.Generator | None] = []
    for s in batch.generator_seeds:
        if s is None:
            gens.append(None)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(s)
            gens.append(g)
    return gens


def fill_per_row(
    out: torch.Tensor,
    gens: list[torch.Generator | None],
    generator: torch.Generator | None,
    draw: str,
) -> torch.Tensor:
    """Fill `out` [B, ...] in place with `draw` ("exponential_" or "uniform_") draws: seeded
    rows from their own generator, the rest from `generator`. Returns `out`."""
    if any(g is None for g in gens):
        getattr(out, draw)(generator=generator)
    for i, g in enumerate(gens):
        if g is not None:
            getattr(out[i], draw)(generator=g)
    return out


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) over the last dim: a draw from probs (unnormalised is fine)."""
    # exponential_ may return exactly 0 in float32; probs / 0 would be inf or nan.
    tiny = torch.finfo(noise.dtype).tiny
    return (probs / noise.clamp_min(tiny)).argmax(dim=-1)


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, per the sampler's logprobs_mode
    ranks: torch.Tensor | None  # [B] int64, 1 = the most likely token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # ([B, K] f32, [B, K] i64)


class Sampler:
    """Samples one token per row. Keeps only its generator for unseeded rows (per device).

    `seed` fixes that generator (tests, reproducible runs); None seeds it from the OS.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw", seed: int | None = None) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode}")
        self.logprobs_mode = logprobs_mode
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator that unseeded rows on `device` draw from."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [B] int64 of `logits` [B, V] for rows that are all `argmax_only`: exactly
        what `sample` returns for them (the argmax of the float32 logits; ties go to the lowest
        token id), without building a `SamplingBatch`."""
        if logits.dim() != 2:
            raise ValueError(f"logits {tuple(logits.shape)} are not [rows, vocabulary]")
        return logits.to(torch.float32).argmax(dim=-1)

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, logprobs: bool = True
    ) -> SamplerOutput:
        """One token per row of `logits` [B, V] (float32; other float types are upcast).

        `logprobs` False skips the logprobs (`SamplerOutput.logprobs` and `ranks` are None):
        no row asked for them."""
        raw = check_logits(logits, batch)
        penalised = apply_penalties(raw, batch) if batch.any_penalties else raw
        greedy_ids = penalised.argmax(dim=-1) if batch.any_greedy else None  # [B]
        processed = penalised
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            processed = process_logits(penalised, batch)
            probs = processed.softmax(dim=-1)  # [B, V]
            gens = row_generators(batch, raw.device)
            noise = fill_per_row(
                torch.empty_like(probs), gens, self.generator(raw.device), "exponential_"
            )
            token_ids = exponential_race(probs, noise)
            if greedy_ids is not None:
                token_ids = torch.where(batch.greedy, greedy_ids, token_ids)
        # Greedy rows have temperature 1 and no truncation: their processed rows are penalised.
        if not logprobs:
            return SamplerOutput(token_ids, None, None, None)
        source = {"raw": raw, "penalized": penalised, "processed": processed}[self.logprobs_mode]
        lp = gather_logprobs(source, token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids, lp.logprobs, lp.ranks, lp.top_logprobs)
