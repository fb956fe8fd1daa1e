"""The decode GEMVs of Qwen3-8B at M = 1 with their default launch shapes, each launched a few
times on distinct copies of its weight (so each launch reads from DRAM), for a profiler to
look at; prints each shape's launch shape. `--moe`: instead one Qwen3-30B-A3B MoE layer at
T = 1 (Q4_K gate/up, padded Q6_K down; `kernels_gpu.bench_moe`, cold experts).

Usage (repository root, CUDA):
    ncu --kernel-name regex:_mmvq_once_kernel --section SpeedOfLight ... \\
        python bench/gemv_launches.py [--moe]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType as T  # noqa: E402
from kernels_gpu import bench_moe, random_qtensor  # noqa: E402

from moestream.kernels.mmvq import mmvq, mmvq_config, num_sms, quantize_q8  # noqa: E402

SHAPES = [(6144, 4096, T.Q4_K, False), (4096, 4096, T.Q4_K, False)]
SHAPES += [(24576, 4096, T.Q4_K, False), (4096, 12288, T.Q4_K, False)]
SHAPES += [(4096, 12288, T.Q6_K, True)]
COPIES = 3


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    if "--moe" in sys.argv[1:]:
        print(bench_moe(1, (T.Q4_K, T.Q6_K), torch.bfloat16, gen=gen, padded=True), flush=True)
        return 0
    for n, k, qtype, padded in SHAPES:
        ws = [random_qtensor(qtype, (n, k), gen).to("cuda", aligned=padded) for _ in range(COPIES)]
        a = quantize_q8(torch.randn(1, k, device="cuda", generator=gen))
        print(f"{n} x {k} {qtype.name}{' padded' * padded}:", mmvq_config(n, k, num_sms(a.q.device),
              1, padded=padded), flush=True)  # fmt: skip
        for w in ws:
            mmvq(a, w)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
