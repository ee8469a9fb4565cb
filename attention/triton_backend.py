"""The CUDA backend: Triton kernels for the paged cache (write, decode, prefix prefill) and xFormers for
prefill of uncached prompts. Same cache layout as the reference backend (see ``reference.py``).

Per step: new K/V are written to their slots (slot -1 skipped); prompts with nothing cached go to
xFormers (its flash kernels in 16-bit dtypes) when it is usable, otherwise to the prefix-prefill kernel, which also
serves prompts whose prefix is already cached (metadata with context_lens > 0: a chunk of a prompt after
its earlier chunks, a prompt after its cached prefix blocks, an embedding engine's own reuse); decodes go to the
split-K paged decode kernel, whose launch shape depends only on the batch and ``max_decode_seq_len``.
"""

from __future__ import annotations

import importlib.util

import torch

from graphrt.attention.backend import AttentionBackend, AttentionImpl
from graphrt.attention.graph_state import DecodeGraphState
from graphrt.attention.metadata import AttentionMetadata
from graphrt.attention.reference import attend_uncached_prompts

#: Key of the decode split-K workspace in ``DecodeGraphState.extras``.
_WORKSPACE = "decode_workspace"


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window)
        # Imported here, not at module level, so that importing graphrt never compiles or imports
        # Triton on machines that cannot run it.
        from graphrt.attention import (
            triton_cache_write,
            triton_paged_decode,
            triton_prefix_prefill,
            xformers_prefill,
        )
        from graphrt.attention.xformers_compat import xformers_status

        self._write = triton_cache_write.write_kv_cache
        self._decode = triton_paged_decode.paged_decode_attention
        self._prefix_prefill = triton_prefix_prefill.triton_prefix_prefill
        self._xformers = xformers_prefill
        self._use_xformers = xformers_status().usable

    def forward(self, query, key, value, kv_cache, attn_metadata: AttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0, kv_cache_written: bool = False, dependent_launch: bool = False):
        num_tokens = query.shape[0]
        heads, kv_heads, size = self.num_heads, self.num_kv_heads, self.head_size
        if kv_cache is None or kv_cache.dtype != torch.float8_e4m3fn:
            k_scale = v_scale = 1.0  # the kernels read a 16-bit cache unscaled
        if kv_cache is not None and not kv_cache_written:
            self._write(key, value, kv_cache, attn_metadata.slot_mapping[:num_tokens], kv_heads, k_scale, v_scale)
        alibi = self.alibi_slopes_on(query.device)
        q = query.view(num_tokens, heads, size)
        out = torch.empty_like(q)
        num_prefill_tokens = attn_metadata.num_prefill_tokens
        prefill = attn_metadata.prefill_metadata
        if prefill is not None:
            k = key[:num_prefill_tokens].view(num_prefill_tokens, kv_heads, size)
            v = value[:num_prefill_tokens].view(num_prefill_tokens, kv_heads, size)
            self._run_prefill(q[:num_prefill_tokens], k, v, kv_cache, prefill, alibi, (k_scale, v_scale),
                              out[:num_prefill_tokens])
        decode = attn_metadata.decode_metadata
        if decode is not None:
            if kv_cache is None:
                raise ValueError("decoding needs a KV cache")
            self._decode(
                out[num_prefill_tokens:], q[num_prefill_tokens:], kv_cache, decode.block_tables,
                decode.seq_lens_tensor, decode.max_decode_seq_len, self.scale, kv_heads, decode.block_size,
                workspace=attn_metadata.decode_workspace, alibi_slopes=alibi, sliding_window=self.sliding_window,
                k_scale=k_scale, v_scale=v_scale, dependent_launch=dependent_launch,
            )
        return out.view(num_tokens, heads * size)

    def _run_prefill(self, q, k, v, kv_cache, prefill: AttentionMetadata, alibi, kv_scales, out) -> None:
        uncached = not prefill.captured and all(c == 0 for c in prefill.context_lens)
        if uncached and self._use_xformers:  # flash for fp16/bf16; xFormers dispatches fp32 to cutlass
            plan = _shared_prefill_plan(self._xformers, prefill, heads=self.num_heads, dtype=q.dtype,
                                        device=q.device, window=self.sliding_window, alibi=alibi)
            out.copy_(self._xformers.xformers_prefill(
                q, k, v, prefill.query_lens, self.scale, self.sliding_window, alibi, plan=plan
            ))
            return
        if kv_cache is None:  # memory profiling without xFormers: nothing cached, plain attention
            attend_uncached_prompts(q, k, v, prefill, self.scale, self.sliding_window, alibi, out)
            return
        self._prefix_prefill(
            q, k, v, kv_cache, prefill.block_tables, prefill.query_start_loc, prefill.seq_lens_tensor,
            prefill.max_query_len, self.scale, self.sliding_window, alibi, *kv_scales, out=out,
        )


_plan_cache: dict = {}


def _shared_prefill_plan(xformers_prefill, prefill: AttentionMetadata, *, heads, dtype, device, window, alibi):
    """One xFormers mask per step, shared by every layer (keyed by the step's lengths and the layer's
    attention shape; only the latest step's plans are kept)."""
    key = (tuple(prefill.query_lens), heads, dtype, device, window, None if alibi is None else alibi.data_ptr())
    plan = _plan_cache.get(key)
    if plan is None:
        if len(_plan_cache) >= 8:
            _plan_cache.clear()
        plan = _plan_cache[key] = xformers_prefill.plan_prefill(
            prefill.query_lens, num_heads=heads, dtype=dtype, device=device, sliding_window=window,
            alibi_slopes=alibi,
        )
    return plan


class TritonAttentionBackend(AttentionBackend):
    """Triton paged-cache kernels plus xFormers prefill; CUDA only."""

    name = "triton"
    supports_prompt_graphs = True  # the prefix-prefill kernel reads every length from device tensors

    @staticmethod
    def get_impl_cls():
        return TritonAttentionImpl

    @classmethod
    def unusable_reason(cls, device):
        if device.type != "cuda":
            return "its Triton kernels need a CUDA device (tests run them on the CPU interpreter)"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        return None

    @classmethod
    def init_graph_state(cls, max_batch_size, max_seq_len, block_size, device, *, num_heads, head_size,
                         leading_fields=()):
        from graphrt.attention.triton_paged_decode import DecodeWorkspace

        state = DecodeGraphState.allocate(max_batch_size, max_seq_len, block_size, device, leading_fields)
        state.extras[_WORKSPACE] = DecodeWorkspace.allocate(max_batch_size, num_heads, head_size, device=device)
        return state

    @classmethod
    def graph_metadata(cls, state, batch_size):
        metadata = state.metadata(batch_size)
        metadata.decode_workspace = state.extras[_WORKSPACE]
        return metadata
