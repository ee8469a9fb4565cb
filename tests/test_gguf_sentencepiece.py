"""GGUF files with a SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``: Llama 2, Mistral,
TinyLlama) against the references for the same vocabulary.

A small SentencePiece BPE model is trained here as Llama's was (identity normalization, spaces kept
as they are, digits split, byte fallback), with one control and one user-defined symbol besides
``<unk>``, ``<s>`` and ``</s>``, and written with its pieces, scores and types into a tiny random
Llama GGUF. The references:

- sentencepiece's own ``SentencePieceProcessor`` on the trained ``.model``: the tokenizer the
  vocabulary was made with. It reads no special tokens in text (it spells ``<s>`` out byte by
  byte), so it is the reference for text without them, and it matches the user-defined symbol
  after its dummy prefix where the others split it off first (``SENTENCEPIECE_DEVIATIONS``). It
  decodes an invalid UTF-8 byte run differently from HF (it keeps the valid bytes where HF writes
  one U+FFFD per byte token), so it is the decode reference only for ids that encode text.
- transformers' slow, sentencepiece-backed tokenizer (``SentencePieceBackend``, legacy mode: in
  transformers 5 ``LlamaTokenizer`` itself is the ``tokenizers``-backed class) on the same
  ``.model``, with the control symbol as a special token and the user-defined one as an added
  token, as an HF ``tokenizer_config.json`` lists them: the encode reference for every string. It
  adds no BOS itself and its decode joins pieces without byte fallback, so BOS and decoding are
  checked against the others.
- transformers' fast ``LlamaTokenizerFast``, built from the ``.model`` by transformers' own
  sentencepiece extractor (loading the ``.model`` directly needs protobuf), and transformers' own
  GGUF tokenizer loading of the written file: they agree with each other and with graphrt on
  every decode, and on every encode outside the two rules pinned in ``HF_FAST_DEVIATIONS``.
  transformers' GGUF loading ignores ``tokenizer.ggml.add_space_prefix`` (see test_no_space_prefix).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
import regex

from graphrt.base.errors import ModelLoadError
from graphrt.loader.gguf_file import read_gguf
from graphrt.loader.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

CONTROL_SYMBOL = "<ctl>"
USER_DEFINED_SYMBOL = "<tool>"
ADDED_TOKENS = ("<unk>", "<s>", "</s>", CONTROL_SYMBOL, USER_DEFINED_SYMBOL)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token }}[INST] "
    "{{ message['content'] }} [/INST]{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# Written by hand so that training sees mixed case, digits, punctuation, runs of spaces, tabs,
# newlines and a few scripts; characters below the coverage threshold (and everything in STRINGS
# that is not here) fall back to bytes.
_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!",
    "A journey of a thousand miles begins with a single step.",
    "Café au lait, naïve résumé, façade, Ångström and jalapeño.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 42, 3.14159, 2024-01-31, 1,234,567.",
    "Hello,   world!  Several   spaces   between   words.",
    "\tIndented with a tab\tand\ttabs inside.",
    "def square(x):\n    return x * x  # a comment\n",
    "for (int i = 0; i < n; ++i) { total += values[i]; }",
    "Email me at someone@example.com or call +1 (555) 010-0199.",
    "Привет, мир! Как дела? Всё хорошо.",
    "Καλημέρα κόσμε, τι κάνεις;",
    "こんにちは世界、今日はいい天気ですね。",
    "Question? Answer! Quote: \"yes\" -- or 'no'; (maybe) [sure] {ok}.",
    "She said: it's fine, isn't it? We'll see; they've gone.",
    "Line one\nLine two\n\nLine four after a blank line",
    "apple banana cherry date elderberry fig grape",
]
CORPUS = [f"{line} ({i % 7}{i % 3})" if i % 4 else line for i in range(12) for line in _CORPUS_LINES]

STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\nmixed\n\n\nend",
    "  \n  x",
    "UPPER lower MiXeD",
    "digits 0123456789 and 3.14159, -42, 1e-9",
    "Café naïve résumé Ångström",
    "Zürich Øresund łódź ğüşiöç",
    "你好，世界！这是一个测试。",
    "emoji 😀👍🏽 and a flag 🇫🇷",
    "combining e\u0301 and \u00a0non-breaking\u2003em\u200bzero-width",
    "Привет, мир!",
    "unseen words: xylophone quixotic zephyr",
    "\u2581already a piece space",
    "<0x41> is text, not a byte token",
    "<s>",
    "<s>Hello</s>",
    "a<s>b",
    "hi <s> there",
    "</s> at the start",
    "the end</s>",
    "<unk> typed",
    f"{CONTROL_SYMBOL}",
    f"a{CONTROL_SYMBOL}b",
    f"{USER_DEFINED_SYMBOL}call",
    f"x {USER_DEFINED_SYMBOL} y",
    f"<s>[INST] hi {USER_DEFINED_SYMBOL}[/INST]",
    "<s <<s>> s>",
]
ADDED_TOKEN_SPLIT = regex.compile("(" + "|".join(regex.escape(t) for t in ADDED_TOKENS) + ")")

# Where transformers' fast Llama tokenizers place the space prefix differently; the rules are in
# test_hf_fast_prefix_rule_deviations.
HF_FAST_DEVIATIONS = {  # text: (graphrt's pieces, HF fast's pieces)
    " The fox": (["▁▁", "T", "he", "▁fox"], ["▁The", "▁fox"]),
    "<s>The fox": (["<s>", "▁The", "▁fox"], ["<s>", "T", "he", "▁fox"]),
    "fox <s> jumps": (["▁fox", "▁", "<s>", "▁▁", "j", "umps"], ["▁fox", "▁", "<s>", "▁j", "umps"]),
    f"{USER_DEFINED_SYMBOL}fox": ([USER_DEFINED_SYMBOL, "▁fox"], [USER_DEFINED_SYMBOL, "f", "ox"]),
    f"a{CONTROL_SYMBOL}fox": (["▁a", CONTROL_SYMBOL, "▁fox"], ["▁a", CONTROL_SYMBOL, "f", "ox"]),
}


# Where SentencePiece itself handles the user-defined symbol differently; see
# test_user_defined_symbol_is_split_off_before_the_prefix.
SENTENCEPIECE_DEVIATIONS = {  # text: (graphrt's pieces, SentencePiece's pieces)
    f"{USER_DEFINED_SYMBOL}fox": ([USER_DEFINED_SYMBOL, "▁fox"], ["▁", USER_DEFINED_SYMBOL, "f", "ox"]),
    f"fox{USER_DEFINED_SYMBOL}fox": (
        ["▁fox", USER_DEFINED_SYMBOL, "▁fox"], ["▁fox", USER_DEFINED_SYMBOL, "f", "ox"]),
}


def _hf_fast_deviates(text: str) -> bool:
    """Whether one of the two rules behind HF_FAST_DEVIATIONS applies to ``text``."""
    first, *rest = ADDED_TOKEN_SPLIT.split(text)
    return first.startswith((" ", "\u2581")) or any(part for part in rest[1::2])


# ---------------------------------------------------------------------- the trained vocabulary


class Vocabulary(NamedTuple):
    """A trained SentencePiece model and what a GGUF converter writes from it."""

    model_file: Path
    processor: Any  # sentencepiece.SentencePieceProcessor
    pieces: list[str]
    scores: list[float]
    #: llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    token_types: list[int]


def _train(folder: Path, add_dummy_prefix: bool = True) -> Vocabulary:
    (folder / "corpus.txt").write_text("\n".join(CORPUS), encoding="utf-8")
    prefix = folder / "spm"
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(prefix), model_type="bpe", vocab_size=700,
        character_coverage=0.995, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=[CONTROL_SYMBOL], user_defined_symbols=[USER_DEFINED_SYMBOL],
        num_threads=1, minloglevel=2,
    )
    model_file = prefix.with_suffix(".model")
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    return Vocabulary(model_file, sp, pieces, [float(sp.get_score(i)) for i in range(len(pieces))],
                      [_token_type(sp, i) for i in range(len(pieces))])


def _token_type(sp: Any, index: int) -> int:
    # sentencepiece's Python API reports every type but user-defined; that one is the symbol asked for.
    if sp.is_unknown(index):
        return 2
    if sp.is_control(index):
        return 3
    if sp.id_to_piece(index) == USER_DEFINED_SYMBOL:
        return 4
    if sp.is_unused(index):
        return 5
    return 6 if sp.is_byte(index) else 1


OMIT = object()


def _write_gguf(path: Path, vocabulary: Vocabulary, **overrides: Any) -> Path:
    """A 2-layer random Llama GGUF (hidden 32, 2 q / 1 kv heads of 64, ffn 64, tied embeddings) with
    ``vocabulary`` as its SentencePiece tokenizer. ``overrides`` replaces ``tokenizer.ggml.<key>``
    metadata values (``chat_template`` is ``tokenizer.chat_template``); OMIT leaves a key out."""
    tokenizer = {
        "model": "llama", "tokens": vocabulary.pieces, "scores": vocabulary.scores,
        "token_type": vocabulary.token_types, "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0,
        "add_bos_token": True, "add_eos_token": False, "add_space_prefix": True, "chat_template": CHAT_TEMPLATE,
    }
    tokenizer.update(overrides)
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, ffn = 32, 2, 1, 64, 64
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in tokenizer.items():
        if value is not OMIT:
            name = "tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"
            writer.add_key_value(name, value, gguf.GGUFValueType.get_type(value))

    def weight(*shape: int) -> np.ndarray:
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(vocabulary.pieces), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(2):
        for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (heads * head_dim, hidden)),
                            ("attn_k", (kv_heads * head_dim, hidden)), ("attn_v", (kv_heads * head_dim, hidden)),
                            ("attn_output", (hidden, heads * head_dim)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            value = weight(*shape) if len(shape) == 2 else np.ones(shape, np.float32)  # norms are ones
            writer.add_tensor(f"blk.{layer}.{name}.weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class References(NamedTuple):
    """HF's tokenizers for one vocabulary (see the module docstring)."""

    slow: Any  # transformers SentencePieceBackend
    fast: Any  # transformers LlamaTokenizerFast
    gguf: Any  # transformers' tokenizer loaded from the GGUF file


_SPECIAL_TOKENS = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _hf_slow(vocabulary: Vocabulary) -> Any:
    from tokenizers import AddedToken
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    slow = SentencePieceBackend(vocab_file=str(vocabulary.model_file), legacy=True, chat_template=CHAT_TEMPLATE,
                                additional_special_tokens=[CONTROL_SYMBOL], **_SPECIAL_TOKENS)
    slow.add_tokens([AddedToken(USER_DEFINED_SYMBOL, normalized=False, special=False)])
    return slow


def _hf_fast(vocabulary: Vocabulary) -> Any:
    from tokenizers import AddedToken
    from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

    vocab, _, merges = SentencePieceExtractor(str(vocabulary.model_file)).extract()
    fast = transformers.LlamaTokenizerFast(vocab=vocab, merges=merges, **_SPECIAL_TOKENS)
    fast.add_special_tokens({"additional_special_tokens": [AddedToken(CONTROL_SYMBOL, normalized=False, special=True)]})
    fast.add_tokens([AddedToken(USER_DEFINED_SYMBOL, normalized=False, special=False)])
    return fast


def _hf_gguf(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory) -> Vocabulary:
    return _train(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def model_path(vocabulary, tmp_path_factory) -> Path:
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-spm.gguf", vocabulary)


@pytest.fixture(scope="module")
def ours(model_path) -> Tokenizer:
    return read_gguf(model_path).tokenizer


@pytest.fixture(scope="module")
def refs(vocabulary, model_path) -> References:
    return References(_hf_slow(vocabulary), _hf_fast(vocabulary), _hf_gguf(model_path))


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer._backend.id_to_token(i) for i in ids]


def _has_added_token(text: str) -> bool:
    return len(ADDED_TOKEN_SPLIT.split(text)) > 1


# ---------------------------------------------------------------------- encode


def test_vocabulary_and_special_ids_come_from_the_file(ours, vocabulary, refs):
    assert ours.vocab_size == len(vocabulary.pieces) == len(refs.gguf)
    assert [ours._backend.id_to_token(i) for i in range(ours.vocab_size)] == vocabulary.pieces
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos_token, ours.add_eos_token) == (1, (2,), True, False)
    byte_tokens = [vocabulary.pieces.index(f"<0x{byte:02X}>") for byte in "😀".encode()]
    assert ours.encode("😀", add_special_tokens=False) == [vocabulary.pieces.index("▁"), *byte_tokens]


def test_plain_text_encodes_as_sentencepiece_does(ours, vocabulary):
    sp = vocabulary.processor
    for text in STRINGS + CORPUS[:20]:
        if not _has_added_token(text):
            assert ours.encode(text, add_special_tokens=False) == sp.encode(text), text
            assert ours.encode(text) == sp.encode(text, add_bos=True), text


def test_every_string_encodes_as_hf_slow_tokenizer_does(ours, refs):
    for text in STRINGS + list(HF_FAST_DEVIATIONS):
        expected = refs.slow.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == [1, *expected], text  # the file's add_bos_token


def test_hf_fast_tokenizers_agree_outside_their_prefix_rule(ours, refs):
    for text in STRINGS:
        fast = refs.fast.encode(text, add_special_tokens=False)
        assert refs.gguf.encode(text) == [1, *fast], text  # transformers' GGUF loading adds BOS as the file says
        if not _hf_fast_deviates(text):
            assert ours.encode(text, add_special_tokens=False) == fast, text
            assert ours.encode(text) == refs.gguf.encode(text), text


@pytest.mark.parametrize("text", list(HF_FAST_DEVIATIONS))
def test_hf_fast_prefix_rule_deviations(ours, refs, vocabulary, text):
    """transformers 5 builds a Llama tokenizer, from a .model's pieces or from a GGUF file, with a
    Metaspace pre-tokenizer in non-legacy mode (``prepend_scheme="first"``). That places the "▁"
    prefix differently from SentencePiece, the slow sentencepiece-backed tokenizer and llama.cpp,
    which graphrt follows, in two ways:

    1. Metaspace prepends "▁" only to text that does not already start with one, so text starting
       with a space loses a "▁"; SentencePiece's dummy prefix (llama.cpp's ``add_space_prefix``)
       always prepends, so " x" is "▁▁x".
    2. Only the start of the whole text gets a prefix; the others give each stretch of text after an
       added token its own, so "<s>x" is <s> "▁x", not <s> "x".
    """
    ours_pieces, hf_pieces = HF_FAST_DEVIATIONS[text]
    ids = ours.encode(text, add_special_tokens=False)
    assert _pieces(ours, ids) == ours_pieces
    assert ids == refs.slow.encode(text, add_special_tokens=False)
    hf_ids = refs.fast.encode(text, add_special_tokens=False)
    assert _pieces(ours, hf_ids) == hf_pieces  # documents transformers' rule; if this fails, HF changed
    assert refs.gguf.encode(text, add_special_tokens=False) == hf_ids
    assert _hf_fast_deviates(text)
    if not _has_added_token(text):
        assert ids == vocabulary.processor.encode(text)


@pytest.mark.parametrize("text", list(SENTENCEPIECE_DEVIATIONS))
def test_user_defined_symbol_is_split_off_before_the_prefix(ours, refs, vocabulary, text):
    """SentencePiece matches a user-defined symbol inside its own normalized text, after its dummy
    prefix, so the text after one gets no prefix and "<tool>fox" starts with a lone "▁". HF's
    tokenizers (which hold such a symbol as an added token, as tokenizer_config.json lists it) and
    llama.cpp split user-defined tokens off the raw text first, like special tokens, so the text
    after one gets its own prefix; graphrt does the same."""
    ours_pieces, sentencepiece_pieces = SENTENCEPIECE_DEVIATIONS[text]
    ids = ours.encode(text, add_special_tokens=False)
    assert _pieces(ours, ids) == ours_pieces
    assert ids == refs.slow.encode(text, add_special_tokens=False)
    assert [vocabulary.pieces[i] for i in vocabulary.processor.encode(text)] == sentencepiece_pieces
    # The prefix of the text after the symbol decodes as a space.
    decoded = text.replace(USER_DEFINED_SYMBOL, f"{USER_DEFINED_SYMBOL} ")
    assert ours.decode(ids) == vocabulary.processor.decode(ids) == decoded


_PIECES = list("abcXYZ019 \n\t'.,!?-_(){}éñßΩЖ日😀") + [
    "  ", "   ", "the", "fox", "Hello", "ing", "<s>", "</s>", CONTROL_SYMBOL, USER_DEFINED_SYMBOL, "\u2581",
]


def test_random_text_matches_references_and_round_trips(ours, refs, vocabulary):
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 24)))
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == refs.slow.encode(text, add_special_tokens=False), text
        if not _has_added_token(text):
            assert ids == vocabulary.processor.encode(text), text
        if not _hf_fast_deviates(text):
            assert ids == refs.fast.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == refs.fast.decode(ids, skip_special_tokens=False), text
        if not _has_added_token(text):
            assert ours.decode(ids) == text.replace("\u2581", " ")  # a typed "▁" is a space to SentencePiece


# ---------------------------------------------------------------------- decode


def test_decode_matches_hf(ours, refs, vocabulary):
    """Ids of every string, and random id lists (special tokens, byte tokens that do not form
    UTF-8), with and without skipping special tokens."""
    rng = random.Random(1)
    id_lists = [ours.encode(text) for text in STRINGS]
    id_lists += [[rng.randrange(len(vocabulary.pieces)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    for ids in id_lists:
        for skip in (False, True):
            expected = refs.fast.decode(ids, skip_special_tokens=skip)
            assert refs.gguf.decode(ids, skip_special_tokens=skip) == expected, ids
            assert ours.decode(ids, skip_special_tokens=skip) == expected, ids


def test_decode_round_trips_like_sentencepiece(ours, vocabulary):
    """On ids that encode text; SentencePiece and HF part only on byte runs that are not UTF-8 (see
    the module docstring)."""
    sp = vocabulary.processor
    for text in STRINGS:
        ids = ours.encode(text)
        if not _has_added_token(text):
            assert ours.decode(ids) == sp.decode(ids) == text.replace("\u2581", " "), text


def test_special_tokens_are_skipped_in_decoding(ours, vocabulary):
    ids = ours.encode(f"<s>a{CONTROL_SYMBOL}b</s><unk>{USER_DEFINED_SYMBOL}", add_special_tokens=False)
    assert _pieces(ours, ids) == ["<s>", "▁a", CONTROL_SYMBOL, "▁b", "</s>", "<unk>", USER_DEFINED_SYMBOL]
    assert ours.decode(ids, skip_special_tokens=False) == f"<s> a{CONTROL_SYMBOL} b</s><unk>{USER_DEFINED_SYMBOL}"
    # Control and unknown tokens are special; a user-defined token is text.
    assert ours.decode(ids) == f"a b{USER_DEFINED_SYMBOL}"


# ---------------------------------------------------------------------- file flags


def test_add_bos_and_add_eos_follow_the_file(vocabulary, tmp_path, refs):
    path = _write_gguf(tmp_path / "eos.gguf", vocabulary, add_bos_token=False, add_eos_token=True)
    tok = read_gguf(path).tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["Hello world", "", "a</s>"]:
        expected = [*refs.slow.encode(text, add_special_tokens=False), 2]
        assert tok.encode(text) == expected == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == expected[:-1]
    # Without the flags, llama.cpp and HF add BOS to a SentencePiece vocabulary and no EOS.
    path = _write_gguf(tmp_path / "no-flags.gguf", vocabulary, add_bos_token=OMIT, add_eos_token=OMIT)
    assert read_gguf(path).tokenizer.encode("Hi") == [1, *refs.slow.encode("Hi", add_special_tokens=False)]


def test_merges_in_the_file_are_used(vocabulary, tmp_path):
    """A file that lists merges is encoded with them, not with merges derived from its scores, as
    transformers' GGUF loading does; here the one merge "▁ f" leaves "fox" in three pieces."""
    path = _write_gguf(tmp_path / "merges.gguf", vocabulary, merges=["\u2581 f"])
    tok = read_gguf(path).tokenizer
    hf = _hf_gguf(path)
    assert _pieces(tok, tok.encode("fox fox", add_special_tokens=False)) == ["▁f", "o", "x", "▁f", "o", "x"]
    for text in STRINGS:
        if not _hf_fast_deviates(text):
            assert tok.encode(text) == hf.encode(text), text


def test_no_space_prefix(tmp_path):
    """``add_space_prefix = false`` against SentencePiece trained without its dummy prefix.
    transformers' GGUF loading ignores this key (it still prepends "▁" and strips it in decoding), so
    it is not a reference here."""
    vocabulary = _train(tmp_path, add_dummy_prefix=False)
    path = _write_gguf(tmp_path / "no-prefix.gguf", vocabulary, add_space_prefix=False)
    tok = read_gguf(path).tokenizer
    slow = _hf_slow(vocabulary)
    sp = vocabulary.processor
    for text in STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == slow.encode(text, add_special_tokens=False), text
        if not _has_added_token(text):
            assert ids == sp.encode(text), text
            assert tok.decode(ids) == sp.decode(ids) == text.replace("\u2581", " "), text
    assert not _pieces(tok, tok.encode("The fox", add_special_tokens=False))[0].startswith("▁")
    hf_ids = _hf_gguf(path).encode("The fox", add_special_tokens=False)
    assert _pieces(tok, hf_ids)[0].startswith("▁")  # documents transformers ignoring the key


# ---------------------------------------------------------------------- chat template and generation


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Now with ünïcode, 😀 and\nnewlines."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(ours, refs, messages):
    rendered = ours.apply_chat_template(messages)
    assert rendered == refs.slow.apply_chat_template(messages, tokenize=False)
    assert rendered == refs.gguf.apply_chat_template(messages, tokenize=False)
    expected = refs.slow.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ours.encode(rendered, add_special_tokens=False) == list(expected)


def test_llm_generates_from_a_text_prompt(model_path, refs):
    """Greedy and sampled requests from text prompts (one with special tokens in it); random weights
    make the output ids a mix of pieces and byte tokens, often not UTF-8, which the text must decode
    as HF does."""
    from graphrt import LLM, SamplingParams

    llm = LLM(str(model_path), device="cpu", progress=False, max_model_len=128, max_num_seqs=8)
    prompts = ["The quick brown fox", "  Café 😀\nnew line", f"a{CONTROL_SYMBOL}b</s> c"] * 2
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True) for seed in (3, 4, 5)]
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.prompt_token_ids == [1, *refs.slow.encode(prompt, add_special_tokens=False)]
        assert len(out.token_ids) == 16
        assert out.text == refs.fast.decode(out.token_ids, skip_special_tokens=True)
        assert out.text == refs.gguf.decode(out.token_ids, skip_special_tokens=True)
    [answer] = llm.chat("Hello", SamplingParams(temperature=0, max_tokens=2))
    assert answer.prompt_token_ids == list(refs.slow.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=True, return_dict=False))


# ---------------------------------------------------------------------- bad files


BAD_FILES = [
    (dict(model="wordpiece"), r"GGUF tokenizer model 'wordpiece' is not supported"),
    (dict(scores=OMIT), r"tokenizer model 'llama' \(SentencePiece\) needs tokenizer.ggml.scores"),
    (dict(scores=[0.0, -1.0, -2.0]), r"tokenizer.ggml.scores holds 3 entries for \d+ tokens"),
    (dict(scores=[0] * 8), r"tokenizer.ggml.scores must be an array of float32 numbers, not ARRAY of INT32"),
    (dict(scores="0 -1 -2"), r"tokenizer.ggml.scores must be an array of float32 numbers, not STRING"),
    (dict(token_type=[1, 3, 3]), r"tokenizer.ggml.token_type holds 3 entries for \d+ tokens"),
    (dict(token_type=[1.0] * 8), r"tokenizer.ggml.token_type must be an array of integers, not ARRAY of FLOAT32"),
    (dict(bos_token_id=100_000), r"tokenizer.ggml.bos_token_id is 100000, not an id in the vocabulary of \d+ tokens"),
    (dict(eos_token_id=-1), r"tokenizer.ggml.eos_token_id is -1, not an id in the vocabulary of \d+ tokens"),
    (dict(unknown_token_id=100_000), r"tokenizer.ggml.unknown_token_id is 100000, not an id in the vocabulary"),
    (dict(add_space_prefix=1), r"tokenizer.ggml.add_space_prefix must be a boolean, not 1"),
    (dict(merges=["nospace"]), r"tokenizer.ggml.merges holds 'nospace', not two pieces joined by one space"),
    (dict(merges=["\u2581 f", "a b c"]), r"tokenizer.ggml.merges holds 'a b c', not two pieces"),
    (dict(chat_template=5), r"tokenizer.chat_template must be a string, not 5"),
]


@pytest.mark.parametrize("overrides,message", BAD_FILES, ids=[
    "unknown_model", "no_scores", "short_scores", "int_scores", "string_scores", "short_token_type",
    "float_token_type", "bos_outside", "eos_negative", "unk_outside", "int_space_prefix", "merge_without_space",
    "merge_of_three", "int_chat_template"])
def test_bad_tokenizer_metadata_is_refused_by_name(vocabulary, tmp_path, overrides, message):
    """Each malformed key ends in one line naming the file and the key, not a crash inside the
    ``tokenizers`` library or a silently wrong tokenizer."""
    path = _write_gguf(tmp_path / "bad.gguf", vocabulary, **overrides)
    with pytest.raises(ModelLoadError, match=message) as info:
        read_gguf(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
