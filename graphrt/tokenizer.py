"""Text <-> token ids and chat-template rendering, over a ``tokenizers.Tokenizer``.

Two sources: an HF model directory (``tokenizer.json`` + ``tokenizer_config.json``) and the
metadata of a GGUF file (vocabulary, merges and special ids under ``tokenizer.ggml.*``), which
carries no ``tokenizer.json`` and so has its byte-level BPE rebuilt here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from .errors import GraphrtError, InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import gguf

# llama.cpp's token_type values (llama_token_type in llama.h).
_CONTROL = 3
_USER_DEFINED = 4

# GPT-2's split with Llama 3's changes: case-insensitive contractions, a leading non-letter glued
# to a word, digits in groups of at most three, newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: as Llama 3's, but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's split.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM/StarCoder: every digit isolated first, then GPT-2's split on each piece. This is both
    # llama.cpp's `smollm` rule (regexes "\p{N}" then GPT-2's) and the original tokenizer.json.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        # The regex does the splitting, so ByteLevel only maps bytes to its alphabet.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


class _PreRule(NamedTuple):
    """How llama.cpp treats a ``tokenizer.ggml.pre`` type, matching the original tokenizer.json."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    #: A pre-token that is itself in the vocabulary is taken whole, merges or not (Llama 3).
    ignore_merges: bool = False
    #: Whether BOS is prepended when the file has no ``tokenizer.ggml.add_bos_token``.
    add_bos: bool = False


_LLAMA3_RULE = _PreRule(_split_pre(_LLAMA3_SPLIT), ignore_merges=True, add_bos=True)

#: ``tokenizer.ggml.pre`` value -> its rule.
_GGUF_PRE_RULES: dict[str, _PreRule] = {
    "default": _PreRule(_gpt2_pre),
    "gpt2": _PreRule(_gpt2_pre),
    "smollm": _PreRule(_digits_then_gpt2_pre),
    "starcoder": _PreRule(_digits_then_gpt2_pre),
    "llama-bpe": _LLAMA3_RULE,
    "llama3": _LLAMA3_RULE,
    "llama-v3": _LLAMA3_RULE,
    "qwen2": _PreRule(_split_pre(_QWEN2_SPLIT)),
}


class Tokenizer:
    """Encodes text to token ids (``list[int]``) and back, and renders chat templates.

    ``encode`` never runs the backend's post-processor: the one special token a prompt gets, BOS,
    is prepended here when ``add_bos_token`` says so, whatever the source.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: tuple[str, ...] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        ids = (backend.token_to_id(t) for t in eos_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token and self.bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (may be below the model's padded embedding rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer | None:
        """Read ``tokenizer.json`` from an HF model directory; None when the directory has none.

        Like transformers 5, whether BOS is prepended follows ``tokenizer.json``'s post-processor;
        ``tokenizer_config.json``'s ``add_bos_token`` counts only when there is no post-processor.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed JSON
            raise ModelLoadError(f"{path / 'tokenizer.json'} cannot be read: {exc}") from None
        config = _read_json(path / "tokenizer_config.json") or {}
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))
        if backend.post_processor is not None and bos is not None:
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bool(probe) and probe[0] == backend.token_to_id(bos)
        else:
            add_bos = bool(config.get("add_bos_token", False))
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=(eos,) if eos is not None else (),
            chat_template=_hf_chat_template(path, config),
            add_bos_token=add_bos,
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer a GGUF file describes in ``tokenizer.ggml.*``.

        Control tokens (token_type 3, e.g. ``<|im_start|>``) become special added tokens and
        user-defined ones (type 4) plain added tokens, so each is matched whole in text.
        Raises ModelLoadError for a non-BPE vocabulary or an unknown pre-tokenizer.
        """
        model = _field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported; graphrt reads byte-level BPE ('gpt2') only"
            )
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_RULES:
            raise ModelLoadError(
                f"GGUF pre-tokenizer {pre!r} is not supported; graphrt knows {', '.join(sorted(_GGUF_PRE_RULES))}"
            )
        rule = _GGUF_PRE_RULES[pre]
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
        merges: list[str] = _field(reader, "tokenizer.ggml.merges", [])
        token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [])
        if tokens is None:
            raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens")

        # A merge is "left right"; neither side can hold a space, which byte-level spells as "Ġ".
        bpe = models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=rule.ignore_merges,
        )
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = rule.build()
        backend.decoder = decoders.ByteLevel()
        # normalized=False: these are matched in the raw text, before byte-level mapping.
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
        )

        def token_at(key: str) -> str | None:
            index = _field(reader, key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        # llama.cpp ends generation at EOS, and also at EOT/EOM where a file names them.
        eos = tuple(t for t in map(token_at, ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                              "tokenizer.ggml.eom_token_id")) if t is not None)
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_tokens=eos,
            chat_template=_field(reader, "tokenizer.chat_template"),
            add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", rule.add_bos)),
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS first only if ``add_special_tokens`` and ``add_bos_token``.

        Special tokens written in the text (``<|im_start|>``) encode to their single id either way.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence decodes to U+FFFD, as in HF."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the model's chat template.

        Returns text that already holds its special tokens: encode it with ``add_special_tokens=False``.
        Raises GraphrtError when the model has no template and InvalidRequestError when the template
        rejects the messages (its ``raise_exception``).
        """
        if self.chat_template is None:
            raise GraphrtError("model has no chat template")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from None


# ---------------------------------------------------------------------- chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates (and HF) want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come with downloaded models, so they run sandboxed: no attribute tricks, no mutation
    # of the objects they are given. trim_blocks/lstrip_blocks are what HF renders with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not parse: {exc}") from None


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # transformers gives a separate chat_template.jinja priority over tokenizer_config.json.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------- helpers


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()
