"""The paged KV pool: per layer, K and V tensors of fixed-size blocks shared by all sequences.

A sequence owns a list of block ids (its block table); token `p` of it lives in block
`table[p // block_size]` at offset `p % block_size`, i.e. at flat slot
`block_id * block_size + offset` of the [num_blocks * block_size, n_kv_heads, head_dim] view.
Which blocks belong to whom is decided by the (pure-Python) block allocator, not here.
"""

from __future__ import annotations

import torch

from moestream.config import ModelConfig
from moestream.errors import CapacityError


class PagedKVCache:
    """`k[layer]`, `v[layer]`: Tensor [num_blocks, block_size, n_kv_heads, head_dim]."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks, block_size > 0, got {num_blocks}, {block_size}")
        self.n_layers = n_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        # Zero-filled so that never-written slots hold finite values (kernels may read them
        # under a mask); the cost is one memset at startup.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @staticmethod
    def block_bytes(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * block_size * n_kv_heads * head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(
            self.n_layers, self.block_size, self.n_kv_heads, self.head_dim, self.dtype
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def blocks_for_budget(
        cls, config: ModelConfig, gib: float, block_size: int, dtype: torch.dtype
    ) -> int:
        """How many blocks fit in `gib` GiB for `config`'s layers and KV heads (at least 1).

        Raises CapacityError when the budget cannot hold a single block.
        """
        per_block = cls.block_bytes(
            config.n_layers, block_size, config.n_kv_heads, config.head_dim, dtype
        )
        blocks = int(gib * 2**30) // per_block
        if blocks < 1:
            raise CapacityError(
                f"KV cache budget of {gib} GiB is smaller than one block of {block_size} tokens "
                f"({per_block} bytes for {config.n_layers} layers)"
            )
        return blocks
