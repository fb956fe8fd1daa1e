"""Device-to-device copy bandwidth (bytes read + written), median of repeats: the ceiling that
bytes-per-token figures are divided by."""

import statistics
import sys

import torch


def main(gib: float = 4.0, repeats: int = 20) -> None:
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    gbps = [2 * n / t / 1e9 for t in times]
    print(
        f"copy bandwidth: median {statistics.median(gbps):.0f} GB/s "
        f"(min {min(gbps):.0f}, max {max(gbps):.0f}; {gib} GiB x {repeats}, read+write)"
    )


if __name__ == "__main__":
    main(*(float(a) for a in sys.argv[1:2]))
