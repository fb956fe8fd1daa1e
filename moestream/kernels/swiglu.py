"""The SiLU-gated product of a dense FFN's fused gate/up projection, and the q8 rounding of the
result for the down projection's integer-dot kernel, in one launch.

A decode step of a dense model ran F.silu, a multiply and `mmvq.quantize_q8` as three launches
between the gate/up and down GEMVs; each is a few microseconds of launch and tail for a few
kilobytes. `silu_mul` reads the [M, 2F] output of one GEMV over the stacked gate and up rows
(`layers.mlp.GatedMLP`), writes h = silu(g) * u in the activations' dtype and, when asked, h's
q8 blocks (`mmvq.store_q8_blocks`, the rounding every q8 producer shares) from those rounded
values, so they equal `quantize_q8(h)` bit for bit. Rows are independent (batch invariant).

Letters: M rows, F FFN size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.mmvq import QBLOCK, Q8Act, empty_q8, store_q8_blocks
from moestream.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, q_ptr, d_ptr, s_ptr, F, NB, stride_gm, stride_hm, stride_qm,
                     stride_dm, BLOCKS: tl.constexpr, Q8: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    """Program (row m, BLOCKS blocks of 32 values of h)."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    bc = tl.minimum(b, NB - 1)[:, None, None]
    w = tl.arange(0, 8)[None, :, None]
    i = tl.arange(0, 4)[None, None, :]
    off = bc * 32 + 4 * w + i  # [BLOCKS, 8, 4]: value 32 b + 4 w + i
    row = gu_ptr + m * stride_gm
    g = tl.load(row + off).to(tl.float32)
    u = tl.load(row + F + off).to(tl.float32)
    h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + m * stride_hm + off, h, mask=(b < NB)[:, None, None])
    if Q8:
        q_row, d_row, s_row = q_ptr + m * stride_qm, d_ptr + m * stride_dm, s_ptr + m * stride_dm
        store_q8_blocks(h.to(tl.float32), b, NB, q_row, d_row, s_row)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """Reference of `silu_mul`'s h: gu [M, 2F] -> silu(g) * u [M, F] in gu's dtype, computed in
    float32 (g = gu[:, :F], u = gu[:, F:])."""
    f = gu.shape[1] // 2
    g, u = gu[:, :f].float(), gu[:, f:].float()
    return (g * torch.sigmoid(g) * u).to(gu.dtype)


def silu_mul(
    gu: torch.Tensor, q8: bool = False, blocks: int = 8
) -> tuple[torch.Tensor, Q8Act | None]:
    """gu [M, 2F] (gate outputs, then up outputs; unit last stride, F a multiple of 32) ->
    (h = silu(g) * u [M, F] in gu's dtype, quantize_q8(h) when `q8` else None), one launch."""
    if gu.dim() != 2 or gu.shape[1] % (2 * QBLOCK) or gu.stride(1) != 1:
        raise ValueError(f"gu must be [M, 2F] with F % 32 == 0 and unit stride, got {gu.shape}")
    m, f = gu.shape[0], gu.shape[1] // 2
    nb = f // QBLOCK
    h = torch.empty((m, f), dtype=gu.dtype, device=gu.device)
    xa = None
    if q8:
        xa = empty_q8(m, f, gu.device)
    if m:
        q, d, s = xa if xa is not None else (h, h, h)  # unused pointers without q8
        _silu_mul_kernel[(m, triton.cdiv(nb, blocks))](
            gu, h, q, d, s, f, nb, gu.stride(0), h.stride(0), q.stride(0), d.stride(0),
            BLOCKS=blocks, Q8=q8, num_warps=4, **pdl_args(h.device),
        )  # fmt: skip
    return h, xa
