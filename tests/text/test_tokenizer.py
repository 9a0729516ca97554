"""Tokenizers: trained byte-level BPE and the tiktoken release loader."""
from __future__ import annotations

import base64
import functools
import itertools
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.text.tokenizer import (BPE_SPECIAL_TOKENS, K2_SPECIAL_TOKEN_OFFSETS, K3_SPECIAL_TOKEN_OFFSETS, BPETokenizer,
                                   TiktokenTokenizer, Tokenizer, get_or_train_tokenizer, load_tiktoken, pre_tokenize,
                                   split_for_encoding, train_bpe)
from openk3.train.data import load_corpus

TRICKY_TEXTS = [
    "",
    " ",
    "\t\t  \n\n   x",
    "def f(x):\n\tif x:\n\t\treturn  x  \n\n\n",
    " " * 37 + "a" + "\t" * 13,
    "héllo wörld, ça va? Ünïcödé — “quotes” … 日本語のテキスト 中文 한국어 Русский",
    "emoji 🚀🔥👍🏽 zero\u200bwidth e\u0301 combining \ufeffbom",
    "\r\n\r\nwindows\r\nlines\r",
    "x" * 500,
    "[EOS] <|im_end|> <think> literal special strings in ordinary text",
]


@functools.lru_cache(maxsize=1)
def training_texts() -> tuple[str, ...]:
    return tuple(d.text for d in load_corpus(None, max_bytes=300_000))


@functools.lru_cache(maxsize=1)
def small_bpe() -> BPETokenizer:
    return train_bpe(training_texts(), vocab_size=1000)


# ---------------------------------------------------------------------------------------------
# Trained BPE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_bpe_round_trip_tricky_text(text):
    tok = small_bpe()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert (len(ids) == 0) == (text == "")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_bpe_round_trip_any_text(text):
    tok = small_bpe()
    assert tok.decode(tok.encode(text)) == text


def test_bpe_compresses_code():
    tok = small_bpe()
    text = training_texts()[0]
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2.0
    assert tok.vocab_size == 1000


def test_bpe_training_is_deterministic():
    a = train_bpe(training_texts(), vocab_size=700)
    b = train_bpe(training_texts(), vocab_size=700)
    assert a.fingerprint() == b.fingerprint()
    c = train_bpe(training_texts()[1:], vocab_size=700)
    assert c.fingerprint() != a.fingerprint()


def test_bpe_special_tokens_are_single_ids():
    tok = small_bpe()
    assert sorted(tok.special_tokens) == sorted(BPE_SPECIAL_TOKENS)
    assert sorted(tok.special_tokens.values()) == list(range(len(BPE_SPECIAL_TOKENS)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (tok.token_id("[BOS]"), tok.token_id("[EOS]"),
                                                     tok.token_id("[PAD]"))
    for name, token_id in tok.special_tokens.items():
        assert tok.encode(name, allow_special=True) == [token_id]
        assert tok.decode([token_id]) == name
        # In ordinary text the string is just characters, never the control token.
        plain = tok.encode(name)
        assert len(plain) > 1 and not set(plain) & set(tok.special_tokens.values())
    mixed = "a<|im_user|>b<think>c"
    ids = tok.encode(mixed, allow_special=True)
    assert tok.decode(ids) == mixed
    assert tok.decode(ids, skip_special=True) == "abc"


def test_bpe_save_load_identity(tmp_path):
    tok = small_bpe()
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = Tokenizer.load(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.fingerprint() == tok.fingerprint()
    assert loaded.special_tokens == tok.special_tokens
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == \
        (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size)
    for text in TRICKY_TEXTS + list(training_texts()[:5]):
        assert loaded.encode(text) == tok.encode(text)


def test_bpe_errors():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(["abc"], vocab_size=100)
    tok = small_bpe()
    # decode never raises: an id past the vocabulary (a model with a padded embedding can sample one) is U+FFFD.
    assert tok.decode([tok.encode("a")[0], 1000, -3, tok.encode("b")[0]]) == "a\ufffd\ufffdb"
    with pytest.raises(KeyError, match="<nope>"):
        tok.token_id("<nope>")


def test_get_or_train_tokenizer_trains_once(tmp_path):
    first = get_or_train_tokenizer(tmp_path, training_texts()[:20], 600)
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()

    def must_not_be_read():
        raise AssertionError("texts were read although a tokenizer was cached")
        yield

    again = get_or_train_tokenizer(tmp_path, must_not_be_read(), 600)
    assert again.fingerprint() == first.fingerprint()
    with pytest.raises(ValueError, match="vocab_size=500"):
        get_or_train_tokenizer(tmp_path, must_not_be_read(), 500)


def test_load_errors_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.load(tmp_path)


# ---------------------------------------------------------------------------------------------
# tiktoken release format
# ---------------------------------------------------------------------------------------------


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map (what HF ByteLevel tokens are spelled in)."""
    byte_values = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = byte_values[:]  # printable bytes stand for themselves
    others = [b for b in range(256) if b not in byte_values]
    byte_values += others
    chars += [256 + n for n in range(len(others))]  # the rest are shifted past 255
    return {chr(c): b for b, c in zip(byte_values, chars)}


def write_tiktoken_file(path: Path, tokens: list[bytes]) -> Path:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def bpe_as_tiktoken_tokens(tok: BPETokenizer) -> list[bytes]:
    """The BPE's non-special tokens as raw bytes, in id (= merge) order: a tiktoken rank list."""
    to_byte = gpt2_unicode_to_byte()
    vocab = tok._hf.get_vocab(with_added_tokens=False)
    return [bytes(to_byte[c] for c in s)
            for s, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= len(BPE_SPECIAL_TOKENS)]


def test_tiktoken_matches_the_bpe_it_was_exported_from(tmp_path):
    """The same merges through tiktoken (Rust regex) and HF (Oniguruma) give the same ids: this
    checks the loader, the rank order and that both engines split Kimi's regex identically."""
    bpe = small_bpe()
    n_special = len(BPE_SPECIAL_TOKENS)
    tt = load_tiktoken(write_tiktoken_file(tmp_path / "tiktoken.model", bpe_as_tiktoken_tokens(bpe)))
    texts = TRICKY_TEXTS + [d.text for d in load_corpus(None, max_bytes=600_000)]
    for text in texts:
        expected = [i - n_special for i in bpe.encode(text)]
        assert tt.encode(text) == expected
        assert tt.decode(expected) == text


def test_tiktoken_special_token_block(tmp_path):
    merges = [b"ab", b"abc", b"  ", b"    ", b"de", b"def", b" def"]
    tokens = [bytes([b]) for b in range(256)] + merges
    tt = load_tiktoken(write_tiktoken_file(tmp_path / "tiktoken.model", tokens))
    first = len(tokens)
    assert tt.vocab_size == first + 256
    assert (tt.bos_id, tt.eos_id, tt.pad_id) == (first, first + 2, first + 255)
    for name, offset in K3_SPECIAL_TOKEN_OFFSETS.items():
        assert tt.token_id(name) == first + offset
        assert tt.encode(name, allow_special=True) == [first + offset]
        assert tt.decode([first + offset]) == name
    assert tt.token_id(f"<|reserved_token_{first + 8}|>") == first + 8
    assert len(tt.special_tokens) == 256
    assert tt.encode(" def abc") == [first - 1, 32, first - 6]
    assert tt.encode("<|end_of_msg|>") != [tt.eos_id]
    for text in TRICKY_TEXTS:
        assert tt.decode(tt.encode(text)) == text
        assert tt.decode(tt.encode(text, allow_special=True)) == text


def test_tiktoken_k3_ids_and_save_load(tmp_path):
    """A vocabulary of K3's size puts bos/eos/pad at 163584/163586/163839."""
    singles = [bytes([b]) for b in range(256)]
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    triples = (bytes([a, b, c]) for a in range(256) for b in range(256) for c in range(256))
    tokens = singles + pairs + list(itertools.islice(triples, 163584 - len(singles) - len(pairs)))
    tt = load_tiktoken(write_tiktoken_file(tmp_path / "tiktoken.model", tokens))
    assert (tt.bos_id, tt.eos_id, tt.pad_id, tt.vocab_size) == (163584, 163586, 163839, 163840)
    # K3_SPEC.md section 9: the named ids of the release, every other reserved id <|reserved_token_{id}|>.
    spec = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
            163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
            163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
            163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]"}
    by_id = {i: s for s, i in tt.special_tokens.items()}
    assert sorted(by_id) == list(range(163584, 163840))
    for i in range(163584, 163840):
        assert by_id[i] == spec.get(i, f"<|reserved_token_{i}|>")
    assert tt.decode(list(range(163580, 163840))) is not None  # every id decodes

    saved = tmp_path / "saved"
    tt.save(saved)
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["163586"]["content"] == "<|end_of_msg|>"
    assert "163600" not in config["added_tokens_decoder"]  # reserved names are implied
    # A release's own names win over the defaults: a K2-style config names the same ids K2's way.
    config["added_tokens_decoder"] = {str(163584 + o): {"content": n, "special": True}
                                      for n, o in K2_SPECIAL_TOKEN_OFFSETS.items()}
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.load(saved)
    assert isinstance(loaded, TiktokenTokenizer)
    assert loaded.eos_id == 163586 and loaded.token_id("<|im_end|>") == 163586
    assert loaded.token_id("<think>") == 163584 + 22 and "<|open|>" not in loaded.special_tokens
    text = "K3 tokenizer: héllo 世界 \t\t  x"
    assert loaded.encode(text) == tt.encode(text)


def test_tiktoken_file_errors(tmp_path):
    missing_byte = [bytes([b]) for b in range(256) if b != 200]
    with pytest.raises(ValueError, match="byte 200"):
        load_tiktoken(write_tiktoken_file(tmp_path / "a.model", missing_byte))
    bad = tmp_path / "b.model"
    bad.write_text("QQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"b\.model:2"):
        load_tiktoken(bad)
    gap = tmp_path / "c.model"
    gap.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b * 2}\n" for b in range(256)))
    with pytest.raises(ValueError, match="ranks must be exactly"):
        load_tiktoken(gap)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        load_tiktoken(tmp_path / "nope.model")
    tokens = [bytes([b]) for b in range(256)]
    with pytest.raises(ValueError, match="outside the reserved block"):
        load_tiktoken(write_tiktoken_file(tmp_path / "d.model", tokens), {10: "[BOS]"})


def test_pre_tokenizer_regex_is_the_one_tiktoken_runs(tmp_path):
    """The `regex`-module reference of Kimi's pattern (class intersection, look-ahead) cuts text into the
    pieces tiktoken merges within: encoding piece by piece equals encoding the whole."""
    tt = load_tiktoken(write_tiktoken_file(tmp_path / "tiktoken.model", bpe_as_tiktoken_tokens(small_bpe())))
    for text in TRICKY_TEXTS + ["I'M here, they'LL see 中文abc Ünï  \n\n  x 12345 ... !!\n"]:
        pieces = pre_tokenize(text)
        assert "".join(pieces) == text
        assert [i for p in pieces for i in tt.encode(p)] == tt.encode(text)
    assert pre_tokenize("中文abc") == ["中文", "abc"]  # Han is its own piece (the intersection excludes it)
    assert pre_tokenize("a   b") == ["a", "  ", " b"]  # \s+(?!\S) leaves the last space to the word
    assert pre_tokenize("12345") == ["123", "45"]


def test_long_runs_are_cut_before_bpe(tmp_path):
    tt = load_tiktoken(write_tiktoken_file(tmp_path / "tiktoken.model", [bytes([b]) for b in range(256)] + [b"aa"]))
    assert split_for_encoding("short") == ["short"]
    text = "b " + "a" * 60_001 + " " * 30_000 + "c"
    pieces = split_for_encoding(text)
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [2 + 25_000, 25_000, 10_001 + 25_000, 5_001]
    window = "x" * 400_000 + "y"
    assert [len(p) for p in split_for_encoding(window)][-1] == 1  # the 400,000-character window ends a piece
    assert tt.decode(tt.encode(text)) == text
    # pieces are encoded separately: an odd run of 25,001 "a"s is 12,500 "aa" + one "a" per 25,000 piece
    assert len(tt.encode("a" * 25_001)) == 12_500 + 1


@functools.lru_cache(maxsize=1)
def bytes_only_tiktoken() -> TiktokenTokenizer:
    path = Path(tempfile.mkdtemp()) / "tiktoken.model"
    return load_tiktoken(write_tiktoken_file(path, [bytes([b]) for b in range(256)]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40) | st.integers(0, 600), max_size=50))
def test_decode_never_raises(ids):
    tt = bytes_only_tiktoken()
    text = tt.decode(ids)
    assert text.count("\ufffd") >= sum(not 0 <= i < tt.vocab_size for i in ids)
    assert isinstance(small_bpe().decode(ids), str)
