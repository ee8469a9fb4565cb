"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) with fused QKV and gate/up projections.

Every layer reads the step's ``AttentionMetadata`` (tokens of all sequences flattened: prefills first,
then decodes) and its own paged KV cache, so one forward serves any mix of prefill and decode.

The kernels are the model's ``KernelPolicy`` (``graphrt.models.kernel_policy``), chosen once when it is
built: with fused kernels the layer's elementwise work runs as Triton kernels (residual add + RMSNorm,
rotary embedding + KV-cache write, SiLU * up, one launch each), and a forward of few enough tokens runs
each layer on matrix-vector kernels that fuse those in; unfused, the torch ops are the reference to
compare against. The two round alike (``graphrt.kernels`` says where they can still differ). Dependent
launches (fused kernels, sm_90+) let each decode kernel overlap the end of the one before it
(``graphrt.kernels.dependent_launch``); results are the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from graphrt.attention import AttentionBackend, AttentionMetadata
from graphrt.base import nvtx
from graphrt.base.errors import ModelLoadError

from .config import ModelConfig
from .fp8 import Fp8Linear
from .kernel_policy import KernelPolicy
from .layers import RMSNorm, RotaryEmbedding, silu_and_mul_torch


class LlamaAttention(nn.Module):
    """Self-attention: QKV projection, rotary embedding, KV-cache write and attention over the paged
    cache (the output projection is the layer's, which may fuse the residual add into it)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: type[AttentionBackend], dtype, device,
                 policy: KernelPolicy):
        super().__init__()
        self.policy = policy
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # q, k and v in one GEMM: rows [0, q) are q, then k, then v.
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias, dtype=dtype, device=device
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = backend.get_impl_cls()(
            num_heads=config.num_attention_heads,
            head_size=config.head_dim,
            scale=config.head_dim**-0.5,
            num_kv_heads=config.num_key_value_heads,
            sliding_window=config.sliding_window,
        )
        if policy.fused:
            from graphrt.attention import triton_rope_cache_write

            self._rope_cache_write = triton_rope_cache_write

    def forward(self, positions, hidden, kv_cache, attn_metadata: AttentionMetadata,
                input_norm: RMSNorm | None = None) -> torch.Tensor:
        """positions: [T] int64; hidden: [T, hidden], the normalised input -> attention output [T, q],
        before the output projection. Stores this step's k and v in ``kv_cache``.

        ``input_norm`` (GEMV layers, fused kernels): ``hidden`` is the residual stream instead, and one
        kernel normalises it, projects it to q, k and v, rotates them and stores k and v."""
        launch = self.policy.dependent_launch
        if input_norm is not None:
            qkv = self._rope_cache_write.project_rope_and_write_kv_cache(
                hidden, self.qkv_proj.weight, self.qkv_proj.bias, positions, self.rotary.cos, self.rotary.sin,
                kv_cache, attn_metadata.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                norm_weight=input_norm.weight, eps=input_norm.eps, dependent_launch=launch,
            )
        elif self.policy.fused:
            qkv = self.qkv_proj(hidden)
            # Rotates q and k inside qkv and stores k and v in the cache, so attention only reads.
            self._rope_cache_write.rope_and_write_kv_cache(
                qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache, attn_metadata.slot_mapping,
                self.num_heads, self.num_kv_heads, self.head_dim, dependent_launch=launch,
            )
        else:
            q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary(positions, q, k)
            return self.attn.forward(q, k, v, kv_cache, attn_metadata)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attn.forward(q, k, v, kv_cache, attn_metadata, kv_cache_written=True, dependent_launch=launch)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, policy: KernelPolicy):
        super().__init__()
        # gate and up in one GEMM: rows [0, I) are gate, [I, 2I) up.
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype, device=device)
        self._activation = silu_and_mul_torch
        if policy.fused:
            from graphrt.kernels.activation import silu_and_mul

            self._activation = silu_and_mul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activation(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block.

    The residual stream travels between layers as a pair ``(hidden, residual)`` whose sum is the
    stream: a layer leaves its last output in ``hidden`` for the next norm to add (``RMSNorm(x,
    residual)`` fuses the add), or, on GEMV kernels, adds everything into ``residual`` in place and
    passes ``hidden=None``.
    """

    def __init__(self, config: ModelConfig, rotary, backend, dtype, device, policy: KernelPolicy):
        super().__init__()
        self.policy = policy
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, device=device, fused=policy.fused)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = LlamaAttention(config, rotary, backend, dtype, device, policy)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = LlamaMLP(config, dtype, device, policy)
        if policy.gemv_max_tokens:
            from graphrt.kernels import gemv

            self._gemv = gemv

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata):
        """positions: [T] int64; hidden: [T, hidden], the previous layer's pending output (the
        embeddings for layer 0), or None; residual: [T, hidden], the stream before ``hidden`` is
        added, None for layer 0. Returns the pair for the next layer, both [T, hidden] (``hidden`` None
        after GEMV kernels).

        A forward of at most ``policy.gemv_max_tokens`` tokens runs the GEMV kernels: QKV with the
        input norm, rotary and cache write fused in, attention, O adding into the stream, gate/up with
        the norm and SiLU * up, down adding into the stream; five kernels where the GEMM path runs
        four GEMMs, two norms, rotary + cache write, SiLU * up and attention."""
        if self.policy.runs_gemv(positions.shape[0]):
            return self._forward_gemv(positions, hidden, residual, kv_cache, attn_metadata)
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn.o_proj(self.self_attn(positions, normed, kv_cache, attn_metadata))
        normed, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(normed), residual

    def _forward_gemv(self, positions, hidden, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden  # the embeddings, a fresh tensor: from here the stream is updated in place
        elif hidden is not None:
            residual = residual + hidden
        attention, mlp, kernels = self.self_attn, self.mlp, self._gemv
        launch = {"dependent_launch": self.policy.dependent_launch}
        attended = attention(positions, residual, kv_cache, attn_metadata, input_norm=self.input_layernorm)
        kernels.linear_gemv(attended, attention.o_proj.weight, attention.o_proj.bias,
                            epilogue=kernels.EPILOGUE_ADD_TO_OUT, out=residual, **launch)
        activated = kernels.linear_gemv(
            residual, mlp.gate_up_proj.weight, norm_weight=self.post_attention_layernorm.weight,
            eps=self.post_attention_layernorm.eps, epilogue=kernels.EPILOGUE_SILU_MUL, **launch,
        )
        kernels.linear_gemv(activated, mlp.down_proj.weight, epilogue=kernels.EPILOGUE_ADD_TO_OUT, out=residual,
                            **launch)
        return None, residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. Parameter names follow HF's, with q/k/v and gate/up fused."""

    #: HF checkpoint names folded into a fused parameter: (suffix, fused suffix, shard index).
    _FUSED_SHARDS = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        backend: type[AttentionBackend],
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fused_kernels: bool = False,
        dependent_launch: bool = False,
        quantization: str | None = None,
    ):
        super().__init__()
        self.config = config
        #: The kernels every forward runs, chosen here once (``KernelPolicy.choose``). With
        #: ``quantization``, the layers' linear weights are quantized by ``quantize_weights`` once loaded.
        self.kernel_policy = KernelPolicy.choose(config, dtype, fused_kernels, dependent_launch,
                                                 quantization=quantization)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # One rotary table shared by all layers; cos/sin stay float32 for precision.
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, backend, dtype, device, self.kernel_policy)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused=self.kernel_policy.fused)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, hidden]: the output projection (the embedding table when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor | None],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden] in the model dtype."""
        self._check_weights()
        hidden, residual = self.embed_tokens(input_ids), None
        if nvtx.layers_enabled():  # checked once per forward, so the plain loop below stays free
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                with nvtx.layer(index):
                    hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        if hidden is None:  # the GEMV layers left everything in the residual stream
            return self.norm(residual)
        normed, _ = self.norm(hidden, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] in the model dtype -> logits [N, V] float32, whatever the model dtype.

        The products accumulate in float32 and are never rounded to the model dtype: a 16-bit logit
        of magnitude 25 is rounded to a multiple of 0.125, which turns a real margin of 0.08 between
        two tokens into a tie (or flips it), and argmax, logprobs and sampling all read these values.
        On CUDA one cuBLAS GEMM reads the 16-bit weights and writes float32 (``torch.mm`` with
        ``out_dtype``); elsewhere the operands are upcast first (exact, one float32 copy of the head).
        """
        self._check_weights()
        weight = self.lm_head_weight
        if weight.dtype == torch.float32:
            return nn.functional.linear(hidden, weight)
        if hidden.is_cuda:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return nn.functional.linear(hidden.float(), weight.float())

    # -- weights -----------------------------------------------------------------------------------

    def quantize_weights(self) -> None:
        """Quantize every decoder layer's linear weights as the kernel policy says (``"fp8"``: FP8 E4M3,
        a float32 scale per output channel; ``graphrt.models.fp8``), after ``load_weights``. The
        embedding and the LM head stay in the model dtype. Once only."""
        if self.kernel_policy.quantization is None:
            raise RuntimeError("this model was built without quantization")
        if getattr(self, "weights_quantized", False):
            raise RuntimeError("this model's weights are quantized already")
        self._check_weights()
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.qkv_proj = Fp8Linear.from_linear(attention.qkv_proj)
            attention.o_proj = Fp8Linear.from_linear(attention.o_proj)
            mlp.gate_up_proj = Fp8Linear.from_linear(mlp.gate_up_proj)
            mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj)
        self.weights_quantized = True

    def release_weights(self) -> None:
        """Free every parameter and buffer (they become meta tensors: no memory anywhere); the model
        refuses forwards from then on (a CPU product with a meta weight would return uninitialised
        memory rather than fail)."""
        self.to_empty(device="meta")
        self.weights_released = True

    def _check_weights(self) -> None:
        if getattr(self, "weights_released", False):
            raise RuntimeError("this model's weights were released (LLM.close()); build a new LLM to run it")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors in, fusing q/k/v and gate/up; every parameter must be set.

        Raises ModelLoadError naming any missing, unexpected, duplicated, mis-shaped or non-floating-point
        tensor (integers or booleans would be converted to numbers no checkpoint meant).
        """
        if getattr(self, "weights_quantized", False):
            raise RuntimeError("load weights before quantize_weights(), not after")
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            target, shard = self._target_of(name)
            if target is None:
                continue
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no counterpart in {self.config.architecture}")
            if name in seen:
                raise ModelLoadError(f"checkpoint holds tensor {name!r} twice (in two weight files?)")
            seen.add(name)
            if not tensor.is_floating_point():
                raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}, not a floating-point weight")
            param = params[target]
            if shard is None:
                dest = param.data
            else:
                dest = self._shard_view(target, param.data, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.setdefault(target, set()).add(shard)
        missing = [n for n in params if len(loaded.get(n, ())) < self._num_shards(n)]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks weights for {shown}")

    def _target_of(self, name: str) -> tuple[str | None, int | None]:
        """Map an HF tensor name to (our parameter name, shard index or None); (None, None) = skip."""
        if name.endswith("rotary_emb.inv_freq"):
            return None, None  # older checkpoints store the rotary table; we compute our own
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None  # tied: the embedding table is the head
        if name.startswith("model."):
            name = name[len("model."):]
        for suffix, (fused, shard) in self._FUSED_SHARDS.items():
            marker = "." + suffix + "."
            if marker in "." + name:
                return name.replace(suffix, fused), shard
        return name, None

    @staticmethod
    def _num_shards(name: str) -> int:
        """How many checkpoint tensors make up parameter ``name``."""
        if "qkv_proj" in name:
            return 3
        return 2 if "gate_up_proj" in name else 1

    def _shard_view(self, name: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        """Rows of a fused parameter (weight [out, in] or bias [out]) that shard ``shard`` occupies."""
        if "qkv_proj" in name:
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return data[start:start + sizes[shard]]
