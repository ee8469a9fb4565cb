"""Tensor parallelism on the CPU: gloo, ranks in processes graphrt starts itself. Two ranks give the
tokens of one (float32, random checkpoints written by transformers and random presets; greedy, seeded
sampling, logprobs, prompt logprobs; pipelined steps, chunked prefill, prefix caching, n-gram
speculation), with preemption by recomputation and by swapping; KV heads split, and replicated where
there are fewer than ranks; sizes that do not divide the model are refused before any process starts;
a rank that dies is reported, not waited for."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from graphrt import LLM, ConfigError, EngineConfig, GraphrtError, SamplingParams
from graphrt.kv_cache import bytes_per_block
from graphrt.loader import open_checkpoint
from graphrt.models.config import ModelConfig
from graphrt.models.tensor_parallel import ShardLayout, check_divides

pytest.importorskip("transformers")

from fp8_checkpoint_files import write_fp8_checkpoint  # noqa: E402
from random_checkpoints import NAMES, write_random_checkpoint  # noqa: E402

PROMPTS = [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, 16, 17, 33)]


def _generate(model: str, tp: int, requests: list[SamplingParams], prompts=PROMPTS, **options):
    """Each prompt under each of ``requests``' params, in one batch: the outputs, and the engine's
    preemption count."""
    defaults = dict(dtype="float32", device="cpu", max_num_seqs=8, num_kv_blocks=96, block_size=4,
                    progress=False, tensor_parallel_size=tp)
    with LLM(model, **{**defaults, **options}) as llm:
        full, held = llm.engine.model_config, llm.engine.model.config
        assert (held.num_attention_heads, held.intermediate_size) == (full.num_attention_heads // tp,
                                                                      full.intermediate_size // tp)
        assert llm.engine.model.embed_tokens.weight.shape[0] == -(-full.vocab_size // tp)
        outputs = llm.generate([p for p in prompts for _ in requests], [r for _ in prompts for r in requests])
    return outputs


def _requests(max_tokens: int = 14) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=1.1, top_k=20, seed=5, max_tokens=max_tokens, ignore_eos=True),
    ]


def _assert_same_logprobs(x, y):
    assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
    assert [x.logprob, *(p for _, p in x.top)] == pytest.approx([y.logprob, *(p for _, p in y.top)], abs=1e-4)


def _assert_same_outputs(one, two):
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        assert len(a.logprobs or []) == len(b.logprobs or []) and len(a.prompt_logprobs or []) == len(
            b.prompt_logprobs or [])
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            _assert_same_logprobs(x, y)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (x is None) == (y is None)
            if x is not None:
                _assert_same_logprobs(x, y)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_give_one_ranks_tokens_on_hf_checkpoints(name, tmp_path):
    """llama3 rope scaling (2 KV heads: one a rank), Mistral's sliding window (4: two a rank), Qwen2's
    q/k/v bias and tied head (1 KV head: replicated); pipelined steps and chunks of 7 tokens."""
    path = tmp_path / name
    write_random_checkpoint(name, path)
    options = dict(async_decode=True, max_num_batched_tokens=7)
    one = _generate(str(path), 1, _requests(), **options)
    two = _generate(str(path), 2, _requests(), **options)
    assert all(o.logprobs and o.prompt_logprobs for o in two[::3])
    _assert_same_outputs(one, two)


def test_four_ranks_replicate_kv_heads_on_a_random_preset():
    """random:tiny has 4 query heads and 2 KV heads: over 4 ranks each KV head is held by two of them;
    the vocabulary (512) splits in 4. Speculation by prompt lookup runs its verify steps over the ranks."""
    requests = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                SamplingParams(temperature=0.8, seed=2, max_tokens=20, ignore_eos=True)]
    prompts = [p * 3 for p in PROMPTS[:2]]  # repeats, so prompt lookup finds drafts
    # Weights this small repeat themselves enough for prompt lookup's drafts to be accepted.
    options = dict(loader_options={"init_std": 0.05}, speculative={"method": "ngram", "num_tokens": 3})
    one = _generate("random:tiny", 1, requests, prompts, **options)
    four = _generate("random:tiny", 4, requests, prompts, **options)
    _assert_same_outputs(one, four)
    assert [o.speculative for o in four] == [o.speculative for o in one]
    assert sum(o.speculative.accepted_tokens for o in four) > 0


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_over_two_ranks(swap):
    """Too few KV blocks for every sequence: preempted sequences are recomputed or swapped out and in, on
    every rank alike, and the tokens are one rank's with the same blocks."""
    block_bytes = bytes_per_block(ShardLayout.of(open_checkpoint("random:tiny").config, 0, 2).config, 4,
                                  torch.float32)
    options = dict(loader_options={"init_std": 0.2}, num_kv_blocks=22, max_num_seqs=4, max_model_len=96,
                   swap_space_bytes=64 * block_bytes if swap else 0)
    requests = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True)]
    one = _generate("random:tiny", 1, requests, **options)
    two = _generate("random:tiny", 2, requests, **options)
    assert sum(o.num_preemptions for o in two) > 0
    _assert_same_outputs(one, two)


@pytest.mark.parametrize("form", ["quantized-at-load", "per-tensor-fp8", "compressed-tensors-channel"])
def test_fp8_weights_over_two_ranks_are_one_ranks(form, tmp_path):
    """FP8 layers split over ranks hold the one-rank model's codes and scales: stored per-tensor or per-row
    scales cut with their rows (kept whole for the o and down projections' columns), and a 16-bit
    weight quantized at load in whole rows before its columns are cut."""
    source = tmp_path / "bf16"
    write_random_checkpoint("llama3-rope-scaling", source)
    path = source
    if form != "quantized-at-load":
        path = tmp_path / form
        write_fp8_checkpoint(source, path, form)
    options = dict(quantization="fp8", num_kv_blocks=48, block_size=8)
    requests = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)]
    one = _generate(str(path), 1, requests, PROMPTS[:2], **options)
    two = _generate(str(path), 2, requests, PROMPTS[:2], **options)
    _assert_same_outputs(one, two)


def test_fp8_block_scales_across_the_split_are_refused(tmp_path):
    source = tmp_path / "bf16"
    write_random_checkpoint("llama3-rope-scaling", source)  # 2 KV heads of 64: a rank's k rows are half a block
    write_fp8_checkpoint(source, tmp_path / "blocks", "fine-grained-fp8")
    with pytest.raises(GraphrtError, match="scale blocks of 128 do not fall on the tensor-parallel split"):
        _generate(str(tmp_path / "blocks"), 2, [SamplingParams(max_tokens=1)], PROMPTS[:1])


def test_sizes_that_do_not_divide_the_model_are_refused_before_starting_ranks():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 does not divide .*num_attention_heads \(4\)"):
        LLM("random:tiny", device="cpu", tensor_parallel_size=3, progress=False)
    smol = open_checkpoint("random:smollm2-135m").config  # 9 heads, 3 KV heads, intermediate 1536
    with pytest.raises(ConfigError, match=r"num_attention_heads \(9\)"):
        check_divides(smol, 2)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(3, neither"):
        check_divides(ModelConfig("LlamaForCausalLM", 64, 64, 64, 1, 6, 3, 8, 64), 2)
    with pytest.raises(ConfigError, match="intermediate_size"):
        check_divides(ModelConfig("LlamaForCausalLM", 64, 64, 66, 1, 4, 4, 8, 64), 4)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
            EngineConfig(model="random:tiny", tensor_parallel_size=bad)
    with pytest.raises(ConfigError, match="speculative method 'draft' does not run with tensor_parallel_size"):
        EngineConfig(model="random:tiny", tensor_parallel_size=2,
                     speculative={"method": "draft", "model": "random:tiny", "num_tokens": 2})


def test_torchrun_with_another_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="WORLD_SIZE 4: start as many processes as ranks"):
        LLM("random:tiny", device="cpu", tensor_parallel_size=2, progress=False)


def test_a_rank_that_exits_is_reported():
    llm = LLM("random:tiny", dtype="float32", device="cpu", tensor_parallel_size=2, progress=False)
    try:
        process = llm.engine.ranks.processes[0]
        process.kill()
        process.join(30)
        with pytest.raises(GraphrtError, match="tensor-parallel rank.* 1 exited"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    finally:
        llm.close()
    assert not process.is_alive()


def _exit_soon(seconds: float) -> None:
    time.sleep(seconds)


def test_a_failed_collective_waits_for_the_rank_whose_exit_broke_it():
    """A killed rank's peers see its sockets close a moment before its exit registers: a broken collective
    names the rank once its exit shows within the wait, and says nothing of a rank that stays alive."""
    import multiprocessing

    from graphrt.distributed import RankGroup

    context = multiprocessing.get_context("spawn")
    leaving = context.Process(target=_exit_soon, args=(0.5,))
    leaving.start()
    try:
        group = RankGroup(rank=0, size=2, tensor_parallel=None, channel=None, processes=[leaving])
        assert group.failed_rank() is None  # not yet exited
        assert group.failed_rank(wait=30) == "tensor-parallel rank(s) 1 exited (exit code 0)"
    finally:
        leaving.join(30)
    staying = context.Process(target=_exit_soon, args=(30,))
    staying.start()
    try:
        assert RankGroup(rank=0, size=2, tensor_parallel=None, channel=None,
                         processes=[staying]).failed_rank(wait=0.3) is None
    finally:
        staying.kill()
        staying.join(30)


def test_an_interrupted_step_leaves_the_engine_refusing_and_closing_at_once():
    """Ctrl-C on rank 0 between relaying a step and running it (the other ranks then wait inside a
    forward rank 0 abandoned): later steps are refused by name and close stops the ranks instead of
    messaging them (it had waited for ever)."""
    llm = LLM("random:tiny", dtype="float32", device="cpu", tensor_parallel_size=2, progress=False)
    process = llm.engine.ranks.processes[0]
    try:
        local = llm.engine.runner._runner

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        local.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        with pytest.raises(GraphrtError, match="ranks are out of step; close this engine"):
            llm.engine.runner.execute([], [])
    finally:
        started = time.monotonic()
        llm.close()
    assert time.monotonic() - started < 20 and not process.is_alive()


SCRIPT_WITHOUT_GUARD = """
from graphrt import LLM
LLM("random:tiny", device="cpu", tensor_parallel_size=2, progress=False)
"""

TORCHRUN_SCRIPT_WITHOUT_CLOSE = """
from graphrt import LLM, SamplingParams
llm = LLM("random:tiny", device="cpu", dtype="float32", tensor_parallel_size=2, progress=False)
print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids)
"""


def test_a_script_without_the_main_guard_is_told_so(tmp_path):
    """Its spawned rank re-runs the script and fails before joining; rank 0 names the cause instead of
    waiting in the rendezvous (half an hour)."""
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT_WITHOUT_GUARD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "needs the `if __name__ == \"__main__\":` guard" in done.stderr


def test_a_torchrun_script_that_never_closes_exits_cleanly(tmp_path):
    script = tmp_path / "no_close.py"
    script.write_text(TORCHRUN_SCRIPT_WITHOUT_CLOSE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("[") == 1  # rank 0 printed; rank 1 served and exited


def test_the_cli_starts_its_ranks_or_joins_torchrun():
    """``graphrt generate --tensor-parallel-size 2`` prints one rank's tokens, whether it starts its second
    rank itself or torchrun starts both processes (rank 1 exits 0 once rank 0 closes)."""
    command = ["generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "6", "--prompt-ids",
               "5,9,13,17"]
    one = subprocess.run([sys.executable, "-m", "graphrt.cli", *command], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "graphrt.cli", *command, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=120)
    assert two.returncode == 0, two.stderr
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                               "graphrt.cli", *command, "--tensor-parallel-size", "2"],
                              capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr
    assert one.stdout.strip() and two.stdout == one.stdout == torchrun.stdout


def test_bench_times_engine_steps_over_two_ranks(tmp_path):
    """``graphrt bench --tensor-parallel-size 2`` prints and writes a row a point (no floor on the CPU);
    options that only a one-rank bench has are refused by name."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "graphrt.cli", "bench", "--model", "random:tiny", "--device", "cpu",
               "--tensor-parallel-size", "2", "--batch-sizes", "1,3", "--contexts", "20", "--steps", "3"]
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["tensor_parallel_size"] == 2
    assert [(r["batch_size"], r["context"]) for r in result["rows"]] == [(1, 20), (3, 20)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] is None and r["tokens_per_s"] > 0 for r in result["rows"])
    assert "unfinished" not in done.stderr
    refused = subprocess.run([*command, "--plot", str(tmp_path / "p.png")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "--plot apply to one rank's bench only" in refused.stderr


def test_every_engine_command_takes_tensor_parallel_size():
    from graphrt.cli import build_parser

    for command in ("generate", "chat", "serve", "bench", "bench-serving"):
        assert build_parser().parse_args([command, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_checkpoint_tensors_of_the_wrong_full_shape_are_refused():
    """A rank cuts its slice out of a checkpoint tensor only when the tensor has the full model's
    extent along the cut (a slice of a wrong one could otherwise pass the part's shape check)."""
    from graphrt.base.errors import ModelLoadError

    layout = ShardLayout.of(open_checkpoint("random:tiny").config, 1, 2)
    with pytest.raises(ModelLoadError, match="expects 256 rows"):
        layout.local_part("layers.0.self_attn.qkv_proj.weight", 0, torch.randn(300, 256), "model.layers.0.q_proj")
    with pytest.raises(ModelLoadError, match="expects 512 columns"):
        layout.local_part("layers.0.mlp.down_proj.weight", None, torch.randn(256, 500), "model.layers.0.down_proj")
    part = layout.local_part("embed_tokens.weight", None, torch.randn(512, 256), "model.embed_tokens.weight")
    assert part.shape == (256, 256)
    layout3 = ShardLayout.of(ModelConfig("LlamaForCausalLM", 10, 64, 64, 1, 4, 4, 8, 64), 3, 4)
    padded = layout3.local_part("lm_head.weight", None, torch.randn(10, 64), "lm_head.weight")
    assert padded.shape == (3, 64) and torch.equal(padded[1:], torch.zeros(2, 64))  # rows 9 and past the vocabulary


def test_fp8_block_scales_must_fall_on_the_split():
    """A block-scaled FP8 checkpoint splits along whole blocks only."""
    from graphrt.base.errors import ModelLoadError

    config = ModelConfig("LlamaForCausalLM", 64, 256, 384, 1, 4, 4, 64, 64)
    layout = ShardLayout.of(config, 1, 2)  # gate/up rows 192..384: not on 128-row blocks
    scale = torch.rand(3, 2)  # [ceil(384 / 128), 256 / 128]
    with pytest.raises(ModelLoadError, match="scale blocks of 128 do not fall on the tensor-parallel split"):
        layout.local_part("layers.0.mlp.gate_up_proj.weight_scale", 0, scale, "gate_proj.weight_scale", (128, 128))
    q = layout.local_part("layers.0.self_attn.qkv_proj.weight_scale", 0, torch.rand(2, 2), "q.weight_scale",
                          (128, 128))
    assert q.shape == (1, 2)  # q rows 128..256: the second row of blocks
