"""The decode MoE's bits on the GPU against the exact interpreter's, with the interpreter's half
computed ahead on any CPU (Triton's interpreter, `kernels.exact.exact_interpreter`), so that a
GPU run only computes its own half:

    TRITON_INTERPRET=1 python bench/exact_bits.py reference ref.pt   # CPU, Triton 3.6: minutes
    python bench/exact_bits.py compare ref.pt                        # GPU: seconds

Paths (`tests/kernels/test_exact.run_moes`): "once" (the default decode launch), "hybrid" (the
launch shape of host-computed experts: the reproducible down), "grouped" (batched decode).
`compare` prints, per path, the elements that differ, the largest difference in units in the
last place and in absolute value; exit status 1 where a path claimed reproducible
(`REPRODUCIBLE_PATHS`) differs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.test_exact import REPRODUCIBLE_PATHS, moe_operands, run_moes  # noqa: E402


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in float32 steps between a and b (same signs assumed near)."""
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=("reference", "compare"))
    ap.add_argument("file", type=Path, help="the reference (written or read)")
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    if args.mode == "reference":
        from moestream.kernels.exact import exact_interpreter

        ops = moe_operands(t=args.tokens, seed=args.seed)
        with exact_interpreter():
            cpu = run_moes(ops, "cpu")
        torch.save({"ops": ops, "cpu": cpu}, args.file)
        return 0
    ref = torch.load(args.file, weights_only=True)
    gpu = run_moes(ref["ops"], "cuda")
    bad = False
    for path, want in ref["cpu"].items():
        got = gpu[path]
        diff = int((got != want).sum())
        print(f"{path}: {diff} of {got.numel()} elements differ, max {ulps(got, want)} ulp, "
              f"max abs {float((got - want).abs().max()):.3g}")  # fmt: skip
        bad |= diff > 0 and path in REPRODUCIBLE_PATHS
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
