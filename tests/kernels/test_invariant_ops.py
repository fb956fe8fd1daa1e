"""Batch-invariant mode (`kernels.ops.batch_invariant`): each row's result must be the same bits
whatever else is in the batch. Runs the real kernels (the Triton interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

from moestream.kernels import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.test_moe_kernel import routing, stacked  # noqa: E402
from tests.kernels.test_quant_matmul import activations, quantized  # noqa: E402

T = GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_0, T.Q3_K])
def test_matmul_rows_do_not_depend_on_the_batch(qtype: GGMLQuantizationType) -> None:
    """9 rows (two chunks for the integer-dot types): every row equals itself computed
    alone and inside other batches, bit for bit."""
    w = quantized(qtype, (16, 256), seed=int(qtype))
    x = activations(9, 256, torch.bfloat16, seed=1)
    full = ops.invariant_quant_matmul(x, w)
    assert full.shape == (9, 16) and torch.isfinite(full).all()
    for rows in (slice(8, 9), slice(2, 5)):
        assert torch.equal(ops.invariant_quant_matmul(x[rows], w), full[rows])


def test_moe_tokens_do_not_depend_on_the_batch() -> None:
    gate = stacked(T.Q4_K, (4, 256, 256), seed=1)
    up = stacked(T.Q4_K, (4, 256, 256), seed=2)
    down = stacked(T.Q6_K, (4, 256, 256), seed=3)
    slot = torch.arange(4, dtype=torch.int32, device=DEVICE)
    # two tokens, the second alone (each token's experts cost the interpreter ~a minute)
    x = activations(2, 256, torch.bfloat16, seed=4)
    ids, weights = routing(2, 2, [0, 1, 2, 3], seed=5)
    full = ops.invariant_moe(x, ids, weights, gate, up, down, slot)
    one = ops.invariant_moe(x[1:], ids[1:], weights[1:], gate, up, down, slot)
    assert torch.equal(one[0], full[1])


def test_row_chunks_pad_to_one_shape() -> None:
    seen = []

    def fn(c: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(c.shape))
        return c * 2

    x = torch.arange(20.0).reshape(10, 2)
    y = ops._in_row_chunks(x, 8, fn, pad=True)
    assert torch.equal(y, x * 2)
    assert seen == [(8, 2), (8, 2)]


def test_batch_invariant_is_scoped() -> None:
    assert not ops.batch_invariant_enabled()
    with ops.batch_invariant():
        assert ops.batch_invariant_enabled()
        with ops.batch_invariant(False):
            assert not ops.batch_invariant_enabled()
        assert ops.batch_invariant_enabled()
    assert not ops.batch_invariant_enabled()
