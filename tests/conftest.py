"""Session-wide test setup: without CUDA, Triton kernels run in its CPU interpreter.

The switch must be set before triton is first imported (`triton.jit` reads it when a kernel is
defined), whichever test module happens to import a kernel module first; a per-module setting
comes too late when an earlier module already imported one.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
