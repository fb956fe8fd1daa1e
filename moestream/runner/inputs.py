"""A step plan as model inputs: flattened with numpy, sent to the device in one copy.

`build_step_inputs` turns a `StepPlan` into the eager forward's inputs (token ids, positions,
attention metadata, the rows to sample). Every integer array of a step is packed into one host
buffer and reaches the device in one copy (from pinned memory, non-blocking, on CUDA); on the
CPU the tensors are views of the numpy arrays. Per-step host work is a few numpy operations
over the batch plus one Python pass over the requests, not one `torch.tensor` per field.

Letters: T fed tokens, B sequences, R sampled rows, nb block-table columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moestream.layers.attention import AttentionMetadata
from moestream.types import ScheduledRequest, StepPlan


@dataclass
class StepInputs:
    """A plan flattened: the model inputs and which rows are sampled."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    # Rows of the flattened batch whose logits are needed: per entry of `sampled`, its last fed
    # token's row preceded by one row per draft (k + 1 rows in all; 1 without drafts).
    sample_rows: torch.Tensor  # [R] int64
    sampled: list[ScheduledRequest]

    @property
    def has_drafts(self) -> bool:
        return any(s.draft_token_ids for s in self.sampled)


def pack(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """`arrays` (contiguous numpy integer arrays) laid end to end in one uint8 buffer, each at
    an offset aligned to 8 bytes: (buffer, offsets)."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // 8) * 8
    packed = np.empty(max(end, 8), dtype=np.uint8)
    for a, off in zip(arrays, offsets, strict=True):
        packed[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
    return packed, offsets


def unpack(
    buffer: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Views of `buffer` (uint8, a copy of `pack(arrays)`'s) with the arrays' dtypes and
    shapes."""
    out = []
    for a, off in zip(arrays, offsets, strict=True):
        dtype = torch.from_numpy(a[:0]).dtype
        out.append(buffer[off : off + a.nbytes].view(dtype).view(a.shape))
    return out


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`arrays` (contiguous numpy integer arrays) as tensors on `device`, same dtypes and
    shapes. CPU: zero-copy views. Elsewhere: packed into one pinned host buffer and sent with
    one non-blocking copy; torch's caching host allocator holds the pinned block until that
    copy is done."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    packed, offsets = pack(arrays)
    buffer = torch.from_numpy(packed).pin_memory().to(device, non_blocking=True)
    return unpack(buffer, arrays, offsets)


def build_step_inputs(plan: StepPlan, block_size: int, device: torch.device) -> StepInputs:
    """Flatten the plan's requests into one batch (StepPlan's runner contract). ValueError
    when a request carries drafts in a prefill chunk or its block table does not cover its
    fed tokens."""
    reqs = plan.scheduled
    if not reqs:
        raise ValueError("a step needs at least one sequence")
    bs = block_size
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[ScheduledRequest] = []
    for s in reqs:
        k = len(s.draft_token_ids)
        if k and not s.sample:
            raise ValueError(f"request {s.request_id!r} carries drafts in a prefill chunk")
        start, n, blocks = s.start_pos, len(s.token_ids) + k, s.block_ids
        end = start + n
        if n < 1 or start < 0:
            raise ValueError(f"request {s.request_id!r}: start {start}, {n} new tokens")
        if len(blocks) * bs < end:
            raise ValueError(
                f"request {s.request_id!r}: {len(blocks)} blocks of {bs} cannot hold {end} tokens"
            )
        tokens += s.token_ids
        if n == 1 and not k:  # a decode
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            if k:
                tokens += s.draft_token_ids
            positions += range(start, end)
            for j in range(start // bs, (end - 1) // bs + 1):  # the blocks the tokens fill
                base = blocks[j] * bs - j * bs  # slot of position p in block j: base + p
                slots += range(base + max(start, j * bs), base + min(end, (j + 1) * bs))
        query_start_loc.append(len(tokens))
        seq_lens.append(end)
        query_lens.append(n)
        if s.sample:
            sample_rows += range(len(tokens) - 1 - k, len(tokens))
            sampled.append(s)
    width = max(len(s.block_ids) for s in reqs)
    flat: list[int] = []
    padding = [0] * width
    for s in reqs:
        flat += s.block_ids
        flat += padding[: width - len(s.block_ids)]
    block_tables = np.array(flat, dtype=np.int32).reshape(len(reqs), width)  # [B, nb], 0-padded
    ids_t, pos_t, slots_t, rows_t, qsl_t, lens_t, tables_t = to_device(
        [
            np.array(tokens, dtype=np.int64),  # [T]
            np.array(positions, dtype=np.int64),  # [T]
            np.array(slots, dtype=np.int64),  # [T]
            np.array(sample_rows, dtype=np.int64),  # [R]
            np.array(query_start_loc, dtype=np.int32),  # [B+1]
            np.array(seq_lens, dtype=np.int32),  # [B]
            block_tables,
        ],
        device,
    )
    attn = AttentionMetadata(
        query_start_loc=qsl_t,
        seq_lens=lens_t,
        block_tables=tables_t,
        slot_mapping=slots_t,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=bs,
        is_decode=len(tokens) == len(reqs),
        max_query_len=max(query_lens),
    )
    return StepInputs(ids_t, pos_t, attn, rows_t, sampled)
