"""Draft-model proposer: a small LM that shares the target's tokenizer drafts k tokens greedily,
with its own paged KV cache and block allocator, in the same process as the target.

Per request the proposer keeps the draft-side block table, `num_computed` (positions whose draft
K/V match the request's tokens) and the drafts it fed after them. Drafting k tokens feeds d_0 ..
d_{k-2} too, so their K/V sit in the cache; at the next call the proposer compares them with
the tokens the request actually has (accepted drafts, then the target's token) and keeps the
matching prefix. Rejected positions are simply overwritten later: the rollback is the
assignment of `num_computed`. A call runs, for all requests together, a catch-up forward of
each request's unseen tokens (chunked when long; a new request's whole prompt) whose last
logits give d_0, then one single-token forward per further drafted position.

With `use_graphs` on a CUDA device, the single-token forwards (and a first forward of one token
per request, the steady state) replay the draft model's own decode graphs (`runner.cuda_graph`,
no verify graphs): eagerly, each forward of a small draft model is bound by the host issuing its
launches. Off by default: on the H200 it made forced drafting with the tiny pair 3.7-4.5x
faster, but in the same process the n-gram, draft and auto modes that ran after it measured
1.5-2x slower than before the change, cause not found (one round; bench/RESULTS.md).

Greedy drafts are deterministic, so `Proposal.probs` is None: `rejection_sample` verifies them
exactly at any temperature (q is one-hot). One host synchronisation per call (the drafts).
Letters: B requests, T fed tokens, V vocabulary, K most drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moestream.cache.block_allocator import BlockAllocator
from moestream.config import ModelConfig
from moestream.errors import CapacityError, ModelFormatError
from moestream.layers.attention import AttentionMetadata
from moestream.models.base import CausalLM
from moestream.runner.cuda_graph import DecodeGraphs, decode_graphs_for
from moestream.spec.base import Proposal, ProposalInput, Proposer


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # draft K/V of positions < num_computed match the request's tokens
    fed_drafts: list[int] = field(default_factory=list)  # at positions num_computed.. (unverified)


@dataclass
class _Row:
    inp: ProposalInput
    state: _DraftState
    k: int
    pending: list[int]  # tokens still to feed before drafting (at least the last one)


class DraftModelProposer(Proposer):
    """Greedy drafts from `model` over its own KV pool of `num_blocks` x `block_size` tokens.

    A request that cannot get draft KV blocks, or whose drafts would pass the draft model's
    context length, gets no proposal this step (speculation is optional; the target decodes).
    `max_prefill_tokens` bounds the tokens of one request fed in one catch-up forward.
    """

    name = "draft"
    costs_forward = True

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
        max_prefill_tokens: int = 1024,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        self.block_size = block_size
        self.kv = model.make_kv_cache(num_blocks, block_size, kv_dtype)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.max_prefill_tokens = max_prefill_tokens
        self._states: dict[str, _DraftState] = {}
        # Decode graphs over the draft pool, made at first use where the model can be captured
        # (`decode_graphs_for`) when `use_graphs` (module docstring: off until a measured
        # slowdown of the other modes is understood).
        self.use_graphs = False
        self._graphs: DecodeGraphs | None = None
        self._graphs_made = False
        self._warm = False  # `warm_up` ran on this pool

    @classmethod
    def from_file(
        cls,
        path: str,
        target_vocab_size: int,
        *,
        target_tokens: Sequence[str] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
    ) -> DraftModelProposer:
        """Load the draft model at `path` (`--draft-model`), checked against the target's
        vocabulary (see `check_compatible`) before its weights are built. `num_blocks`
        defaults to room for four sequences of the draft's full context."""
        from moestream.models.registry import build_model
        from moestream.weights.loader import open_model

        source = open_model(path)
        draft_tokens = source.metadata.get("tokenizer.ggml.tokens")
        cls.check_compatible(source.config, target_vocab_size, path, draft_tokens, target_tokens)
        model = build_model(source, device=device, dtype=dtype or torch.float32)
        if num_blocks is None:
            num_blocks = 4 * -(-model.config.context_length // block_size)
        return cls(model, num_blocks, block_size, device)

    @staticmethod
    def check_compatible(
        draft: ModelConfig,
        target_vocab_size: int,
        draft_path: str = "",
        draft_tokens: Sequence[str] | None = None,
        target_tokens: Sequence[str] | None = None,
    ) -> None:
        """ModelFormatError unless the draft shares the target's vocabulary: the same size,
        and the same token strings when both are known (GGUF `tokenizer.ggml.tokens`)."""
        where = draft_path or "draft model"
        if draft.vocab_size != target_vocab_size:
            raise ModelFormatError(
                f"{where}: vocabulary of {draft.vocab_size} tokens does not match the "
                f"target's {target_vocab_size} (they must share a tokenizer)"
            )
        if draft_tokens is not None and target_tokens is not None:
            for i, (a, b) in enumerate(zip(draft_tokens, target_tokens)):
                if a != b:
                    raise ModelFormatError(
                        f"{where}: token {i} is {a!r} but the target's is {b!r} "
                        "(they must share a tokenizer)"
                    )

    @property
    def num_requests(self) -> int:
        return len(self._states)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one draft KV block (all layers, K and V)."""
        return self.kv.bytes_per_block

    def resize_kv(self, num_blocks: int) -> None:
        """Replace the draft KV pool by one of `num_blocks` blocks (the engine sizes it with
        the target's pool, after the draft weights took their memory). Only while no request
        holds draft state."""
        if self._states:
            raise RuntimeError("resize_kv with requests holding draft KV blocks")
        dtype = self.kv.dtype
        self.kv = None  # free the old pool first
        self._graphs, self._graphs_made = None, False  # they read the old pool
        self._warm = False
        self.kv = self.model.make_kv_cache(num_blocks, self.block_size, dtype)
        self.allocator = BlockAllocator(num_blocks, self.block_size)

    def num_computed(self, request_id: str) -> int:
        """Positions of `request_id` whose draft K/V are known good (0 if unknown)."""
        st = self._states.get(request_id)
        return st.num_computed if st else 0

    def release(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None:
            self.allocator.free(reversed(st.block_ids))

    def request_ids(self) -> list[str]:
        return list(self._states)

    WARM_UP_ID = "\x00draft-warm-up"  # not an id the engine or the server gives a request

    def warm_up(self, num_drafts: int, prompt_tokens: int = 16) -> None:
        """Draft `num_drafts` tokens for made-up requests and drop them: one request of
        `prompt_tokens` tokens, then two of `prompt_tokens` + 1 and 2 * `prompt_tokens` + 9
        together. Their catch-up forwards and single-token forwards are the shapes of a
        request's first round and of every later one, at batch 1 and above, at lengths that
        are multiples of 16 and not (Triton specializes integer arguments on equalling 1 and
        on divisibility by 16). On a GPU this compiles the draft's kernels (and captures its
        decode graphs when `use_graphs`) before a request pays for it and before the picker
        times a draft forward: a first try that compiles costs seconds (3.25 s on the H200
        for the tiny pair). Shapes it misses (other batch sizes, long catch-ups) still compile
        in a request's round; the picker re-times a draft arm before trusting its first
        timing (`Picker._first_try`). Once per KV pool (`resize_kv` makes new graphs); leaves
        no state, every block back in the pool.
        """
        if self._warm:
            return
        vocab = self.model.config.vocab_size
        for lengths in ((prompt_tokens,), (prompt_tokens + 1, 2 * prompt_tokens + 9)):
            ids = [f"{self.WARM_UP_ID}{i}" for i in range(len(lengths))]
            try:
                self.propose(
                    [
                        ProposalInput(rid, [(i + 7 * j) % vocab for i in range(n)], [], num_drafts)
                        for j, (rid, n) in enumerate(zip(ids, lengths))
                    ]
                )
            finally:
                for rid in ids:
                    self.release(rid)
        self.last_forwards = 0
        self._warm = True

    # ---- proposing -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposalInput]) -> dict[str, Proposal]:
        self.last_forwards = 0
        rows = [r for r in (self._prepare(inp) for inp in inputs if inp.num_drafts > 0) if r]
        if not rows:
            return {}
        self.last_forwards = self._catch_up(rows)
        logits = self._forward([(r, r.pending) for r in rows], want_logits=True)  # [B, V]
        max_k = max(r.k for r in rows)
        self.last_forwards += max_k
        drafts = torch.full((len(rows), max_k), -1, dtype=torch.long, device=self.device)
        drafts[:, 0] = logits.argmax(dim=-1)
        for r in rows:
            r.state.num_computed = r.inp.num_tokens
            r.state.fed_drafts = []
        for j in range(1, max_k):
            active = [i for i, r in enumerate(rows) if r.k > j]
            idx = torch.tensor(active, dtype=torch.long, device=self.device)
            fed = drafts[idx, j - 1]  # [b]
            logits = self._forward_ids(
                fed, [(rows[i], rows[i].inp.num_tokens + j - 1) for i in active]
            )
            drafts[idx, j] = logits.argmax(dim=-1)
        host = drafts.tolist()  # the one host synchronisation
        out = {}
        for r, d in zip(rows, host):
            tokens = d[: r.k]
            r.state.fed_drafts = tokens[:-1]
            out[r.inp.request_id] = Proposal(tokens)
        return out

    def _prepare(self, inp: ProposalInput) -> _Row | None:
        """Sync the request's draft state with its tokens and reserve blocks; None to skip."""
        n = inp.num_tokens
        st = self._states.get(inp.request_id)
        if st is None or st.num_computed > n:
            self.release(inp.request_id)
            st = self._states[inp.request_id] = _DraftState()
        if st.fed_drafts:
            actual = inp.token_slice(st.num_computed, min(n, st.num_computed + len(st.fed_drafts)))
            keep = 0
            while keep < len(actual) and actual[keep] == st.fed_drafts[keep]:
                keep += 1
            st.num_computed += keep
            st.fed_drafts = []
        st.num_computed = min(st.num_computed, n - 1)  # the last token is fed for its logits
        k = min(inp.num_drafts, self.model.config.context_length - n + 1)
        if k < 1:
            return None
        need = self.allocator.blocks_needed(n + k - 1) - len(st.block_ids)
        if need > 0:
            try:
                st.block_ids += self.allocator.allocate(need)
            except CapacityError:
                return None
        return _Row(inp, st, k, inp.token_slice(st.num_computed, n))

    def _catch_up(self, rows: list[_Row]) -> int:
        """Feed all but the last `max_prefill_tokens` pending tokens of long requests; returns
        the forwards that took."""
        chunk = self.max_prefill_tokens
        forwards = 0
        while True:
            long_rows = [r for r in rows if len(r.pending) > chunk]
            if not long_rows:
                return forwards
            self._forward([(r, r.pending[:chunk]) for r in long_rows], want_logits=False)
            forwards += 1
            for r in long_rows:
                r.state.num_computed += chunk
                r.pending = r.pending[chunk:]

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The draft model's decode graphs over its pool, or None (eager: CPU, `use_graphs`
        off, a model that cannot be captured)."""
        if not self._graphs_made:
            self._graphs_made = True
            if self.use_graphs:
                self._graphs = decode_graphs_for(
                    self.model, self.kv, self.block_size, verify_buckets=(), verify_tokens=()
                )
        return self._graphs if self.use_graphs else None

    def _graph_decode(
        self, ids: Sequence[int] | torch.Tensor, rows: list[tuple[_Row, int]]
    ) -> torch.Tensor | None:
        """One token per row at the given positions through the decode graphs -> logits
        [b, V] (a view of the graphs' buffer, valid until their next run), or None when no
        graph holds the step."""
        graphs = self.graphs
        if graphs is None or not 0 < len(rows) <= graphs.max_batch:
            return None
        return graphs.run_decode(ids, [p for _, p in rows], [r.state.block_ids for r, _ in rows])

    def _forward(self, feeds: list[tuple[_Row, list[int]]], want_logits: bool) -> torch.Tensor:
        """Feed each row's tokens after its `num_computed`; logits [B, V] of each row's last."""
        if want_logits and all(len(toks) == 1 for _, toks in feeds):
            rows = [(r, r.state.num_computed) for r, _ in feeds]
            logits = self._graph_decode([toks[0] for _, toks in feeds], rows)
            if logits is not None:
                return logits
        tokens = [t for _, toks in feeds for t in toks]
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        seqs = [(r.state.num_computed, len(toks), r.state.block_ids) for r, toks in feeds]
        return self._run(ids, seqs, want_logits)

    def _forward_ids(self, ids: torch.Tensor, rows: list[tuple[_Row, int]]) -> torch.Tensor:
        """One token per row (ids [b] on the device) at the given positions -> logits [b, V]."""
        logits = self._graph_decode(ids, rows)
        if logits is not None:
            return logits
        return self._run(ids, [(pos, 1, r.state.block_ids) for r, pos in rows], True)

    def _run(
        self, ids: torch.Tensor, seqs: list[tuple[int, int, list[int]]], want_logits: bool
    ) -> torch.Tensor:
        positions = torch.tensor(
            [p for start, n, _ in seqs for p in range(start, start + n)],
            dtype=torch.long,
            device=self.device,
        )  # [T]
        attn = AttentionMetadata.build(seqs, self.block_size, self.device)
        hidden = self.model.forward(ids, positions, attn, self.kv)  # [T, H]
        if not want_logits:
            return hidden
        last = attn.query_start_loc[1:].long() - 1  # [B]
        return self.model.compute_logits(hidden.index_select(0, last))  # [B, V]
