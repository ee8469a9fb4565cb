"""Without a CUDA device, Triton kernels run on Triton's CPU interpreter. ``@triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it must be set before any test imports one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``-n N``) the workers share the cores: each gets its share of torch's threads,
# where each would otherwise take them all and the workers would oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_terminal_summary(terminalreporter):
    """Skips summed by reason in a few lines (``-ra`` would list one line per skipping test site)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped")
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{count:6d}  {reason}")
