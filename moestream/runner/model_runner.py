"""StepPlan -> tensors -> logits -> sampled tokens.

The runner is the only place where a plan becomes tensors. It follows `StepPlan`'s contract
(moestream/types.py): every scheduled request's tokens are flattened into one batch, their K/V go
to the slots their block tables give, and the rows that end a request's known tokens are sampled.

Host time per step is kept small (bench/host_overhead.py measures it): a plan reaches the
device in one copy (`runner/inputs.py`; the decode graphs' own staging buffer), rows that are
greedy and ask for nothing else take one argmax, and the sampled ids come back in one read.

Speculative decoding rides the same forward pass: a request with k drafts feeds its last token
and the drafts, and gets k + 1 logits rows instead of one; `sample_with_drafts` verifies them
(`spec.verify`) next to the plain decodes of the same step. K/V of rejected drafts stay in the
pool past the request's `num_computed_tokens`; nothing reads them (a query at position p reads
positions 0..p, all written by this or earlier steps) and the next step overwrites them.
A step of decodes and verifications runs as a CUDA graph where one holds it
(runner/cuda_graph.py: a decode graph without drafts, a verify graph with), a step of one
request's prompt chunk as a prefill graph (runner/prefill_graph.py), others eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moestream.cache.kv_cache import PagedKVCache
from moestream.models.base import CausalLM
from moestream.runner.cuda_graph import decode_graphs_for
from moestream.runner.inputs import StepInputs, build_step_inputs
from moestream.runner.prefill_graph import prefill_graphs_for
from moestream.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, argmax_only
from moestream.spec.verify import verify_drafts
from moestream.types import ScheduledRequest, StepPlan


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class LogitsProcessor(Protocol):
    """Changes sampling logits per request (constrained output, logit bias); see
    `server.constrained.LogitsProcessor` for the full contract. A processor should also answer
    `request_id in processor` (True when it changes that request's logits): the engine does
    not speculate for those requests (a grammar matcher cannot take drafts it may refuse), and
    without the answer it speculates for none while the processor holds any request."""

    def apply(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor: ...


class HostReader:
    """Reads a step's sampled token ids back to the host: on CUDA one non-blocking copy into a
    pinned buffer and one wait on an event recorded after it (no pageable staging); elsewhere
    `tolist`. The buffer is reused: a result must be read before the next `read`.

    The wait spins (CUDA's default where the process has fewer contexts than cores) unless
    `set_blocking(True)`: then the thread sleeps until the event, leaving its core to others.
    That matters beside host-computed experts (`experts.host_compute`), whose threads fill the
    cores during the step: one more spinning thread stalls a full OpenMP team now and then (on
    the development CPU, a busy process beside a team of 2 on 2 cores made the mean call of 2
    experts 3.6 ms against 0.45 alone, its median 0.51 against 0.43: `bench/native_experts.py
    --spinners 0,1`, bench/RESULTS.md, sixteenth session)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._pending = torch.empty(0, dtype=torch.int64)
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        self.blocking = False

    def set_blocking(self, blocking: bool) -> None:
        """Sleep (True) or spin (False) while waiting for a step's tokens. A read started
        before (a step queued ahead) stays valid: the new event is recorded now, after its
        copy."""
        self.blocking = blocking
        if self._done is not None:
            done = torch.cuda.Event(blocking=blocking)
            done.record(torch.cuda.current_stream(self.device))
            self._done = done

    def read(self, token_ids: torch.Tensor) -> list[int]:
        """`token_ids` [N] int64 (on the reader's device) as a list of ints."""
        self.start(token_ids)
        return self.finish()

    def start(self, token_ids: torch.Tensor) -> None:
        """Queue the copy of `token_ids` [N] int64 to the host; `finish` waits for it. Work
        queued in between runs on the device while the host waits."""
        if self._done is None:
            self._pending = token_ids
            return
        n = token_ids.shape[0]
        if self._buffer is None or self._buffer.shape[0] < n:
            self._buffer = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
        self._pending = self._buffer[:n]
        self._pending.copy_(token_ids, non_blocking=True)
        self._done.record(torch.cuda.current_stream(self.device))

    def finish(self) -> list[int]:
        """The ids of the last `start` as a list of ints (waits for their copy)."""
        if self._done is not None:
            self._done.synchronize()
        return self._pending.tolist()


@dataclass
class RunAhead:
    """A decode step queued on the device before the host had read the tokens it feeds (the
    previous step's argmax, copied on the device): what it was launched with, to be matched
    against the step the scheduler then plans."""

    request_ids: list[str]
    positions: list[int]  # each request's fed position
    slots: list[int]  # the KV slot of that position
    logits: torch.Tensor  # [B, V], valid once the stream reaches it
    tokens: list[int] = field(default_factory=list)  # the fed tokens, once read back

    def matches(self, reqs: Sequence[ScheduledRequest], block_size: int) -> bool:
        """Whether `reqs` is exactly the step this one ran: same requests in the same order,
        same tokens, positions and KV slots."""
        if len(reqs) != len(self.request_ids):
            return False
        for i, s in enumerate(reqs):
            p = s.start_pos
            if (
                s.request_id != self.request_ids[i]
                or p != self.positions[i]
                or s.token_ids[0] != self.tokens[i]
                or s.block_ids[p // block_size] * block_size + p % block_size != self.slots[i]
            ):
                return False
        return True


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        block_size: int,
        device: torch.device,
        enforce_eager: bool = False,
        prefill_graph_tokens: int = 0,
    ):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # (parameter objects, batch) of the last penalty-free `_sampling_batch`
        self._last_batch: tuple[list[object], SamplingBatch] | None = None
        self.reader = HostReader(device)
        self.logits_processor: LogitsProcessor | None = None
        # Decode and verify steps as CUDA graphs (runner/cuda_graph.py); None: always eager.
        self.graphs = None if enforce_eager else decode_graphs_for(model, kv, block_size)
        # One-request prefill chunks of up to `prefill_graph_tokens` tokens as CUDA graphs in
        # the decode graphs' pool (runner/prefill_graph.py); None: eager.
        self.prefill_graphs = None
        if self.graphs is not None and prefill_graph_tokens > 1:
            self.prefill_graphs = prefill_graphs_for(
                model, kv, block_size, prefill_graph_tokens, self.graphs.backend
            )
        # (bucket, tokens per sequence) of the graph the last `execute` replayed; None: eager.
        self.last_step_graph: tuple[int, int] | None = None
        # Run-ahead of greedy decode steps (`_decode_ahead`): whether a plain decode step queues
        # the next one; the engine turns it off while the next step may carry drafts (a draft
        # model's forwards and the verifier's reads would queue behind a step it drops). A step
        # already queued is used whenever the plan is that step, whatever the flag says now.
        self.run_ahead = True
        self._ahead: RunAhead | None = None
        self.run_ahead_hits = 0  # steps whose forward was already queued when planned
        self.run_ahead_dropped = 0  # queued steps that the next plan did not match
        # Called after each step's results are on the host, before they are returned: a check
        # that raises fails the step (the host experts' poller: `HostCompute.check`).
        self.checks: list[Callable[[], None]] = []
        # Called with each non-empty plan before its forward is queued (the expert store's
        # counters take the step's phase from it).
        self.before_forward: list[Callable[[StepPlan], None]] = []

    @property
    def has_queued_step(self) -> bool:
        """Whether a plain decode step is queued ahead (`_decode_ahead`) for the next plan."""
        return self._ahead is not None

    @property
    def num_captured_graphs(self) -> int:
        """CUDA graphs captured so far (decode, verify, prefill): a step that raised it paid a
        capture (and its kernels' compilation) and is not a measure of a step's cost."""
        n = self.graphs.num_captured if self.graphs is not None else 0
        return n + (self.prefill_graphs.num_captured if self.prefill_graphs is not None else 0)

    def drop_graphs(self) -> None:
        """Forget every captured graph, decode, verify and prefill; later steps capture anew
        (after a change the graphs hold as nodes: `HostCompute.set_poll`). The caller has
        synchronised the device and no step is queued ahead."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.drop()

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Flatten the plan's requests into one batch (StepPlan's runner contract)."""
        return build_step_inputs(plan, self.block_size, self.device)

    def _graph_step(self, reqs: list[ScheduledRequest]) -> tuple[int, int] | None:
        """The graph (bucket, tokens per sequence) that can run this step, or None: every
        request feeds its one last token plus its drafts and is sampled, and a decode graph
        (no drafts) or a verify graph (K >= the most drafts + 1) holds them."""
        graphs = self.graphs
        if graphs is None or not all(s.sample and len(s.token_ids) == 1 for s in reqs):
            return None
        return graphs.graph_for(len(reqs), max(len(s.draft_token_ids) for s in reqs) + 1)

    def _prefill_graph_step(self, reqs: list[ScheduledRequest]) -> bool:
        """Whether a prefill graph runs this step: one request feeding a chunk of more than one
        token, no drafts, that a bucket holds."""
        graphs = self.prefill_graphs
        if graphs is None or len(reqs) != 1 or reqs[0].draft_token_ids:
            return False
        return graphs.bucket_for(len(reqs[0].token_ids)) is not None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one step: forward over every fed token, then one sampled token per request whose
        fed tokens reach its end (after its accepted drafts, for a request with drafts)."""
        self.last_step_graph = None
        ahead, self._ahead = self._ahead, None  # good for this step only
        hits = self.run_ahead_hits
        try:
            out = self._execute(plan, ahead)
            for check in self.checks:
                check()
            return out
        finally:
            if ahead is not None and self.run_ahead_hits == hits:
                self.run_ahead_dropped += 1  # its device time was spent for nothing

    def _execute(self, plan: StepPlan, ahead: RunAhead | None) -> RunnerOutput:
        if plan.is_empty:
            return RunnerOutput()
        for hook in self.before_forward:
            hook(plan)
        reqs = plan.scheduled
        graph = self._graph_step(reqs)
        if graph is not None and self.graphs is not None:
            self.last_step_graph = graph
            if graph[1] == 1 and (self.run_ahead or ahead is not None) and self._aheadable(reqs):
                return self._decode_ahead(reqs, ahead)
            tokens = [s.token_ids[0] for s in reqs]
            starts = [s.start_pos for s in reqs]
            blocks = [s.block_ids for s in reqs]
            if graph[1] == 1:
                logits = self.graphs.run_decode(tokens, starts, blocks)  # [B, V] float32
                return self.sample(logits, reqs)
            drafts = [s.draft_token_ids for s in reqs]
            logits = self.graphs.run_verify(tokens, drafts, starts, blocks)  # [R, V] float32
            return self.sample_with_drafts(logits, reqs)
        if self._prefill_graph_step(reqs):
            s = reqs[0]
            assert self.prefill_graphs is not None
            logits = self.prefill_graphs.run(s.token_ids, s.start_pos, s.block_ids)  # [1, V]
            return self.sample(logits, reqs) if s.sample else RunnerOutput()
        batch = self.prepare(plan)
        hidden = self.model.forward(batch.input_ids, batch.positions, batch.attn, self.kv)  # [T, H]
        if not batch.sampled:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [R, V]
        if batch.has_drafts:
            return self.sample_with_drafts(logits, batch.sampled)
        return self.sample(logits, batch.sampled)

    # ---- run-ahead ---------------------------------------------------------------------
    # A decode step's tokens are known on the device before the host reads them (the argmax, or
    # the sampler's draw: no host synchronisation), and the next step's positions, slots and
    # tables before the host plans it. So after queueing step n's sampling and its read-back,
    # the runner queues step n + 1's forward as well, fed by those tokens on the device, and
    # only then waits for step n's tokens: the host commits, plans and detokenizes while the
    # device runs step n + 1, instead of the device waiting for the host. Only the forward runs
    # ahead: step n + 1 is sampled when it is executed, from the parameters and histories its
    # plan then gives, so a seeded request draws what it would have drawn without run-ahead,
    # and a dropped step consumed no draw.
    # When the plan for n + 1 is the step that was queued (same requests, tokens and slots), its
    # logits are used; otherwise they are dropped and the planned step runs. A dropped step
    # only wrote K/V at positions past what its requests have committed, in their own
    # unshared last blocks: the step that feeds those positions rewrites them before anything
    # reads them (or the blocks were freed, and their next owner writes before it reads).

    def _aheadable(self, reqs: list[ScheduledRequest]) -> bool:
        """Whether a decode step of `reqs` may be queued ahead, and a queued one used: each
        row's token comes from the device alone (no logits processor, which works on the
        host) and the step reads nothing else back (no logprobs: reading them would wait for
        the step queued behind)."""
        return self.logits_processor is None and all(
            s.sampling_params.logprobs is None for s in reqs
        )

    def _decode_ahead(self, reqs: list[ScheduledRequest], ahead: RunAhead | None) -> RunnerOutput:
        """A graph decode step of `_aheadable` requests, using `ahead` when it is this step,
        and (with `run_ahead`) queueing the next step before reading this one's tokens."""
        graphs = self.graphs
        assert graphs is not None
        if ahead is not None and ahead.matches(reqs, self.block_size):
            logits = ahead.logits
            self.run_ahead_hits += 1
        else:
            tokens = [s.token_ids[0] for s in reqs]
            starts = [s.start_pos for s in reqs]
            logits = graphs.run_decode(tokens, starts, [s.block_ids for s in reqs])  # [B, V]
        token_ids = self._draw(logits, reqs).token_ids  # [B] on the device
        self.reader.start(token_ids)
        self._ahead = self._launch_next(reqs, token_ids) if self.run_ahead else None
        sampled = self.reader.finish()
        if self._ahead is not None:
            self._ahead.tokens = sampled
        return RunnerOutput(sampled={s.request_id: [t] for s, t in zip(reqs, sampled)})

    def _launch_next(
        self, reqs: list[ScheduledRequest], token_ids: torch.Tensor
    ) -> RunAhead | None:
        """Queue the decode step that follows `reqs` if it needs no new KV block and some
        request may still be running after this step (max_tokens not reached by all)."""
        bs = self.block_size
        positions = [s.start_pos + 1 for s in reqs]
        if any(p >= len(s.block_ids) * bs for s, p in zip(reqs, positions)):
            return None
        if all(len(s.output_token_ids) + 1 >= s.sampling_params.max_tokens for s in reqs):
            return None
        assert self.graphs is not None
        blocks = [s.block_ids for s in reqs]
        logits = self.graphs.run_decode(token_ids, positions, blocks)
        slots = [b[p // bs] * bs + p % bs for b, p in zip(blocks, positions)]
        return RunAhead([s.request_id for s in reqs], positions, slots, logits)

    def _sampling_batch(self, reqs: list[ScheduledRequest]) -> SamplingBatch:
        """The requests' sampling parameters and histories as device tensors.

        Building one costs ~0.2 ms of host time on a GPU (tens of small torch ops and three
        host -> device copies), as much as a small model's whole decode step. Without
        penalties a batch depends on the rows' parameters alone, but for the seeds' step
        indices: so when the same parameter objects come in the same order as at the last
        call, that batch is reused with the new step seeds (`SamplingBatch.reseeded`)."""
        params = [s.sampling_params for s in reqs]
        steps = [len(s.output_token_ids) for s in reqs]
        last = self._last_batch
        if (
            last is not None
            and len(last[0]) == len(params)
            and all(a is b for a, b in zip(last[0], params))
        ):
            return last[1].reseeded(params, steps)
        batch = SamplingBatch.from_params(
            params,
            [s.output_token_ids for s in reqs],
            [s.prompt_token_ids for s in reqs],
            self.device,
            steps,
        )
        # the parameter objects are kept (alive, so that `is` cannot match a newer object)
        self._last_batch = None if batch.any_penalties else (params, batch)
        return batch

    def _draw(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> SamplerOutput:
        """Each row's token on the device (no host synchronisation), with logprobs when a row
        asks for them. Rows that need only an argmax (greedy, no penalties, no logprobs:
        `argmax_only`) take it alone, the same op the sampler's greedy path runs."""
        if all(argmax_only(s.sampling_params) for s in reqs):
            return SamplerOutput(self.sampler.argmax(logits), None, None, None)
        batch = self._sampling_batch(reqs)
        logprobs = any(s.sampling_params.logprobs is not None for s in reqs)
        return self.sampler.sample(logits, batch, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> RunnerOutput:
        """One token per row of `logits` [B, V] for `reqs` (in order), with logprobs if asked:
        `_draw`'s tokens, read back once."""
        if self.logits_processor is not None:
            logits = self.logits_processor.apply(
                logits, [s.request_id for s in reqs], [s.output_token_ids for s in reqs]
            )
        result = self._draw(logits, reqs)
        token_ids = self.reader.read(result.token_ids)  # the step's one host synchronisation
        want = [s.sampling_params.logprobs is not None for s in reqs]
        out = RunnerOutput()
        lp: list[float] = []
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if result.logprobs is not None:
            lp = result.logprobs.tolist()
            if result.top_logprobs is not None:
                top_values, top_ids = (t.tolist() for t in result.top_logprobs)
        for i, s in enumerate(reqs):
            out.sampled[s.request_id] = [token_ids[i]]
            if want[i]:
                k = s.sampling_params.logprobs or 0
                alts = list(zip(top_ids[i][:k], top_values[i][:k])) if k and top_ids else []
                out.logprobs[s.request_id] = [TokenLogprobs(token_ids[i], lp[i], alts)]
        return out

    # ---- speculative decoding ------------------------------------------------------------
    def sample_with_drafts(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest]
    ) -> RunnerOutput:
        """Tokens for `reqs` from `logits` [R, V] (k + 1 rows per request, in order): plain
        decodes are sampled as by `sample`, requests with drafts are verified together.

        When every row needs only an argmax (`argmax_only`, no logits processor), the argmax
        of all R rows is read back at once and drafts are accepted on the host while they
        equal it: what `rejection_sample`'s greedy rows do, without its launches and its second
        synchronisation (on a small model a verify step is otherwise several plain steps)."""
        if self.logits_processor is None and all(argmax_only(s.sampling_params) for s in reqs):
            best = self.reader.read(self.sampler.argmax(logits))  # [R] -> host
            out = RunnerOutput()
            row = 0
            for s in reqs:
                drafts = s.draft_token_ids
                a = 0
                while a < len(drafts) and drafts[a] == best[row + a]:
                    a += 1
                out.sampled[s.request_id] = best[row : row + a + 1]
                row += len(drafts) + 1
            return out
        plain_rows: list[int] = []
        draft_rows: list[int] = []
        plain, verifying = [], []
        row = 0
        for s in reqs:
            k = len(s.draft_token_ids)
            (draft_rows if k else plain_rows).extend(range(row, row + k + 1))
            (verifying if k else plain).append(s)
            row += k + 1
        out = RunnerOutput()
        if plain:
            out = self.sample(logits[plain_rows], plain)
        verified = self.verify(logits[draft_rows], verifying)
        out.sampled.update(verified.sampled)
        out.logprobs.update(verified.logprobs)
        return out

    def verify(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> RunnerOutput:
        """Accepted drafts plus one token per request of `reqs`, from `logits` [R, V] (its last
        fed token's row, then one per draft). A logits processor sees each row with the output
        extended by the drafts before that position."""
        if self.logits_processor is not None:
            ids, history = [], []
            for s in reqs:
                for j in range(len(s.draft_token_ids) + 1):
                    ids.append(s.request_id)
                    history.append(list(s.output_token_ids) + s.draft_token_ids[:j])
            logits = self.logits_processor.apply(logits, ids, history)
        batch = self._sampling_batch(reqs)
        result = verify_drafts(
            logits,
            [s.draft_token_ids for s in reqs],
            batch,
            generator=self.sampler.generator(self.device),
            logprobs_mode=self.sampler.logprobs_mode,
        )
        token_ids = result.token_ids.tolist()  # the verification's one host synchronisation
        accepted = result.num_accepted.tolist()
        width = len(token_ids[0])
        lp: list[float] = []
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if result.logprobs is not None:
            lp = result.logprobs.logprobs.tolist()
            if result.logprobs.top_logprobs is not None:
                top_values, top_ids = (t.tolist() for t in result.logprobs.top_logprobs)
        out = RunnerOutput()
        for b, s in enumerate(reqs):
            emitted = token_ids[b][: accepted[b] + 1]
            out.sampled[s.request_id] = emitted
            n_top = s.sampling_params.logprobs
            if n_top is None:
                continue
            lps = []
            for j, t in enumerate(emitted):
                r = b * width + j
                alts = list(zip(top_ids[r][:n_top], top_values[r][:n_top])) if n_top else []
                lps.append(TokenLogprobs(t, lp[r], alts))
            out.logprobs[s.request_id] = lps
        return out
