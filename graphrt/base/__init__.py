"""Layer 0: what every other layer may use: errors, NVTX ranges, pinned host staging, small checks."""
