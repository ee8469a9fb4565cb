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

import logging
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from graphrt.attention import AttentionBackend, AttentionMetadata
from graphrt.base import nvtx
from graphrt.base.errors import ModelLoadError

from .config import ModelConfig
from .fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, dequantize, scales_for_rows
from .kernel_policy import KernelPolicy
from .layers import FewRowsLinear, RMSNorm, RotaryEmbedding, silu_and_mul_torch
from .tensor_parallel import ShardLayout, TensorParallel

logger = logging.getLogger(__name__)

#: A calibrated KV scale maps this many times the largest value seen onto fp8's 448: two binades of
#: room for later, larger keys and values (E4M3 spans 18 binades, so the small ones lose little).
KV_SCALE_HEADROOM = 4.0


def _calibrated_scale(maximum: float, layer: int, kind: str) -> float:
    """``KV_SCALE_HEADROOM * maximum / 448``, or 1.0 (with a warning when not finite) for a maximum
    that is 0 or not finite."""
    if not math.isfinite(maximum):
        logger.warning("layer %d: the calibration prefill's largest |%s| is %s; its scale stays 1.0", layer, kind,
                       maximum)
        return 1.0
    return KV_SCALE_HEADROOM * maximum / FP8_MAX if maximum > 0 else 1.0


#: Whether a QKV product on the rows kernel rotates q and k and writes the KV cache in its own epilogue
#: (``attention/triton_qkv_rows.py``) rather than leaving them to the rotary kernel: off until its step
#: A/B on a GPU says otherwise (``profiles/run_h200.sh rows-rope-ab``); read at each forward.
ROWS_ROPE_EPILOGUE = False

#: Whether a gate/up product on the rows kernel writes SiLU * up itself where the down projection takes
#: 16-bit input, saving the activation's launch (an A/B switch for ``profiles/step_ab.py``, read at each
#: forward).
ROWS_SILU_EPILOGUE = True

#: Whether a decoder layer of 16-bit weights whose four products all run on the rows kernel (2-16 tokens)
#: normalises inside QKV's and gate/up's products and adds O's and down's outputs into the residual
#: stream in their epilogues, as the GEMV layers do for one token, instead of two add + norm launches: off
#: until its step A/B on a GPU says otherwise (``profiles/run_h200.sh rows-norm-ab``); read at each forward.
ROWS_NORM_PROLOGUE = False


def _linear(in_features: int, out_features: int, bias: bool, dtype, device, policy: KernelPolicy) -> nn.Module:
    """A decoder linear layer: ``nn.Linear`` in the model dtype (``FewRowsLinear`` where the policy runs a
    few tokens on the rows kernel), or with ``policy.quantization`` an ``Fp8Linear`` in the policy's
    scale layout (filled by ``load_weights``)."""
    if policy.quantization is None:
        if policy.rows_kernel_max_tokens:
            return FewRowsLinear(in_features, out_features, bias=bias, dtype=dtype, device=device,
                                 max_tokens=policy.rows_kernel_max_tokens)
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return Fp8Linear(in_features, out_features, bias, dtype, device, scale_columns=policy.weight_scale_columns,
                     tensor_cores=policy.fp8_tensor_cores, w8a16_max_tokens=policy.w8a16_max_tokens,
                     dependent_launch=policy.dependent_launch)


def _quantizes_input(linear: nn.Module, rows: int, device: torch.device, policy: KernelPolicy) -> bool:
    """Whether the fused kernel producing ``linear``'s input should write it as FP8 codes with per-token
    scales (``fp8_matmul.QuantizedRows``): the layer would quantise it first (FP8 tensor cores), and a
    producer that quantises its own output saves that launch."""
    return policy.fused and isinstance(linear, Fp8Linear) and linear.takes_quantized_input(rows, device)


def _fuses_silu_mul(linear: nn.Module, x) -> bool:
    """Whether the gate/up ``linear`` writes SiLU * up of ``x``'s product in its own epilogue (the rows
    kernel: ``FewRowsLinear``, ``Fp8Linear``)."""
    fuses = getattr(linear, "fuses_silu_mul", None)
    return fuses is not None and fuses(x)


def _first_names(names: list[str]) -> str:
    """The first five of ``names`` and how many more, for an error message."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _row_scales(linear: nn.Module) -> torch.Tensor | None:
    """The per-row scales the GEMV kernels take with an FP8 weight; None for a 16-bit one."""
    return linear.row_scales if isinstance(linear, Fp8Linear) else None


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
        self.qkv_proj = _linear(config.hidden_size, config.q_size + 2 * config.kv_size, config.attention_bias, dtype,
                                device, policy)
        self.o_proj = _linear(config.q_size, config.hidden_size, False, dtype, device, policy)
        #: An fp8 KV cache stores ``k / k_scale`` and ``v / v_scale`` (float32 scales from the checkpoint,
        #: else 1, or calibrated: ``LlamaForCausalLM.calibrate_kv_scales``); a 16-bit cache ignores them.
        self.k_scale = self.v_scale = 1.0
        #: Whether the checkpoint gave k_scale / v_scale (calibration then leaves that one).
        self.k_scale_stored = self.v_scale_stored = False
        #: While calibrating: float32 [2] on the device, the largest |k| (rotated) and |v| seen so far.
        self.kv_amax: torch.Tensor | None = None
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
            self._project_rope_and_write = triton_rope_cache_write.project_rope_and_write_kv_cache
        if policy.gemv_rows_max_tokens:
            from graphrt.attention import triton_qkv_rows

            self._project_rows_rope_and_write = triton_qkv_rows.project_rope_and_write_kv_cache_rows
        if policy.fused and (policy.rows_kernel_max_tokens or policy.quantization is not None):
            from graphrt.attention import triton_qkv_rows

            self._project_on_rows_kernel = triton_qkv_rows.project_rope_and_write_kv_cache_on_rows_kernel

    def forward(self, positions, hidden, kv_cache, attn_metadata: AttentionMetadata,
                input_norm: RMSNorm | None = None, rows_norm: RMSNorm | None = None) -> torch.Tensor:
        """positions: [T] int64; hidden: [T, hidden], the normalised input (or, fused kernels on FP8 tensor
        cores, its ``QuantizedRows``) -> attention output [T, q], before the output projection. Stores
        this step's k and v in ``kv_cache``. ``rows_norm`` (QKV on the rows kernel, 16-bit): hidden is the
        residual stream instead, normalised with this RMSNorm inside the QKV product.

        ``input_norm`` (GEMV layers, fused kernels): ``hidden`` is the residual stream instead, and one
        kernel normalises it, projects it to q, k and v, rotates them and stores k and v."""
        if self.kv_amax is not None:
            self._record_kv_amax(positions, hidden, input_norm or rows_norm)
        launch = self.policy.dependent_launch
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if input_norm is not None:
            project = (self._project_rows_rope_and_write if self.policy.runs_gemv_rows(positions.shape[0])
                       else self._project_rope_and_write)
            qkv = project(
                hidden, self.qkv_proj.weight, self.qkv_proj.bias, positions, self.rotary.cos, self.rotary.sin,
                kv_cache, attn_metadata.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                norm_weight=input_norm.weight, eps=input_norm.eps, dependent_launch=launch,
                weight_scale=_row_scales(self.qkv_proj), **scales,
            )
        elif self.policy.fused and (operands := self._rows_kernel_operands(hidden)) is not None:
            # The product on the rows kernel, q and k rotated and k and v stored in its epilogue.
            x, weight, weight_scale, bias, tile = operands
            norm = {} if rows_norm is None else dict(norm_weight=rows_norm.weight, eps=rows_norm.eps)
            qkv = self._project_on_rows_kernel(
                x, weight, weight_scale, bias, positions, self.rotary.cos, self.rotary.sin, kv_cache,
                attn_metadata.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim, tile=tile, **scales,
                **norm)
        elif self.policy.fused:
            qkv = self.qkv_proj(hidden) if rows_norm is None else self.qkv_proj(hidden, norm=rows_norm)
            # Rotates q and k inside qkv and stores k and v in the cache, so attention only reads.
            self._rope_cache_write.rope_and_write_kv_cache(
                qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache, attn_metadata.slot_mapping,
                self.num_heads, self.num_kv_heads, self.head_dim, dependent_launch=launch, **scales,
            )
        else:
            q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary(positions, q, k)
            return self.attn.forward(q, k, v, kv_cache, attn_metadata, **scales)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attn.forward(q, k, v, kv_cache, attn_metadata, kv_cache_written=True, dependent_launch=launch,
                                 **scales)

    def _rows_kernel_operands(self, hidden):
        """The QKV product's rows-kernel operands where its epilogue rotates and writes the cache
        (``ROWS_ROPE_EPILOGUE``, a QKV layer that would run this forward on the rows kernel), else None."""
        operands = getattr(self.qkv_proj, "rows_kernel_operands", None)
        return operands(hidden) if ROWS_ROPE_EPILOGUE and operands is not None else None

    def _record_kv_amax(self, positions, hidden, input_norm: RMSNorm | None) -> None:
        """Folds this forward's largest |k| and |v| into ``kv_amax``, k rotated as the cache stores it
        (a projection of its own, beside the forward's: calibration runs once)."""
        normed = hidden if input_norm is None else input_norm(hidden)
        q, k, v = self.qkv_proj(normed).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        _, k = self.rotary(positions, q, k)
        seen = torch.stack([k.abs().amax(), v.abs().amax()]).float()
        torch.maximum(self.kv_amax, seen, out=self.kv_amax)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device, policy: KernelPolicy):
        super().__init__()
        # gate and up in one GEMM: rows [0, I) are gate, [I, 2I) up.
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device, policy)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, dtype, device, policy)
        self.policy = policy
        self._activation = silu_and_mul_torch
        if policy.fused:
            from graphrt.kernels.activation import silu_and_mul

            self._activation = silu_and_mul

    def forward(self, hidden) -> torch.Tensor:
        """hidden: [T, hidden] normalised (or its ``QuantizedRows``) -> [T, hidden]. Where the gate/up
        product runs the rows kernel and the down projection takes 16-bit input, SiLU * up is that
        product's epilogue (``ROWS_SILU_EPILOGUE``) rather than a kernel of its own."""
        rows = hidden.shape[0]
        if (ROWS_SILU_EPILOGUE and self.policy.fused and _fuses_silu_mul(self.gate_up_proj, hidden)
                and not _quantizes_input(self.down_proj, rows, hidden.device, self.policy)):
            return self.down_proj(self.gate_up_proj(hidden, silu_mul=True))
        gate_up = self.gate_up_proj(hidden)
        if _quantizes_input(self.down_proj, gate_up.shape[0], gate_up.device, self.policy):
            return self.down_proj(self._activation(gate_up, quantize=True))
        return self.down_proj(self._activation(gate_up))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block.

    The residual stream travels between layers as a pair ``(hidden, residual)`` whose sum is the
    stream: a layer leaves its last output in ``hidden`` for the next norm to add (``RMSNorm(x,
    residual)`` fuses the add), or, on GEMV kernels and on the rows kernel with ``ROWS_NORM_PROLOGUE``,
    adds everything into ``residual`` in place and passes ``hidden=None``.
    """

    def __init__(self, config: ModelConfig, rotary, backend, dtype, device, policy: KernelPolicy,
                 tensor_parallel: TensorParallel):
        super().__init__()
        self.policy = policy
        #: Over several ranks the o and down projections give partial sums, all-reduced before they join
        #: the stream.
        self.tensor_parallel = tensor_parallel
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, device=device, fused=policy.fused)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = LlamaAttention(config, rotary, backend, dtype, device, policy)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = LlamaMLP(config, dtype, device, policy)
        if policy.gemv_max_tokens:
            from graphrt.kernels import gemv

            self._gemv = gemv
            self._linear_gemv = gemv.linear_gemv
        if policy.gemv_rows_max_tokens:
            from graphrt.kernels import gemv_rows

            self._linear_rows = gemv_rows.linear_rows

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata):
        """positions: [T] int64; hidden: [T, hidden], the previous layer's pending output (the
        embeddings for layer 0), or None; residual: [T, hidden], the stream before ``hidden`` is
        added, None for layer 0. Returns the pair for the next layer, both [T, hidden] (``hidden`` None
        after GEMV kernels and after ``_forward_rows``).

        A forward of at most ``policy.gemv_max_tokens`` tokens runs the GEMV kernels: QKV with the
        input norm, rotary and cache write fused in, attention, O adding into the stream, gate/up with
        the norm and SiLU * up, down adding into the stream; five kernels where the GEMM path runs
        four GEMMs, two norms, rotary + cache write, SiLU * up and attention. Forwards of up to
        ``policy.gemv_rows_max_tokens`` run the same five on the few-row kernels."""
        if self.policy.runs_gemv(positions.shape[0]):
            return self._forward_gemv(positions, hidden, residual, kv_cache, attn_metadata)
        if self._runs_rows_layer(hidden if hidden is not None else residual):
            return self._forward_rows(positions, hidden, residual, kv_cache, attn_metadata)
        # A norm whose output feeds an FP8 x FP8 product writes it quantised (one launch fewer a product).
        rows, device, policy = positions.shape[0], positions.device, self.policy
        quantize = _quantizes_input(self.self_attn.qkv_proj, rows, device, policy)
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, quantize=quantize)
        elif hidden is None:  # the layer before added everything into the stream (``_forward_rows``)
            normed = self.input_layernorm(residual, quantize=quantize)
        else:
            normed, residual = self.input_layernorm(hidden, residual, quantize=quantize)
        attended = self.self_attn.o_proj(self.self_attn(positions, normed, kv_cache, attn_metadata))
        attended = self.tensor_parallel.all_reduce(attended)
        quantize = _quantizes_input(self.mlp.gate_up_proj, rows, device, policy)
        normed, residual = self.post_attention_layernorm(attended, residual, quantize=quantize)
        return self.tensor_parallel.all_reduce(self.mlp(normed)), residual

    @staticmethod
    def _whole_stream(hidden, residual) -> torch.Tensor:
        """The residual stream with the previous layer's pending output added, for layers that update it in
        place (``_forward_gemv``, ``_forward_rows``)."""
        if residual is None:
            return hidden  # the embeddings, a fresh tensor: from here the stream is updated in place
        return residual if hidden is None else residual + hidden

    def _forward_gemv(self, positions, hidden, residual, kv_cache, attn_metadata):
        residual = self._whole_stream(hidden, residual)
        attention, mlp, kernels = self.self_attn, self.mlp, self._gemv
        linear = self._linear_rows if self.policy.runs_gemv_rows(positions.shape[0]) else self._linear_gemv
        launch = {"dependent_launch": self.policy.dependent_launch}
        attended = attention(positions, residual, kv_cache, attn_metadata, input_norm=self.input_layernorm)
        self._add_projection(linear, attended, attention.o_proj, residual, launch)
        activated = linear(
            residual, mlp.gate_up_proj.weight, norm_weight=self.post_attention_layernorm.weight,
            eps=self.post_attention_layernorm.eps, epilogue=kernels.EPILOGUE_SILU_MUL,
            weight_scale=_row_scales(mlp.gate_up_proj), **launch,
        )
        self._add_projection(linear, activated, mlp.down_proj, residual, launch)
        return None, residual

    def _runs_rows_layer(self, x: torch.Tensor) -> bool:
        """Whether a forward of ``x`` ([T, hidden]) runs ``_forward_rows``: ``ROWS_NORM_PROLOGUE``, one rank,
        and every product of the layer a ``FewRowsLinear`` (16-bit, or float32 where a policy allows it) on
        the rows kernel for T tokens."""
        if not ROWS_NORM_PROLOGUE or self.tensor_parallel.enabled:
            return False
        projections = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        return all(isinstance(p, FewRowsLinear) for p in projections) and all(
            p.takes_rows_kernel(x) for p in projections)

    def _forward_rows(self, positions, hidden, residual, kv_cache, attn_metadata):
        """The GEMV layers' structure on the rows kernel (2-16 tokens, ``FewRowsLinear``): QKV normalising the stream
        in its prologue (rotary and the cache write in its epilogue with ``ROWS_ROPE_EPILOGUE``), attention,
        O adding into the stream, gate/up normalising it (SiLU * up in its epilogue where it does not split
        K), down adding into the stream. Returns ``(None, residual)``, as ``_forward_gemv``."""
        residual = self._whole_stream(hidden, residual)
        attention, mlp = self.self_attn, self.mlp
        attended = attention(positions, residual, kv_cache, attn_metadata, rows_norm=self.input_layernorm)
        attention.o_proj(attended, residual=residual)
        fused = ROWS_SILU_EPILOGUE and mlp.gate_up_proj.fuses_silu_mul(residual)
        activated = mlp.gate_up_proj(residual, silu_mul=fused, norm=self.post_attention_layernorm)
        if not fused:
            activated = mlp._activation(activated)
        mlp.down_proj(activated, residual=residual)
        return None, residual

    def _add_projection(self, linear, x: torch.Tensor, projection: nn.Module, residual: torch.Tensor,
                        launch: dict) -> None:
        """residual += projection(x) on the GEMV kernels: in the kernel's epilogue on one rank; over
        several, each rank's partial product is all-reduced first (adding it in the epilogue on every
        rank would add the stream once a rank)."""
        if not self.tensor_parallel.enabled:
            linear(x, projection.weight, projection.bias, epilogue=self._gemv.EPILOGUE_ADD_TO_OUT, out=residual,
                   weight_scale=_row_scales(projection), **launch)
            return
        partial = linear(x, projection.weight, projection.bias, weight_scale=_row_scales(projection), **launch)
        residual.add_(self.tensor_parallel.all_reduce(partial))


#: Checkpoint tensor suffixes: scales of an FP8 weight; of the activations (unused: graphrt quantises
#: activations per token as it runs, or not at all); of the KV cache.
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
_ACTIVATION_SCALES = ("input_scale", "activation_scale")
_KV_SCALES = ("k_scale", "v_scale", "kv_scale")


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
        tensor_parallel: TensorParallel | None = None,
    ):
        super().__init__()
        #: This process's rank among the ranks that hold the model (one rank: the whole model).
        self.tensor_parallel = tensor_parallel or TensorParallel()
        #: What this rank holds of the checkpoint's tensors (None on one rank).
        self.shard = (ShardLayout.of(config, self.tensor_parallel.rank, self.tensor_parallel.size)
                      if self.tensor_parallel.enabled else None)
        #: The model this process runs: over several ranks its slice of the heads and the MLP (the
        #: vocabulary stays whole: logits are gathered).
        config = config if self.shard is None else self.shard.config
        self.config = config
        #: The kernels every forward runs, chosen here once (``KernelPolicy.choose``). With
        #: ``quantization`` the layers' linear layers are ``Fp8Linear``s, which ``load_weights`` fills
        #: from FP8 checkpoint tensors or quantizes 16-bit ones into.
        self.kernel_policy = KernelPolicy.choose(config, dtype, fused_kernels, dependent_launch,
                                                 quantization=quantization, device=torch.device(device))
        #: Rows of the embedding and LM head held here: the vocabulary, or this rank's slice of it.
        self.vocab_rows = config.vocab_size if self.shard is None else self.shard.vocab_rows
        self.embed_tokens = nn.Embedding(self.vocab_rows, config.hidden_size, dtype=dtype, device=device)
        # One rotary table shared by all layers; cos/sin stay float32 for precision.
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, backend, dtype, device, self.kernel_policy, self.tensor_parallel)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, fused=self.kernel_policy.fused)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, self.vocab_rows, bias=False, dtype=dtype, device=device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_rows, hidden]: the output projection (the embedding table when tied)."""
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
        hidden, residual = self._embed(input_ids), None
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

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]: over several ranks each looks up the ids in its vocabulary slice
        (zeros for the others') and the rows are all-reduced."""
        if self.shard is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        held = (local >= 0) & (local < self.vocab_rows)
        rows = self.embed_tokens(local.clamp(0, self.vocab_rows - 1))
        return self.tensor_parallel.all_reduce(rows * held.unsqueeze(1).to(rows.dtype))

    def calibrate_kv_scales(self, forward: Callable[[], object]) -> list[tuple[float, float]]:
        """Run ``forward()`` (a forward of this model) while each attention layer records its largest
        |k| and |v|, then give every scale the checkpoint did not ``k_scale = KV_SCALE_HEADROOM * max|k|
        / 448`` (``v_scale`` likewise; 1.0 where the maximum is 0 or not finite): the forward's values
        fit an fp8 cache up to its rounding, with room for later values up to KV_SCALE_HEADROOM times
        larger before they saturate. Returns each layer's (k_scale, v_scale). The forward's own cache
        writes used the old scales: run it again."""
        attentions = [layer.self_attn for layer in self.layers]
        for attention in attentions:
            attention.kv_amax = torch.zeros(2, dtype=torch.float32, device=self.embed_tokens.weight.device)
        try:
            forward()
            maxima = torch.stack([attention.kv_amax for attention in attentions]).tolist() if attentions else []
        finally:
            for attention in attentions:
                attention.kv_amax = None
        for index, (attention, (k_max, v_max)) in enumerate(zip(attentions, maxima)):
            if not attention.k_scale_stored:
                attention.k_scale = _calibrated_scale(k_max, index, "k")
            if not attention.v_scale_stored:
                attention.v_scale = _calibrated_scale(v_max, index, "v")
        return [(attention.k_scale, attention.v_scale) for attention in attentions]

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
            logits = nn.functional.linear(hidden, weight)
        elif hidden.is_cuda:
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:
            logits = nn.functional.linear(hidden.float(), weight.float())
        if self.shard is None:
            return logits
        return self.tensor_parallel.gather_columns(logits, self.config.vocab_size)  # each rank's vocabulary slice

    # -- weights -----------------------------------------------------------------------------------

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

        FP8 layers (``Fp8Linear``) take FP8 E4M3 codes with their ``weight_scale`` or ``weight_scale_inv``
        (one scale, one a row, or one a block: ``graphrt.models.fp8.scales_for_rows``), or a 16-bit
        weight, quantized here in the layer's scale layout. A 16-bit parameter given FP8 codes and a scale (an FP8 LM head)
        gets them dequantized. KV-cache scales (``self_attn.k_scale`` / ``v_scale``, one ``kv_scale`` for
        both, or ``k_proj`` / ``v_proj`` ``output_scale``) set the attention's; activation scales
        (``input_scale``) are not used. Raises ModelLoadError naming any missing, unexpected, duplicated,
        mis-shaped or non-floating-point tensor, an FP8 weight without its scale, or a zero point.
        """
        self._check_weights()
        params = dict(self.named_parameters())
        fp8_layers = {name: module for name, module in self.named_modules() if isinstance(module, Fp8Linear)}
        loaded: dict[str, set[int]] = {}
        seen: set[str] = set()
        # (target module or parameter, shard) -> {"weight" | "scale": (checkpoint name, tensor)}: a weight
        # and its scale may come in either order, from any file, so each waits here until its pair is
        # complete and is installed then (a 16-bit weight at once), holding no more than it must.
        fp8_parts: dict[tuple[str, int | None], dict[str, tuple[str, torch.Tensor]]] = {}
        installed: set[tuple[str, int | None]] = set()
        stored_head = None  # a tied model's checkpoint that holds an LM head all the same

        def install(key: str, shard: int | None, parts: dict) -> None:
            if key in fp8_layers:
                self._load_fp8_rows(fp8_layers[key], key, shard, parts)
            elif key in params:
                self._load_dequantized(params[key].data, key, shard, parts)
            else:
                raise ModelLoadError(f"checkpoint tensor {next(iter(parts.values()))[0]!r} has no counterpart in "
                                     f"{self.config.architecture}")
            loaded.setdefault(key if key in params else key + ".weight", set()).add(shard)
            installed.add((key, shard))
        scale_block = self.config.fp8_checkpoint.weight_block if self.config.fp8_checkpoint else None
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                stored_head = tensor if self.shard is None else self.shard.local_part(name, None, tensor, name)
                continue
            target, shard = self._target_of(name)
            if target is None:
                continue
            if name in seen:
                raise ModelLoadError(f"checkpoint holds tensor {name!r} twice (in two weight files?)")
            seen.add(name)
            module_name, _, leaf = target.rpartition(".")
            if leaf in _ACTIVATION_SCALES:
                continue
            if leaf in _KV_SCALES or (leaf == "output_scale" and module_name.endswith("qkv_proj")):
                self._set_kv_scale(module_name, leaf, shard, name, tensor)
                continue
            # This rank's rows or columns of it; but a 16-bit weight an FP8 layer holds columns of is
            # quantized whole first (``_load_fp8_rows``), each row's scale the one-rank model's.
            if self.shard is not None and not (leaf == "weight" and module_name in fp8_layers
                                               and self._quantizes_whole_rows(fp8_layers[module_name], target,
                                                                              tensor.dtype)):
                tensor = self.shard.local_part(target, shard, tensor, name, scale_block)
            if self.kernel_policy.quantization is None and (leaf in _WEIGHT_SCALES or tensor.dtype == FP8_DTYPE):
                raise ModelLoadError(f"checkpoint tensor {name!r} is an FP8 weight or scale, but the model was built "
                                     "unquantized: config.json declares no quantization_config (or pass "
                                     "quantization='fp8')")
            if leaf == "weight_zero_point":
                raise ModelLoadError(f"checkpoint tensor {name!r}: zero points (asymmetric quantization) are not "
                                     "supported")
            if leaf in _WEIGHT_SCALES or (leaf == "weight" and (module_name in fp8_layers or tensor.dtype == FP8_DTYPE)):
                key = (module_name if module_name in fp8_layers else module_name + ".weight", shard)
                if key in installed:
                    raise ModelLoadError(f"checkpoint tensor {name!r}: its weight was loaded already (a second scale, "
                                         "or a scale for a weight that is not FP8)")
                parts = fp8_parts.setdefault(key, {})
                part = "weight" if leaf == "weight" else "scale"
                if part in parts:
                    raise ModelLoadError(f"checkpoint holds two scales for one weight: {parts[part][0]!r} and {name!r}")
                parts[part] = (name, tensor)
                weight = parts.get("weight")
                if weight is not None and (weight[1].dtype != FP8_DTYPE or "scale" in parts):
                    install(*key, fp8_parts.pop(key))  # complete: a 16-bit weight takes no scale
                continue
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no counterpart in {self.config.architecture}")
            if not tensor.is_floating_point():
                raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}, not a floating-point weight")
            dest = self._param_rows(target, params[target].data, shard)
            self._check_shape(name, tensor, dest.shape)
            dest.copy_(tensor)
            loaded.setdefault(target, set()).add(shard)
        for (key, shard), parts in fp8_parts.items():  # what never completed: the errors name what is missing
            install(key, shard, parts)
        expected = list(params) + [name + ".weight" for name in fp8_layers]
        missing = [checkpoint_name for n in expected
                   for checkpoint_name in self._checkpoint_names(n, loaded.get(n, set()))]
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for {_first_names(missing)}")
        if stored_head is not None:
            self._untie_if_different(stored_head)

    def check_finite(self) -> None:
        """Raise ModelLoadError naming every parameter or buffer that holds a NaN or an infinity (FP8
        codes: a NaN code), as a checkpoint's corrupt or overflowed tensor would: every logit after it
        would be NaN. One pass over the weights, one host sync."""
        names, checks = [], []
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.dtype == FP8_DTYPE:  # E4M3FN has no infinity; S.1111.111 is NaN
                checks.append(((tensor.view(torch.uint8) & 0x7F) != 0x7F).all())
            elif tensor.is_floating_point():
                checks.append(torch.isfinite(tensor).all())
            else:
                continue
            names.append(name)
        if not checks:
            return
        bad = [name for name, finite in zip(names, torch.stack(checks).tolist()) if not finite]
        if bad:
            raise ModelLoadError(f"the checkpoint's weights hold NaN or infinite values: {_first_names(bad)}")

    def _untie_if_different(self, head: torch.Tensor) -> None:
        """A config that ties the LM head to the embedding, over a checkpoint whose ``lm_head.weight``
        differs from it: the stored head is used, untied, as transformers does (with its warning)."""
        embedding = self.embed_tokens.weight
        if head.dtype == FP8_DTYPE:  # FP8 codes say nothing without their scale: the tie stands
            return
        self._check_shape("lm_head.weight", head, embedding.shape)
        if not head.is_floating_point():
            raise ModelLoadError(f"checkpoint tensor 'lm_head.weight' is {head.dtype}, not a floating-point weight")
        head = head.to(device=embedding.device, dtype=embedding.dtype)
        if torch.equal(head, embedding):
            return
        logger.warning("config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint "
                       "holds an lm_head.weight that differs from it: the stored head is used, untied")
        self.lm_head = nn.Linear(self.config.hidden_size, self.vocab_rows, bias=False,
                                 dtype=embedding.dtype, device=embedding.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(head)
        self.config.tie_word_embeddings = False

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, shape) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")

    def _param_rows(self, target: str, data: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The rows of parameter ``target`` that checkpoint shard ``shard`` fills (all for None)."""
        if shard is None:
            return data
        start, rows = self._shard_rows(target, shard)
        return data[start:start + rows]

    def _fp8_weight_and_scale(self, key: str, parts: dict) -> tuple[str, torch.Tensor, tuple[str, torch.Tensor] | None]:
        if "weight" not in parts:
            raise ModelLoadError(f"checkpoint has the scale {parts['scale'][0]!r} but no weight for it")
        name, weight = parts["weight"]
        if weight.dtype != FP8_DTYPE and weight.dtype.itemsize == 1:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {weight.dtype}; graphrt reads FP8 weights as "
                                 "float8_e4m3fn")
        if not weight.is_floating_point():
            raise ModelLoadError(f"checkpoint tensor {name!r} is {weight.dtype}, not a floating-point weight")
        scale = parts.get("scale")
        if weight.dtype == FP8_DTYPE and scale is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} is FP8 but has no weight_scale or weight_scale_inv")
        if weight.dtype != FP8_DTYPE and scale is not None:
            raise ModelLoadError(f"checkpoint tensor {scale[0]!r} scales {name!r}, which is {weight.dtype}, not FP8")
        return name, weight, scale

    def _quantizes_whole_rows(self, layer: Fp8Linear, target: str, dtype: torch.dtype) -> bool:
        """Whether a rank quantises a 16-bit weight of ``target`` whole before cutting its columns: it holds
        columns of it, one scale a row (a scale over only its columns would differ from one rank's)."""
        return (self.shard is not None and dtype != FP8_DTYPE and layer.scale_columns is None
                and self.shard.splits_columns(target))

    def _load_fp8_rows(self, layer: Fp8Linear, key: str, shard: int | None, parts: dict) -> None:
        """Fill an FP8 layer's rows of one checkpoint shard: codes and scales as stored, or a 16-bit
        weight quantized per row."""
        name, weight, scale = self._fp8_weight_and_scale(key, parts)
        start, rows = (0, layer.out_features) if shard is None else self._shard_rows(key, shard)
        if scale is None and self._quantizes_whole_rows(layer, key + ".weight", weight.dtype):
            layer.quantize_columns_from(weight, lambda codes: self.shard.local_part(key + ".weight", None, codes, name))
            return
        self._check_shape(name, weight, (rows, layer.in_features))
        if scale is None:
            layer.quantize_rows_from(start, weight)
            return
        block = self.config.fp8_checkpoint.weight_block if self.config.fp8_checkpoint else None
        scales = scales_for_rows(scale[1], rows, layer.in_features, layer.scale_columns, block, scale[0])
        layer.store_rows(start, weight.to(layer.weight.device), scales.to(layer.weight.device))

    def _load_dequantized(self, data: torch.Tensor, key: str, shard: int | None, parts: dict) -> None:
        """A 16-bit parameter the checkpoint stores as FP8 codes with a scale: dequantized into it."""
        name, weight, scale = self._fp8_weight_and_scale(key, parts)
        dest = self._param_rows(key, data, shard)
        self._check_shape(name, weight, dest.shape)
        if scale is None:
            dest.copy_(weight)
            return
        block = self.config.fp8_checkpoint.weight_block if self.config.fp8_checkpoint else None
        columns = None if block is None else block[1]
        dest.copy_(dequantize(weight, scales_for_rows(scale[1], *weight.shape, columns, block, scale[0]), columns))

    def _set_kv_scale(self, module_name: str, leaf: str, shard: int | None, name: str, tensor: torch.Tensor) -> None:
        """A KV-cache scale (one value, > 0) onto layer ``module_name``'s attention."""
        attention_name = module_name.removesuffix(".qkv_proj")
        try:
            attention = self.get_submodule(attention_name)
        except AttributeError:
            attention = None
        if not isinstance(attention, LlamaAttention):
            raise ModelLoadError(f"checkpoint tensor {name!r} has no counterpart in {self.config.architecture}")
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise ModelLoadError(f"checkpoint tensor {name!r}: a KV-cache scale is one float, got "
                                 f"{tuple(tensor.shape)} {tensor.dtype}")
        value = float(tensor.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise ModelLoadError(f"checkpoint tensor {name!r}: KV-cache scale must be finite and positive, got {value}")
        if leaf == "output_scale":  # k_proj / v_proj output scales; q_proj's (shard 0) scales nothing cached
            leaf = {1: "k_scale", 2: "v_scale"}.get(shard)
            if leaf is None:
                return
        if leaf in ("k_scale", "kv_scale"):
            attention.k_scale, attention.k_scale_stored = value, True
        if leaf in ("v_scale", "kv_scale"):
            attention.v_scale, attention.v_scale_stored = value, True

    def _target_of(self, name: str) -> tuple[str | None, int | None]:
        """Map an HF tensor name to (our parameter name, shard index or None); (None, None) = skip."""
        if name.endswith("rotary_emb.inv_freq"):
            return None, None  # older checkpoints store the rotary table; we compute our own
        if name.startswith("model."):
            name = name[len("model."):]
        for suffix, (fused, shard) in self._FUSED_SHARDS.items():
            marker = "." + suffix + "."
            if marker in "." + name:
                return name.replace(suffix, fused), shard
        return name, None

    def _checkpoint_names(self, name: str, loaded_shards: set) -> list[str]:
        """The checkpoint tensors (HF names) of parameter ``name`` not among ``loaded_shards``: q/k/v and
        gate/up by their own names rather than the fused parameter's."""
        if self._num_shards(name) == 1:
            return [] if loaded_shards else [name]
        return [name.replace(fused, part) for part, (fused, shard) in self._FUSED_SHARDS.items()
                if fused in name and shard not in loaded_shards]

    @staticmethod
    def _num_shards(name: str) -> int:
        """How many checkpoint tensors make up parameter ``name``."""
        if "qkv_proj" in name:
            return 3
        return 2 if "gate_up_proj" in name else 1

    def _shard_rows(self, name: str, shard: int) -> tuple[int, int]:
        """(first row, rows) that shard ``shard`` occupies in fused parameter or layer ``name``."""
        if "qkv_proj" in name:
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]
