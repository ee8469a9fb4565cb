"""graphrt's greedy output equals HF transformers' on random-weight checkpoints that transformers writes
(see random_checkpoints.py); several prompts of different lengths run in one batch (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import assert_greedy_matches, graphrt_greedy_with_logits, hf_step_logits  # noqa: E402
from random_checkpoints import NAMES, random_prompts, write_random_checkpoint  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=NAMES)
def checkpoint(request, tmp_path_factory):
    """(directory, HF model in float32) for one random checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    return path, write_random_checkpoint(request.param, path)


def test_batched_greedy_matches_hf(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=8, progress=False)
    prompts = random_prompts(seed=7)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length"
        assert len(out.token_ids) == NEW_TOKENS
        assert_greedy_matches(hf_model, prompt, out.token_ids)


def test_logits_match_hf(checkpoint):
    """Prefill and decode logits themselves, not just their argmax, agree with HF's in float32."""
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    reference = hf_step_logits(hf_model, prompt, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_fused_kernels_match_hf(checkpoint):
    """The fused Triton kernels (Triton's CPU interpreter here) give HF's logits and greedy tokens too."""
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", fused_kernels=True, progress=False)
    assert llm.engine.fused_kernels
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    reference = hf_step_logits(hf_model, prompt, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    assert_greedy_matches(hf_model, prompt, tokens)


@pytest.mark.parametrize(("name", "edits"), [
    ("qwen2-bias-mqa", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2)),  # no layer windowed
    ("qwen2-bias-mqa", dict(use_sliding_window=True, sliding_window=7, max_window_layers=0)),  # every layer
    ("qwen2-bias-mqa", dict(use_sliding_window=True, sliding_window=7, layer_types=["sliding_attention"] * 2)),
    ("llama3-rope-scaling", dict(sliding_window=7)),  # Llama ignores the key
], ids=["qwen2-window-from-layer-2", "qwen2-window-from-layer-0", "qwen2-layer-types", "llama-window-key"])
def test_sliding_windows_are_read_as_transformers_reads_them(name, edits, tmp_path):
    """A window key means what transformers makes of it in each family's config: Qwen2's applies from
    ``max_window_layers`` on (or where ``layer_types`` says), Llama's not at all (the prompt, 33 tokens, is
    longer than the window)."""
    import transformers

    write_random_checkpoint(name, tmp_path)
    _edit_config(tmp_path, edits)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", progress=False)
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    torch.testing.assert_close(ours, hf_step_logits(hf_model, prompt, tokens), rtol=1e-4, atol=1e-4)


def test_a_qwen2_config_mixing_full_and_windowed_layers_is_refused(tmp_path):
    from graphrt import ModelLoadError

    write_random_checkpoint("qwen2-bias-mqa", tmp_path)
    _edit_config(tmp_path, dict(use_sliding_window=True, sliding_window=7, max_window_layers=1))
    with pytest.raises(ModelLoadError, match=r"layers \[1\] attend in a sliding window of 7 and the others fully"):
        LLM(str(tmp_path), dtype="float32", device="cpu", progress=False)


def test_a_tied_config_over_a_checkpoint_with_its_own_head_uses_that_head_as_transformers_does(tmp_path, caplog):
    """transformers keeps a stored lm_head.weight that differs from the embedding, untied, whatever
    tie_word_embeddings says (with a warning); graphrt gives its logits and says so too."""
    import transformers

    write_random_checkpoint("llama3-rope-scaling", tmp_path)  # untied, its head its own
    _edit_config(tmp_path, dict(tie_word_embeddings=True))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    with caplog.at_level("WARNING", logger="graphrt.models.llama"):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", progress=False)
    assert "the stored head is used, untied" in caplog.text
    assert llm.engine.model.lm_head is not None
    prompt = random_prompts(seed=11)[3]
    tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    torch.testing.assert_close(ours, hf_step_logits(hf_model, prompt, tokens), rtol=1e-4, atol=1e-4)


def test_a_tied_checkpoint_storing_its_embedding_as_the_head_stays_tied(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    write_random_checkpoint("qwen2-bias-mqa", tmp_path)  # tied
    [weights_file] = tmp_path.glob("*.safetensors")
    tensors = load_file(weights_file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="graphrt.models.llama"):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", progress=False)
    assert llm.engine.model.lm_head is None and "untied" not in caplog.text


def _edit_config(path, edits: dict) -> None:
    """Rewrite ``path``/config.json with ``edits``; the ``layer_types`` transformers saved from the
    original window settings go unless ``edits`` gives them (it derives them again from the edits)."""
    import json

    config_file = path / "config.json"
    config = {key: value for key, value in json.loads(config_file.read_text()).items() if key != "layer_types"}
    config_file.write_text(json.dumps({**config, **edits}))
