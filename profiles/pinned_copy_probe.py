"""Host time of one non-blocking host-to-device copy call from pinned memory, by size.

A decode step's refresh issues one such copy (``graphrt.staging.PackedStaging.upload``); on the H200's
host it took 19 us at batch 1 and 79 us for 64 rows at context 4096 (``host_step_breakdown.py``), which
grows with the bytes as if the copy ran synchronously. This prints the call's median host time for a
few sizes, and whether the buffer is pinned.

    python profiles/pinned_copy_probe.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("pinned_copy_probe: needs a CUDA device", file=sys.stderr)
        return 2
    for nbytes in (1 << 10, 1 << 13, 1 << 16, 1 << 20):
        host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        samples = []
        for _ in range(200):
            torch.cuda.synchronize()
            start = time.perf_counter()
            device.copy_(host, non_blocking=True)
            samples.append(time.perf_counter() - start)
        print(f"{nbytes:8d} B pinned={host.is_pinned()}: copy_ call {statistics.median(samples) * 1e6:6.1f} us "
              f"host time", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
