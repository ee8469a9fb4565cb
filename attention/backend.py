"""The attention-backend interface, shaped like vLLM V0 backends so engines built on those recognise it.

A backend is a set of static functions (cache shape, metadata construction, the decode-graph hooks)
plus an implementation class whose ``forward`` writes the step's new K/V into the paged cache and
attends. The graph hooks deal in attention metadata only: the tokens a step decodes, their positions
and everything else a decode graph reads belong to its runner (``graphrt.capture``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from graphrt.attention.graph_state import DecodeGraphState
from graphrt.attention.metadata import AttentionMetadata

#: Head sizes every backend's kernels are built and tested for.
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)


class AttentionImpl(ABC):
    """One layer's attention. Raises ``ValueError`` for a head size the backend cannot run."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head size {head_size} is not supported; supported head sizes: {list(SUPPORTED_HEAD_SIZES)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"{len(alibi_slopes)} ALiBi slopes given for {num_heads} heads")
        #: [H] float32 ALiBi slopes, moved to the device on first use; None without ALiBi.
        self._alibi = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def alibi_slopes_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes on ``device``; the first (eager, warm-up) call moves them, so a captured
        graph never copies from the host."""
        if self._alibi is not None and self._alibi.device != device:
            self._alibi = self._alibi.to(device)
        return self._alibi

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kv_cache_written: bool = False,
        dependent_launch: bool = False,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` and attend.

        query: [T, H * D]; key, value: [T, KVH * D]; kv_cache: the backend's cache for this layer
        (see ``get_kv_cache_shape``) in the model dtype or ``torch.float8_e4m3fn``, or None while
        profiling memory (nothing is cached, every sequence must then have an empty context). An fp8
        cache stores ``k / k_scale`` and ``v / v_scale`` (saturated at +-448, rounded to nearest-even)
        and reads back stored values times the scales; a 16-bit cache ignores the scales. This step's
        own keys and values are attended as computed, unrounded, so a prompt gets the same numbers
        whether or not the cache is fp8; cached ones are read as stored. ``kv_cache_written=True``: the caller already
        stored this step's K/V (e.g. ``triton_rope_cache_write``, fused with the rotary embedding), so
        only attend. ``dependent_launch=True``: the caller's device supports programmatic dependent
        launch (``graphrt.kernels.dependent_launch``) and a backend may launch its decode kernels so;
        backends without such kernels ignore it. Returns [T, H * D] in query's dtype.
        """


class AttentionBackend(ABC):
    """Static description of a backend; the engine picks one by name through the registry."""

    name: str
    #: Whether prompt steps can run in captured graphs: prefill attention that takes ``captured`` metadata
    #: (lengths on the device only; ``graphrt.capture.prefill_graphs``).
    supports_prompt_graphs: bool = False

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def make_metadata(**kwargs) -> AttentionMetadata:
        """Build metadata from host lists (see ``AttentionMetadata.from_seqlens``)."""
        return AttentionMetadata.from_seqlens(**kwargs)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One layer's cache in the paged layout all graphrt backends share, so they can be swapped:
        ``[2, num_blocks, block_size * KVH * D]``, keys then values, token-major within a block."""
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    @abstractmethod
    def unusable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device``, or None when it can."""

    # -- CUDA-graph hooks: the capture code sees backends only through these -----------------------

    @classmethod
    def init_graph_state(
        cls,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int,
        device: torch.device,
        *,
        num_heads: int,
        head_size: int,
        leading_fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]] = (),
    ) -> DecodeGraphState:
        """Allocate the static attention tensors decode graphs read, once, at the largest bucket
        (backends with kernel scratch space size it from ``num_heads`` and ``head_size``).
        ``leading_fields``: the caller's own fields to share the pinned staging with, so one copy a
        step refreshes both (``DecodeGraphState.allocate``); the backend does not read them."""
        return DecodeGraphState.allocate(max_batch_size, max_seq_len, block_size, device, leading_fields)

    @classmethod
    def graph_metadata(cls, state: DecodeGraphState, batch_size: int) -> AttentionMetadata:
        """Metadata for capturing (and eagerly running) a decode of ``batch_size`` padded rows."""
        return state.metadata(batch_size)

    @classmethod
    def refresh_graph_state(
        cls,
        state: DecodeGraphState,
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        padded_batch_size: int,
        block_table_versions: list[int] | None = None,
        upload: bool = True,
    ) -> None:
        """Before a replay: write the real rows' attention metadata and make padding rows inert (slot -1,
        length 1, null block), then copy it to the device (``upload=False``: the caller copies, see
        ``DecodeGraphState.refresh``)."""
        state.refresh(seq_lens, block_tables, slot_mapping, padded_batch_size, block_table_versions, upload)
