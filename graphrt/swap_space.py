"""Swap preemption's host side: a pool of KV-cache blocks in (pinned) host memory that holds preempted
sequences' blocks until they are scheduled again, so they resume decoding instead of being recomputed.

The scheduler decides (``Scheduler`` with a ``SwapSpace``): a preempted decoding sequence whose blocks
fit the pool is swapped out (its device blocks freed, its contents copied to host blocks first); the
oldest waiting sequence, when it was swapped and its blocks fit with a block to spare for each running
sequence, is swapped back in (fresh device blocks, contents copied from the host) and decodes in the
same step. The engine makes the copies (``copy``) before the step's forward, swap-ins first.
"""

from __future__ import annotations

import torch

from graphrt.block_manager import BlockAllocator


class SwapSpace:
    """``num_blocks`` host blocks (one of them the reserved null block, never used) laid out as the
    device cache's blocks, one tensor per layer (``caches``, pinned where the device is CUDA), and which
    of them each swapped sequence holds."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.allocator = BlockAllocator(caches[0].shape[1])
        self._tables: dict[int, list[int]] = {}

    @classmethod
    def allocate(cls, device_caches: list[torch.Tensor], num_blocks: int) -> SwapSpace:
        """A pool of ``num_blocks`` blocks shaped as ``device_caches``' blocks."""
        pin = device_caches[0].device.type == "cuda"
        shape = (device_caches[0].shape[0], num_blocks, *device_caches[0].shape[2:])
        return cls([torch.zeros(shape, dtype=cache.dtype, pin_memory=pin) for cache in device_caches])

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def fits(self, num_blocks: int) -> bool:
        return num_blocks <= self.allocator.num_free_blocks

    def swap_out(self, seq_id: int, device_table: list[int]) -> list[tuple[int, int]]:
        """Host blocks for a sequence's device blocks; returns the (device, host) pairs to copy."""
        host = [self.allocator.allocate() for _ in device_table]
        self._tables[seq_id] = host
        return list(zip(device_table, host))

    def swap_in(self, seq_id: int, device_table: list[int]) -> list[tuple[int, int]]:
        """A swapped sequence's new device blocks; returns the (host, device) pairs to copy, its host
        blocks free again (their contents stay until the copy is made, before any later swap-out)."""
        host = self._tables.pop(seq_id)
        for block in host:
            self.allocator.free(block)
        return list(zip(host, device_table))

    def drop(self, seq_id: int) -> None:
        """Forget a swapped sequence (its request is gone), its host blocks free."""
        for block in self._tables.pop(seq_id, []):
            self.allocator.free(block)

    def copy(self, device_caches: list[torch.Tensor], swap_in: list[tuple[int, int]],
             swap_out: list[tuple[int, int]]) -> None:
        """Make a step's copies: ``swap_in`` (host, device) pairs first, then ``swap_out`` (device, host)
        pairs, every layer. A swap-out waits for its copy (the host blocks are read on the host's side
        of later copies), a swap-in is queued on the device's stream before the step that reads it."""
        for device_cache, host_cache in zip(device_caches, self.caches):
            # Bytes, whatever the cache dtype (index copies of float8 are not implemented on the host).
            device_cache, host_cache = device_cache.view(torch.uint8), host_cache.view(torch.uint8)
            if swap_in:
                src, dst = (torch.tensor(ids) for ids in zip(*swap_in))
                device_cache[:, dst.to(device_cache.device)] = host_cache[:, src].to(device_cache.device)
            if swap_out:
                src, dst = (torch.tensor(ids) for ids in zip(*swap_out))
                host_cache[:, dst] = device_cache[:, src.to(device_cache.device)].to("cpu")
