"""NVTX ranges as Nsight would see them: a CPU generate runs in a subprocess with a small NVTX tool
injected (``nvtx_injection.c``) that records every domain, push and pop; the tests read that record.
Plus in-process checks of the off path (no NVTX call at all) and of the message cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import nvtx_injection
import pytest

from graphrt import LLM, SamplingParams
from graphrt.base import nvtx as graphrt_nvtx

ROOT = Path(__file__).resolve().parents[1]

#: Every message graphrt documents, by range name (graphrt/nvtx.py, README "Profiling with Nsight").
FORMATS = {
    "load": r"load",
    "step": r"step",
    "schedule": r"schedule",
    "prefill": r"prefill seqs=[1-9]\d* tokens=[1-9]\d*",
    "decode": r"decode batch=[1-9]\d*",
    "decode.prepare": r"decode\.prepare",
    "decode.wait": r"decode\.wait",
    "decode.replay": r"decode\.replay batch=[1-9]\d* padded=[1-9]\d*",
    "decode.eager": r"decode\.eager batch=[1-9]\d* reason=[a-z_]+",
    "sample": r"sample",
    "capture": r"capture bucket=[1-9]\d*",
    "layer": r"layer \d+",
}
#: Where each range may sit: the name of the innermost enclosing range (None = outermost).
PARENTS = {
    "load": {None},
    "step": {None},
    "schedule": {"step"},
    "prefill": {"step"},
    "decode": {"step"},
    "sample": {"step"},
    "decode.eager": {"decode"},
    "decode.wait": {"decode", "step"},
    "layer": {"prefill", "decode", "decode.eager"},
}
PROMPTS = ["1,2,3", "4,5,6,7,8,9,10,11", "12,13,14,15,16"]  # 3, 8 and 5 tokens
MAX_TOKENS = 4
NUM_LAYERS = 2  # random:tiny


@pytest.fixture(scope="module")
def tool(tmp_path_factory) -> Path:
    try:
        return nvtx_injection.build(tmp_path_factory.mktemp("nvtx_tool"))
    except nvtx_injection.ToolUnavailable as exc:
        pytest.skip(str(exc))


def _run(tool: Path, record: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repo root with the tool attached; NVTX switches only from ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHRT_NVTX", "NVTX_"))}
    full_env.update(nvtx_injection.tool_env(tool, record), **env)
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _generate(tool: Path, record: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    args = ["-m", "graphrt.cli", "generate", "--model", "random:tiny", "--device", "cpu", "--ignore-eos",
            "--max-tokens", str(MAX_TOKENS), *flags]
    for prompt in PROMPTS:
        args += ["--prompt-ids", prompt]
    return _run(tool, record, args, env or {}).stdout


def _check_formats_and_nesting(record: nvtx_injection.Record) -> None:
    for r in record.ranges:
        assert r.domain == "graphrt", r
        assert r.name in FORMATS and re.fullmatch(FORMATS[r.name], r.message), f"undocumented message {r.message!r}"
        if r.name in PARENTS:
            assert r.parent in PARENTS[r.name], f"{r.message!r} inside {r.parents}"


def test_generate_emits_documented_ranges_properly_nested(tool, tmp_path):
    record_path = tmp_path / "record.tsv"
    _generate(tool, record_path, env={"GRAPHRT_NVTX": "1"})
    record = nvtx_injection.read(record_path)  # also asserts every pop matches a push

    assert record.initialized and record.domains == ["graphrt"]
    _check_formats_and_nesting(record)
    messages = [r.message for r in record.ranges]
    names = [r.name for r in record.ranges]
    assert {"load", "step", "schedule", "prefill", "decode", "decode.eager", "sample"} <= set(names)
    assert "layer" not in names  # the layer switch is separate
    assert names.count("load") == 1 and names[0] == "load"
    # One step prefills all three prompts, then MAX_TOKENS - 1 steps decode them together.
    assert names.count("step") == names.count("schedule") == MAX_TOKENS
    assert messages.count("prefill seqs=3 tokens=16") == 1
    assert messages.count("decode batch=3") == MAX_TOKENS - 1
    assert messages.count("decode.eager batch=3 reason=no_cuda") == MAX_TOKENS - 1
    assert names.count("sample") == 1  # decode steps sample inside the graph runner's forward


def test_mixed_step_names_both_forwards_and_config_field_turns_ranges_on(tool, tmp_path):
    # Two sequence slots: "a" finishes after 2 tokens, so "c" prefills in a step where "b" decodes.
    script = textwrap.dedent("""
        from graphrt import LLM, SamplingParams
        llm = LLM("random:tiny", device="cpu", max_num_seqs=2, progress=False, nvtx=True)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 6, 3)]
        llm.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]], params)
    """)
    record_path = tmp_path / "record.tsv"
    _run(tool, record_path, ["-c", script], env={})
    record = nvtx_injection.read(record_path)

    assert record.domains == ["graphrt"]
    _check_formats_and_nesting(record)
    steps: list[list[str]] = []
    for r in record.ranges:
        if r.name == "step":
            steps.append([])
        elif len(r.parents) == 1:
            steps[-1].append(r.message)
    assert steps[0] == ["schedule", "prefill seqs=2 tokens=7", "sample"]
    # The prefill of "c" runs eagerly, then "b"'s decode: two forwards in one step.
    mixed = ["schedule", "prefill seqs=1 tokens=5", "sample", "decode batch=1"]
    assert mixed in steps, steps


def test_layer_switch_adds_one_range_per_layer_inside_each_forward(tool, tmp_path):
    record_path = tmp_path / "record.tsv"
    _generate(tool, record_path, "--nvtx-layers")
    record = nvtx_injection.read(record_path)

    _check_formats_and_nesting(record)
    forwards = [r for r in record.ranges if r.name in ("prefill", "decode.eager")]
    layers = [r for r in record.ranges if r.name == "layer"]
    assert len(forwards) == MAX_TOKENS
    assert [r.message for r in layers] == [f"layer {i}" for i in range(NUM_LAYERS)] * len(forwards)
    assert all(r.parents[0] == "step" for r in layers)


@pytest.mark.parametrize("env", [{}, {"GRAPHRT_NVTX": "0", "GRAPHRT_NVTX_LAYERS": "0"}], ids=["unset", "zero"])
def test_off_creates_no_domain_and_no_ranges(tool, tmp_path, env):
    off_path, on_path = tmp_path / "off.tsv", tmp_path / "on.tsv"
    off_output = _generate(tool, off_path, env=env)
    record = nvtx_injection.read(off_path)
    assert record.domains == [] and record.events == [], record
    # The same tool sees the flag's ranges, and ranges observe without changing what is generated.
    assert _generate(tool, on_path, "--nvtx") == off_output
    assert nvtx_injection.read(on_path).domains == ["graphrt"]


# -- in process ------------------------------------------------------------------------------------


@pytest.fixture
def nvtx_state(monkeypatch):
    """Let a test switch graphrt.base.nvtx's process-wide state; it is restored (and caches emptied) after."""
    for name in ("_enabled", "_layers", "_domain", "_push", "_pop"):
        monkeypatch.setattr(graphrt_nvtx, name, getattr(graphrt_nvtx, name))
    for name in ("GRAPHRT_NVTX", "GRAPHRT_NVTX_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    yield graphrt_nvtx
    for cache in (graphrt_nvtx._named, graphrt_nvtx._prefills, graphrt_nvtx._decodes, graphrt_nvtx._replays,
                  graphrt_nvtx._eagers, graphrt_nvtx._captures, graphrt_nvtx._layer_ranges):
        cache.clear()


def _every_range(nvtx):
    return [nvtx.range("step"), nvtx.prefill(2, 9), nvtx.prefill(1, 5), nvtx.decode(4),
            nvtx.decode_prepare(), nvtx.decode_replay(3, 4), nvtx.decode_eager(4, "no_cuda"), nvtx.capture(8),
            nvtx.layer(0)]


def test_off_path_makes_no_nvtx_call(nvtx_state, monkeypatch):
    class Poisoned(types.ModuleType):
        def __getattr__(self, name):
            raise AssertionError(f"nvtx.{name} used while NVTX is off")

    def poisoned(*args, **kwargs):
        raise AssertionError("NVTX call while off")

    monkeypatch.setitem(sys.modules, "nvtx", Poisoned("nvtx"))
    monkeypatch.setattr(graphrt_nvtx, "_push", poisoned)
    monkeypatch.setattr(graphrt_nvtx, "_pop", poisoned)
    monkeypatch.setattr(graphrt_nvtx, "_domain", types.SimpleNamespace(get_event_attributes=poisoned))

    llm = LLM("random:tiny", device="cpu", progress=False, max_num_seqs=2)  # configures NVTX off
    assert not nvtx_state.enabled() and not nvtx_state.layers_enabled()
    outputs = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in outputs)
    for r in _every_range(nvtx_state):
        assert r is nvtx_state.NULL_RANGE
        with r:
            pass


class FakeDomain:
    """Stands in for nvtx.Domain: attributes are the message; pushes and pops are logged."""

    def __init__(self):
        self.built: list[str] = []
        self.log: list[str] = []

    def get_event_attributes(self, message, color=None):
        self.built.append(message)
        return message

    def push_range(self, attributes):
        self.log.append(attributes)

    def pop_range(self):
        self.log.append("pop")


def test_messages_are_formatted_as_documented_and_built_once(nvtx_state, monkeypatch):
    domain = FakeDomain()
    monkeypatch.setattr(nvtx_state, "_attach", lambda: nvtx_state._activate(domain) or True)
    assert nvtx_state.configure(layers=True) and nvtx_state.enabled() and nvtx_state.layers_enabled()
    assert domain.built == list(nvtx_state.STATIC_NAMES)  # built as soon as the tool was found
    for _ in range(3):
        for r in _every_range(nvtx_state):
            with r:
                pass
    expected = ["step", "prefill seqs=2 tokens=9", "prefill seqs=1 tokens=5", "decode batch=4",
                "decode.prepare", "decode.replay batch=3 padded=4", "decode.eager batch=4 reason=no_cuda",
                "capture bucket=8", "layer 0"]
    dynamic = [m for m in expected if m not in nvtx_state.STATIC_NAMES]
    assert domain.built == list(nvtx_state.STATIC_NAMES) + dynamic  # each message built once
    assert domain.log == [entry for message in expected for entry in (message, "pop")] * 3
    for message in expected:
        name = message.split(" ", 1)[0]
        assert re.fullmatch(FORMATS[name], message)


def test_exceptions_pass_through_ranges_which_still_pop(nvtx_state, monkeypatch):
    with pytest.raises(KeyError):
        with nvtx_state.NULL_RANGE:
            raise KeyError("off")
    domain = FakeDomain()
    nvtx_state._activate(domain)
    monkeypatch.setattr(nvtx_state, "_enabled", True)
    with pytest.raises(KeyError):
        with nvtx_state.range("step"), nvtx_state.decode(2):
            raise KeyError("on")
    assert domain.log == ["step", "decode batch=2", "pop", "pop"]


def test_message_cache_is_bounded(nvtx_state, monkeypatch):
    domain = FakeDomain()
    nvtx_state._activate(domain)
    monkeypatch.setattr(nvtx_state, "_enabled", True)
    monkeypatch.setattr(nvtx_state, "MAX_CACHED_MESSAGES", 4)
    domain.built.clear()
    for batch in range(1, 11):
        with nvtx_state.decode(batch):
            pass
    assert list(nvtx_state._decodes) == [7, 8, 9, 10]  # the oldest went first
    with nvtx_state.decode(10):  # still cached: not rebuilt
        pass
    assert len(domain.built) == 10


def test_env_turns_ranges_on_and_layers_imply_ranges(nvtx_state, monkeypatch):
    monkeypatch.setattr(nvtx_state, "_attach", lambda: True)
    assert not nvtx_state.configure()
    monkeypatch.setenv("GRAPHRT_NVTX", "1")
    assert nvtx_state.configure() and not nvtx_state.layers_enabled()
    monkeypatch.delenv("GRAPHRT_NVTX")
    monkeypatch.setenv("GRAPHRT_NVTX_LAYERS", "1")
    assert nvtx_state.configure() and nvtx_state.layers_enabled()


@pytest.mark.skipif("NVTX_INJECTION64_PATH" in os.environ, reason="an NVTX tool is attached to this process")
def test_without_a_tool_ranges_stay_off(nvtx_state, caplog):
    assert nvtx_state.configure(enabled=True) is False
    assert not nvtx_state.enabled() and nvtx_state.range("step") is nvtx_state.NULL_RANGE
    assert "no NVTX tool is attached" in caplog.text
