"""Every kind of bad input gets an error that names the problem; the rest of a batch still completes."""

from __future__ import annotations

import json

import pytest
import torch

from graphrt import LLM, ConfigError, InvalidRequestError, ModelLoadError, SamplingParams
from graphrt.cli import main

TINY = dict(model="random:tiny", dtype="float32", device="cpu", progress=False, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(**TINY)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ([1] * 64, "prompt has 64 tokens but max_model_len is 64"),
        ([1, 2, 512], "token id 512 is outside the vocabulary [0, 512)"),
        ([1, -3], "token id -3 is outside the vocabulary"),
        ([1, 2.5], "prompt token ids must be integers"),
        ("hello", "has no tokenizer"),
        (12, "a prompt must be a string or a list of token ids"),
    ],
)
def test_bad_prompt_is_rejected_by_name(llm, prompt, message):
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request(prompt, GREEDY)
    assert message in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_bad_requests_do_not_stop_the_batch(llm):
    good = [[5, 6, 7], [8, 9]]
    outputs = llm.generate([good[0], [], [1, 9999], good[1]], GREEDY)
    assert [o.finish_reason for o in outputs] == ["length", "error", "error", "length"]
    assert "prompt is empty" in outputs[1].error
    assert "token id 9999 is outside the vocabulary" in outputs[2].error
    alone = llm.generate(good, GREEDY)
    assert [outputs[0].token_ids, outputs[3].token_ids] == [o.token_ids for o in alone]


def test_malformed_prompts_do_not_stop_the_batch(llm):
    outputs = llm.generate([[5, 6, 7], 12, None], GREEDY)
    assert [o.finish_reason for o in outputs] == ["length", "error", "error"]
    assert "got int" in outputs[1].error and "got NoneType" in outputs[2].error
    assert not llm.engine.has_unfinished_requests()


def test_generate_leaves_other_requests_alone(llm):
    """A request added through the engine directly may share generate's steps without breaking it: it
    goes on after generate returns and finishes with the tokens it gets alone, and so does generate's."""
    other = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=5)
    mine = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seed=6)
    [other_alone] = llm.generate([[1, 2, 3]], other)
    [mine_alone] = llm.generate([[4, 5]], mine)
    llm.engine.add_request([1, 2, 3], other, request_id="0")
    [out] = llm.generate([[4, 5]], mine)
    assert out.finish_reason == "length" and out.request_id != "0"
    assert out.token_ids == mine_alone.token_ids
    assert llm.engine.has_unfinished_requests(), "generate ran request 0 to its end and kept its output"
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    assert list(finished) == ["0"]
    assert finished["0"].finish_reason == "length"
    assert finished["0"].token_ids == other_alone.token_ids


def test_request_larger_than_the_cache_is_rejected():
    small = LLM(**TINY, num_kv_blocks=3)  # 2 usable blocks = 32 tokens
    with pytest.raises(InvalidRequestError, match="cache has only 2 blocks"):
        small.engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=10))


def test_a_cache_shorter_than_the_models_context_lowers_the_default_max_model_len():
    # random:tiny's positions reach 2048; a cache of 3 usable blocks holds 3 * 16 + 1 tokens a sequence (the
    # last is sampled, never cached), so a server's default max_tokens (the room left) can run.
    small = LLM(model="random:tiny", dtype="float32", device="cpu", progress=False, num_kv_blocks=4)
    assert small.engine.max_model_len == 49
    [out] = small.generate([list(range(1, 9))], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
    assert len(out.token_ids) == 41


def test_an_explicit_max_model_len_beyond_the_cache_is_kept_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="graphrt.engine"):
        small = LLM(**{**TINY, "max_model_len": 100}, num_kv_blocks=4)
    assert small.engine.max_model_len == 100
    assert "max_model_len 100 is longer than the KV cache holds" in caplog.text


@pytest.mark.parametrize(("options", "message"), [
    (dict(block_size="16"), "block_size must be an integer >= 1, got '16'"),
    (dict(max_num_seqs=None), "max_num_seqs must be an integer >= 1, got None"),
    (dict(max_num_seqs=1.5), "max_num_seqs must be an integer >= 1, got 1.5"),
    (dict(max_model_len=3.5), "max_model_len must be None or an integer >= 2, got 3.5"),
    (dict(num_kv_blocks=3.0), "num_kv_blocks must be None or an integer >= 2, got 3.0"),
    (dict(kv_cache_bytes=-1), "kv_cache_bytes must be None or an integer >= 1, got -1"),
    (dict(max_capture_seq_len=-5), "max_capture_seq_len must be None or an integer >= 1"),
    (dict(seed=-1), "seed must be an integer >= 0, got -1"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number in (0, 1], got '0.5'"),
    (dict(capture_sizes=[0]), "capture_sizes must be None or a list of integers >= 1, got [0]"),
    (dict(enforce_eager="x"), "enforce_eager must be True or False, got 'x'"),
    (dict(async_decode="x"), "async_decode must be True, False or None (automatic), got 'x'"),
    (dict(fused_kernels="no"), "fused_kernels must be True, False or None (automatic), got 'no'"),
    (dict(loader_options=[1]), "loader_options must be a dict, got list"),
    (dict(loader_options={"bogus": 1}), "unknown loader_options ['bogus']: random presets take init_std and seed"),
    (dict(loader_options={"init_std": -1}), "loader_options init_std must be a finite number >= 0, got -1"),
    (dict(loader_options={"init_std": float("nan")}), "loader_options init_std must be a finite number >= 0"),
    (dict(loader_options={"seed": "x"}), "loader_options seed must be an integer >= 0, got 'x'"),
    (dict(model=None, loader_options={"seed": 3}), "loader_options init_std and seed draw random presets' weights"),
    (dict(device="tpu"), "unsupported device 'tpu'"),
    (dict(dtype=torch.int32), "unsupported dtype torch.int32"),
    (dict(model=123), "model must be a path, a GGUF file or random:PRESET"),
    (dict(model=""), "model must be a path, a GGUF file or random:PRESET"),
    (dict(swap_space=4), "unknown option 'swap_space'; did you mean 'swap_space_bytes'?"),
])
def test_engine_options_of_the_wrong_kind_are_refused_by_name(options, message):
    with pytest.raises(ConfigError) as refused:
        LLM(**{**TINY, **options})
    assert message in str(refused.value)


@pytest.mark.parametrize(("argv", "message"), [
    (["--swap-space-mib", "100000000"], "a swap space of"),
    (["--num-kv-blocks", "1000000000"], "a KV cache of 1000000000 blocks takes"),
])
def test_a_cache_larger_than_memory_is_refused_naming_the_option(argv, message, capsys):
    # Refused before the block tables or the tensors are built (a billion blocks' bookkeeping alone would
    # exhaust the host): the error names the size, the memory and the option to lower.
    assert main(["generate", "--model", "random:tiny", "--prompt-ids", "1,2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "more than" in err and argv[0] in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), [
    (([[1]], {"max_tokens": 2}), "got dict (build one: SamplingParams(**options))"),
    ((None,), "prompts must be a string, a list of token ids or a list of prompts, got NoneType"),
])
def test_generate_refuses_arguments_of_the_wrong_kind(llm, args, message):
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(*args)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("inf")), ("temperature", float("nan")),
     ("temperature", 1e39), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("seed", -1)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field) as refused:
        SamplingParams(**{field: value})
    assert refused.value.field == field


def test_sampling_params_changed_after_building_are_checked_on_arrival(llm):
    """Fields set after ``SamplingParams`` validated them are checked again when the request arrives
    (nothing queued), and a queued request keeps the values it arrived with."""
    for field, value in [("temperature", -1.0), ("top_p", 5.0), ("max_tokens", 0), ("seed", -5)]:
        changed = SamplingParams(temperature=0.8, max_tokens=3)
        setattr(changed, field, value)
        with pytest.raises(InvalidRequestError, match=field):
            llm.engine.add_request([1, 2, 3], changed)
        assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], params)[0]
    llm.engine.add_request([1, 2, 3], params, request_id="kept")
    params.max_tokens = 9
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update((o.request_id, o.token_ids) for o in llm.engine.step())
    assert outputs["kept"] == out.token_ids and len(out.token_ids) == 3


def test_generated_request_ids_skip_ids_a_caller_chose(llm):
    """A caller may pick an id of the generated form; the request that would have been generated that
    id gets another instead of being rejected."""
    number = int(llm.engine.add_request([1, 2], GREEDY).removeprefix("req-"))
    taken = f"req-{number + 2}"  # the next call takes number + 1; generate's first would get number + 2
    llm.engine.add_request([1, 2, 3], GREEDY, request_id=taken)
    outputs = llm.generate([[4, 5], [6, 7]], GREEDY)
    assert [o.error for o in outputs] == [None, None]
    assert len({o.request_id for o in outputs} | {taken}) == 3
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_stop_token_outside_vocab_is_rejected(llm):
    with pytest.raises(InvalidRequestError, match="stop token id 700"):
        llm.engine.add_request([1, 2], SamplingParams(stop_token_ids=[700]))


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="not found"):
        LLM("/no/such/model", device="cpu", progress=False)


def test_unknown_random_preset():
    with pytest.raises(ModelLoadError, match="unknown random preset 'huge'"):
        LLM("random:huge", device="cpu", progress=False)


def _write_config(path, **overrides):
    config = dict(
        architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=128,
    )
    config.update(overrides)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_architecture(tmp_path):
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"architecture GPT2LMHeadModel is not supported \(supported: Llama"):
        LLM(str(tmp_path), device="cpu", progress=False)


def test_a_config_naming_no_architecture_says_so(tmp_path):
    _write_config(tmp_path, architectures=None)
    with pytest.raises(ModelLoadError, match="names no architecture.*supported: Llama") as info:
        LLM(str(tmp_path), device="cpu", progress=False)
    assert "None" not in str(info.value)


def test_generate_refuses_an_empty_stop_string(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", "random:tiny", "--prompt-ids", "1,2", "--stop", ""])
    assert exited.value.code == 2
    assert "--stop: a stop string must not be empty" in capsys.readouterr().err


def test_an_other_familys_config_is_named_by_architecture_not_by_a_missing_field(tmp_path):
    """A GPT-2 config.json has n_embd, not hidden_size: the error names the architecture."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 768,
                                                      "n_layer": 12, "n_head": 12, "vocab_size": 50257}))
    with pytest.raises(ModelLoadError, match="architecture GPT2LMHeadModel is not supported") as info:
        LLM(str(tmp_path), device="cpu", progress=False)
    assert "hidden_size" not in str(info.value)


def test_unsupported_head_size(tmp_path):
    _write_config(tmp_path, head_dim=48, num_attention_heads=2)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="head size 48 is not supported"):
        LLM(str(tmp_path), device="cpu", progress=False)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(hidden_size="abc"), "hidden_size must be an integer, got 'abc'"),
    (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1, got 0"),
    (dict(hidden_size=-128), "hidden_size must be an integer >= 1, got -128"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id"),
    (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling \\(llama3\\) lacks 'factor'"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be a JSON object"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a finite number > 0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4,
                        "original_max_position_embeddings": 32}), "factor must be a finite number > 0, got 0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4,
                        "original_max_position_embeddings": 32}), "high_freq_factor must exceed low_freq_factor"),
], ids=["string_size", "zero_heads", "zero_layers", "negative_size", "string_bool", "string_eos",
        "rope_without_factor", "rope_list", "zero_eps", "rope_zero_factor", "rope_equal_bands"])
def test_malformed_config_is_refused_by_name(tmp_path, overrides, message):
    """A config.json field of the wrong type or out of range is named, not met later as a division by
    zero or a silently wrong model (a "false" string read as true)."""
    _write_config(tmp_path, **overrides)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), device="cpu", progress=False)


def test_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object, got list"):
        LLM(str(tmp_path), device="cpu", progress=False)


@pytest.mark.parametrize(("files", "message"), [
    ({"model.safetensors.index.json": "{"}, "is not a JSON object with a weight_map"),
    ({"model.safetensors.index.json": '{"weight_map": [1]}'}, "weight_map must map tensor names"),
    ({"model.safetensors": "not a safetensors header"}, "is not a readable safetensors file"),
], ids=["index_not_json", "index_weight_map_list", "corrupt_weights"])
def test_malformed_weight_files_are_refused_by_name(tmp_path, files, message):
    _write_config(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), device="cpu", progress=False)


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    (["bench", "--batch-sizes", ""], "argument --batch-sizes: expected comma-separated integers >= 1"),
    (["bench", "--contexts", "0"], "argument --contexts: expected comma-separated integers >= 1"),
    (["bench", "--query-tokens", "1,0"], "argument --query-tokens: expected comma-separated integers >= 1"),
    (["bench", "--json", "/no/such/folder/r.json"], "the folder '/no/such/folder' does not exist"),
    (["profile", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
    (["profile", "--trace", "/no/such/folder/t.json"], "the folder '/no/such/folder' does not exist"),
    (["generate", "--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got '0'"),
    (["chat", "--max-tokens", "-5"], "argument --max-tokens: expected an integer >= 1, got '-5'"),
], ids=["bench_steps", "bench_no_batches", "bench_zero_context", "bench_zero_query_tokens", "bench_json_folder",
        "profile_warmup",
        "profile_trace_folder", "generate_max_tokens", "chat_max_tokens"])
def test_cli_refuses_bad_numbers_and_output_folders_before_running(argv, message, capsys):
    """Checked when the arguments are parsed: a run must not fail at its end on a value it could have
    refused first (bench --steps 0 used to fail on an empty median after building the model)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--model", "random:tiny", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["integer", "twice"])
def test_weights_of_the_wrong_kind_are_refused_by_name(llm, fault):
    """An integer tensor, or one tensor met twice (in two weight files), would load as something no
    checkpoint meant: numbers cast from integers, or whichever file came last."""
    model = llm.engine.model
    norm = model.norm.weight.detach().clone()  # its own values: the model is left as it was
    weights = [("model.norm.weight", norm.to(torch.int32))] if fault == "integer" else \
        [("model.norm.weight", norm), ("model.norm.weight", norm)]
    message = "is torch.int32, not a floating-point weight" if fault == "integer" else \
        "holds tensor 'model.norm.weight' twice"
    with pytest.raises(ModelLoadError, match=message):
        model.load_weights(weights)


def test_pickle_weights_are_refused(tmp_path):
    _write_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="pickle"):
        LLM(str(tmp_path), device="cpu", progress=False)


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["generate", "--model", "/no/such/model", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrt: error: model '/no/such/model' not found")
    assert "Traceback" not in err


def test_serve_refuses_a_port_in_use_before_loading_the_model(monkeypatch, capsys):
    """A port another socket holds fails at once, naming it (the model is never loaded: LLM would raise);
    a host that does not resolve too."""
    import socket

    import graphrt.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(graphrt.llm, "LLM", no_load)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--model", "random:tiny", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"graphrt: error: cannot listen on 127.0.0.1:{port}: ") and "in use" in err
    assert main(["serve", "--model", "random:tiny", "--device", "cpu", "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.startswith("graphrt: error: cannot listen on no-such-host.invalid:8000: ")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", ""])
def test_serve_port_check_takes_the_hosts_the_server_takes(host):
    """Every interface (an empty host), a name resolving to IPv4 and IPv6, any port (0): not refused."""
    from graphrt.serve.server import check_can_listen

    check_can_listen(host, 0)


def test_cli_bad_request_exits_nonzero_but_prints_the_good_ones(capsys):
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "3",
                 "--prompt-ids", "1,2,3", "--prompt-ids", "1,600", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["finish_reason"] for line in lines] == ["length", "error"]
    assert len(lines[0]["token_ids"]) == 3
    assert "prompt 2: token id 600 is outside the vocabulary" in captured.err


@pytest.mark.parametrize("ids", ["1,,3", "1,2,", ",1", " , "])
def test_cli_refuses_empty_items_in_token_id_lists(ids, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "random:tiny", "--prompt-ids", ids])
    assert exit_info.value.code == 2
    assert f"expected comma-separated integers, got {ids!r} (an empty item)" in capsys.readouterr().err


def test_cli_invalid_sampling_parameter(capsys):
    assert main(["generate", "--model", "random:tiny", "--prompt-ids", "1", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_numpy_token_ids_are_one_prompt(llm):
    """Token ids as NumPy integers (a tokenizer's or a dataset's array) are one prompt, as Python ints are."""
    import numpy as np

    ids = np.array([5, 6, 7])
    [from_numpy] = llm.generate(list(ids), GREEDY)
    [from_ints] = llm.generate([5, 6, 7], GREEDY)
    assert from_numpy.error is None and from_numpy.token_ids == from_ints.token_ids
    [nested] = llm.generate([list(ids)], GREEDY)
    assert nested.prompt_token_ids == [5, 6, 7] and type(nested.prompt_token_ids[0]) is int


@pytest.mark.parametrize(("backend", "message"), [("flash", "attention_backend: unknown attention backend 'flash'"),
                                                  ("triton", "attention_backend: attention backend 'triton' cannot run")])
def test_an_attention_backend_that_cannot_run_is_refused_by_name(backend, message):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton backend runs on CUDA")
    with pytest.raises(ConfigError, match=message):
        LLM(**TINY, attention_backend=backend)


def test_a_prompt_that_leaves_too_little_room_warns_or_is_refused_when_strict(caplog, capsys):
    """A 28-token prompt under max_model_len 32 has room for 4 of 8 tokens asked: a warning, then a run
    that stops at the room; with strict_max_tokens (CLI --strict) the request is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 31))
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=32, progress=False) as llm:
        with caplog.at_level("WARNING", logger="graphrt.engine"):
            [out] = llm.generate([prompt], params)
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        assert "prompt of 28 tokens leaves room for 4 of the 8 tokens asked (max_model_len 32)" in caplog.text
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=32, strict_max_tokens=True,
             progress=False) as llm:
        [refused] = llm.generate([prompt], params)
        [fits] = llm.generate([prompt[:20]], params)
    assert refused.finish_reason == "error" and "lower max_tokens or raise max_model_len" in refused.error
    assert fits.finish_reason == "length" and len(fits.token_ids) == 8
    ids = ",".join(map(str, prompt))
    assert main(["generate", "--model", "random:tiny", "--device", "cpu", "--max-model-len", "32",
                 "--prompt-ids", ids, "--max-tokens", "8", "--strict"]) != 0
    assert "leaves room for 4 of the 8 tokens asked" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="strict_max_tokens must be True or False"):
        LLM("random:tiny", device="cpu", strict_max_tokens="yes")


def test_a_request_the_cache_cannot_hold_is_refused_without_a_length_warning(caplog):
    """max_model_len above what the KV cache holds: a request that may grow past the cache is refused,
    and not first told where max_model_len would stop it (the two messages used to contradict)."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with LLM("random:tiny", device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=8, block_size=16,
             progress=False) as llm:
        with caplog.at_level("WARNING", logger="graphrt.engine"):
            [out] = llm.generate([[1, 2, 3]], params)
    assert out.finish_reason == "error" and "but the cache has only 7 blocks" in out.error
    assert "stops there" not in caplog.text and "leaves room" not in caplog.text


def test_cli_version(capsys):
    import graphrt

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"graphrt {graphrt.__version__}"


def test_a_refused_allocation_is_named_and_other_errors_pass_through():
    from graphrt.kv_cache import allocation_named

    with pytest.raises(ConfigError, match=r"a KV cache of 9 blocks of 1.00 GiB could not be allocated on cpu "
                                          r"\(DefaultCPUAllocator: can't allocate memory\); lower it"):
        with allocation_named("a KV cache of 9 blocks", 2**30, torch.device("cpu"), "cpu", "lower it"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore detail")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with allocation_named("a KV cache", 1, torch.device("cpu"), "cpu", "lower it"):
            raise RuntimeError("shape mismatch")


def test_weights_holding_nan_or_infinity_are_refused_by_name(tmp_path):
    """A corrupt or overflowed tensor would make every logit NaN: the load names it instead."""
    pytest.importorskip("transformers")
    from random_checkpoints import write_random_checkpoint
    from safetensors.torch import load_file, save_file

    write_random_checkpoint("llama3-rope-scaling", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 7] = float("nan")
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"NaN or infinite values: layers\.1\.mlp\.down_proj\.weight, norm\.weight"):
        LLM(str(tmp_path), device="cpu", dtype="float32", progress=False)


def test_fp8_codes_that_are_nan_are_refused_by_name():
    with LLM("random:tiny", device="cpu", dtype="float32", quantization="fp8", progress=False) as llm:
        model = llm.engine.model
        model.check_finite()  # a clean model passes
        codes = model.layers[0].self_attn.qkv_proj.weight
        codes.view(torch.uint8)[5, 9] = 0xFF  # -NaN in E4M3FN
        with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.qkv_proj\.weight"):
            model.check_finite()


def test_a_prompt_longer_than_a_small_cache_holds_names_the_cache():
    """max_model_len left to the model, lowered to what 3 blocks hold: the refusal says so."""
    with LLM("random:tiny", dtype="float32", device="cpu", progress=False, num_kv_blocks=3, block_size=16) as small:
        with pytest.raises(InvalidRequestError) as err:
            small.engine.add_request(list(range(1, 40)), GREEDY)
    assert "prompt has 39 tokens but max_model_len is 33 (lowered from 2048" in str(err.value)  # the last token needs no slot
    assert "KV cache's 3 blocks of 16 tokens hold, one of them reserved" in str(err.value)


def test_a_checkpoint_missing_a_projection_names_it_and_its_folder(tmp_path):
    """One of q/k/v gone: the error names the checkpoint's tensor (not the fused parameter) and the folder."""
    pytest.importorskip("transformers")
    from random_checkpoints import write_random_checkpoint
    from safetensors.torch import load_file, save_file

    write_random_checkpoint("llama3-rope-scaling", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert str(info.value) == f"{tmp_path}: checkpoint lacks weights for layers.1.self_attn.k_proj.weight"
