"""Tokenizers: a byte-level BPE trained here, and the release `tiktoken.model` loader.

Both kinds share one interface (`Tokenizer`): `encode`, `decode`, `vocab_size`, `bos_id`,
`eos_id`, `pad_id`, `special_tokens`, `save(dir)` and `Tokenizer.load(dir)`, which looks at the
files in `dir` to decide which kind it holds:

    tokenizer.json                      -> BPETokenizer      (HF `tokenizers`, trained by train_bpe)
    tiktoken.model [+ tokenizer_config.json] -> TiktokenTokenizer (the K3 release format)

Special tokens use Kimi's names and layout. In the release vocabulary the 256 ids after the BPE
ranks (163584..163839 for K3) are reserved for special tokens; the named ones sit at fixed offsets
in that block and the rest are called `<|reserved_token_{id}|>`, as in Kimi's `tokenization_kimi.py`.
A bare `tiktoken.model` gets K3's names (K3_SPEC.md section 9: `<|end_of_msg|>`, `<|open|>`,
`<|close|>`, `<|sep|>`, ...); a `tokenizer_config.json` beside it (Kimi K2, Kimi-Linear) supplies
its own names, e.g. K2's `<|im_end|>` at the same offset. `openk3.text.chat.chat_format_for` picks
the chat encoding from whichever names a tokenizer has.

Encoding follows Kimi's `tokenization_kimi.py`: text is cut into windows of at most 400,000
characters, each window so that no run of whitespace or of non-whitespace exceeds 25,000
characters, and only then split by the pre-tokenizer regex and merged.

Special-token strings that occur inside ordinary text (a Python file that mentions "[EOS]", say)
are encoded as plain text unless `allow_special=True`: a corpus can never inject a control token.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import regex
import tiktoken
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

# Kimi's pre-tokenization regex, `TikTokenTokenizer.pat_str` in Kimi-K2's tokenization_kimi.py:
# CJK runs (\p{Han}) are pieces of their own, words keep one leading non-letter (the space),
# numbers split into groups of at most 3 digits, punctuation runs absorb trailing newlines.
# NOTE: `[A&&[^B]]` is class intersection and `\s+(?!\S)` a look-ahead. tiktoken's Rust regex
# engine (fancy-regex) and the Oniguruma engine inside HF `tokenizers` accept both; Python's `re`
# has no class intersection, so the Python reference (`pre_tokenize`) uses the `regex` module in V1 mode.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

_PRE_TOKENIZER = regex.compile(KIMI_PAT_STR, regex.V1)

# Kimi's `TikTokenTokenizer.encode` limits (tokenization_kimi.py): tiktoken's merge loop is slow
# on one huge piece, so text is windowed and very long runs are cut before BPE.
MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1))


def pre_tokenize(text: str) -> list[str]:
    """The pieces Kimi's regex cuts `text` into (the Python reference for what tiktoken does inside)."""
    return _PRE_TOKENIZER.findall(text)


def split_for_encoding(text: str) -> list[str]:
    """`text` cut as Kimi's tokenizer cuts it before BPE: windows of at most 400,000 characters,
    then no run of whitespace or of non-whitespace longer than 25,000 characters (a longer run is
    cut every 25,000 characters, counted from the start of the run within its window).
    The pieces join back to `text`."""
    pieces = []
    for w in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        window = text[w:w + MAX_ENCODE_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(window):
            for cut in range(run.start() + MAX_NO_WHITESPACES_CHARS, run.end(), MAX_NO_WHITESPACES_CHARS):
                pieces.append(window[start:cut])
                start = cut
        pieces.append(window[start:])
    return pieces


NUM_RESERVED_SPECIAL_TOKENS = 256

# Offset of each named special token inside the reserved block of the K3 release
# (K3_SPEC.md section 9: [BOS] = 163584 + 0, <|end_of_msg|> = 163586, <osagent_mode> = 163649).
K3_SPECIAL_TOKEN_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<osagent_mode>": 65,
    "[UNK]": 254,
    "[PAD]": 255,
}

# The same block in Kimi K2's naming (its `tokenizer_config.json` `added_tokens_decoder`); K2 and
# Kimi-Linear releases ship that file, so these names come in through `_special_names_from_config`.
K2_SPECIAL_TOKEN_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}
# K3 release ids: bos 163584, eos 163586, pad 163839 (K3_SPEC.md section 6).
# NOTE: the release eos is the end-of-message token at offset 2 (`<|end_of_msg|>`; `<|im_end|>` in K2's naming),
# not `[EOS]` at offset 1: generation stops at the end of an assistant turn.
TIKTOKEN_BOS_OFFSET, TIKTOKEN_EOS_OFFSET, TIKTOKEN_PAD_OFFSET = 0, 2, 255

# The special tokens a trained BPE reserves: K2's chat roles, thinking and tool-call markers (ids
# 0..14, what the server's K2 template uses today), then every named K3 token not already there
# (ids 15..27), so the XTML chat code in openk3.text.chat serves small models and the release alike.
# The HF trainer puts special tokens first.
BPE_SPECIAL_TOKENS: list[str] = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    *[name for name in K3_SPECIAL_TOKEN_OFFSETS if name not in ("[BOS]", "[EOS]", "[PAD]")],
]
BPE_BOS, BPE_EOS, BPE_PAD = "[BOS]", "[EOS]", "[PAD]"

BPE_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
TIKTOKEN_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer(ABC):
    """Text <-> token ids. Build with `train_bpe`, `load_tiktoken` or `Tokenizer.load(dir)`.

    `special_tokens` maps each special token's string to its id. `bos_id`, `eos_id`, `pad_id`
    are ids of three of them. Subclasses implement the four abstract methods.
    """

    def __init__(self, special_tokens: Mapping[str, int], bos_token: str, eos_token: str, pad_token: str):
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.bos_id = self.token_id(bos_token)
        self.eos_id = self.token_id(eos_token)
        self.pad_id = self.token_id(pad_token)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; every id is in [0, vocab_size)."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        """Encode many texts (in parallel where the backend can). No BOS/EOS is added."""

    @abstractmethod
    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        """Decode ids already known to lie in [0, vocab_size)."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the files `Tokenizer.load(directory)` reads back."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A hex digest that changes whenever the id assignment changes (used to key caches)."""

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """`text` -> ids. No BOS/EOS is added. With `allow_special`, special-token strings in
        `text` become their single ids; otherwise they are encoded as ordinary text."""
        return self.encode_batch([text], allow_special=allow_special)[0]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """ids -> text; never raises. Byte sequences that are not valid UTF-8 decode to U+FFFD, and
        so does each id outside [0, vocab_size) (a model whose embedding is larger than its
        tokenizer can sample one; the text around it still decodes)."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        if all(0 <= i < n for i in ids):
            return self._decode_checked(ids, skip_special)
        parts, run = [], []
        for i in ids:
            if 0 <= i < n:
                run.append(i)
                continue
            if run:
                parts.append(self._decode_checked(run, skip_special))
                run = []
            parts.append("\ufffd")
        if run:
            parts.append(self._decode_checked(run, skip_special))
        return "".join(parts)

    def token_id(self, special_token: str) -> int:
        """The id of a special token, by its string (e.g. "<|im_end|>")."""
        if special_token not in self.special_tokens:
            raise KeyError(f"{special_token!r} is not a special token of this tokenizer "
                           f"(it has {len(self.special_tokens)}, e.g. {sorted(self.special_tokens)[:5]})")
        return self.special_tokens[special_token]

    @staticmethod
    def load(directory: str | Path) -> Tokenizer:
        """Load whichever kind `directory` holds: tokenizer.json (BPE) or tiktoken.model."""
        directory = Path(directory)
        if (directory / BPE_FILE).is_file():
            try:
                hf = HFTokenizer.from_file(str(directory / BPE_FILE))
            except Exception as e:  # HF tokenizers raises a bare Exception for a file it cannot parse
                raise ValueError(f"{directory / BPE_FILE} is not a readable tokenizer.json: {e}") from None
            return BPETokenizer(hf)
        if (directory / TIKTOKEN_FILE).is_file():
            config_path = directory / TIKTOKEN_CONFIG_FILE
            special_names = _special_names_from_config(config_path) if config_path.is_file() else None
            return load_tiktoken(directory / TIKTOKEN_FILE, special_names)
        raise FileNotFoundError(f"no tokenizer in {directory}: expected {BPE_FILE} or {TIKTOKEN_FILE}")

    @staticmethod
    def from_path(path: str | Path) -> Tokenizer:
        """A tokenizer directory (see `load`), a `tokenizer.json`, or a release-style `tiktoken.model` file."""
        path = Path(path)
        if path.is_dir():
            return Tokenizer.load(path)
        if path.name == BPE_FILE:
            return Tokenizer.load(path.parent)
        if path.is_file():
            return load_tiktoken(path)
        raise FileNotFoundError(f"no tokenizer at {path}")


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (HF tokenizers), trained here
# ---------------------------------------------------------------------------------------------


class BPETokenizer(Tokenizer):
    """A byte-level BPE held by an HF `tokenizers.Tokenizer`.

    Pre-tokenization is Kimi's regex followed by the GPT-2 byte -> printable-character map, and
    the decoder inverts that map, so decode(encode(x)) == x for every string x.
    """

    def __init__(self, hf_tokenizer: HFTokenizer):
        self._hf = hf_tokenizer
        self._flag_lock = threading.Lock()  # encode_special_tokens is a flag on the shared HF object
        special = {t.content: i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special}
        super().__init__(special, BPE_BOS, BPE_EOS, BPE_PAD)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        # `encode_special_tokens = True` makes HF treat special-token strings as plain text. It is a flag on the
        # shared HF object: the lock keeps another thread from flipping it mid-encode (the server encodes from many).
        with self._flag_lock:
            self._hf.encode_special_tokens = not allow_special
            return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(directory / BPE_FILE))

    def fingerprint(self) -> str:
        return hashlib.sha256(self._hf.to_str().encode()).hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on `texts` with `vocab_size` ids in total.

    The vocabulary is the 28 `BPE_SPECIAL_TOKENS` (ids 0..27), all 256 bytes, then merges.
    Pairs seen fewer than `min_frequency` times are never merged, so a small corpus may end with
    fewer ids than asked for. Deterministic: the same texts in the same order give the same
    tokenizer. A few MB of text trains in seconds on 2 cores.
    """
    min_vocab = len(BPE_SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                         f"{min_vocab} ids ({len(BPE_SPECIAL_TOKENS)} special tokens + 256 bytes)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=BPE_SPECIAL_TOKENS,
        # NOTE: without the full byte alphabet a byte never seen in training would have no id
        # and HF would drop it silently: round-tripping unseen unicode needs all 256.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return BPETokenizer(hf)


def get_or_train_tokenizer(run_dir: str | Path, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """The run's tokenizer: loaded from `run_dir/tokenizer/` if present, else trained and saved.

    `texts` is only consumed when training. A cached tokenizer whose vocabulary is larger than
    `vocab_size` is an error (the model's embedding could not hold its ids); a smaller one is
    what training produced when the corpus ran out of frequent pairs, and is accepted.
    """
    directory = Path(run_dir) / "tokenizer"
    if (directory / BPE_FILE).is_file() or (directory / TIKTOKEN_FILE).is_file():
        tokenizer = Tokenizer.load(directory)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer cached in {directory} has {tokenizer.vocab_size} ids, more "
                             f"than vocab_size={vocab_size}; delete it or use another run dir")
        return tokenizer
    tokenizer = train_bpe(texts, vocab_size)
    tokenizer.save(directory)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Release format: tiktoken.model
# ---------------------------------------------------------------------------------------------


class TiktokenTokenizer(Tokenizer):
    """The release tokenizer: tiktoken BPE ranks, then a block of 256 special-token ids."""

    def __init__(self, encoding: tiktoken.Encoding, mergeable_ranks: dict[bytes, int],
                 special_tokens: Mapping[str, int]):
        self._encoding = encoding
        self._ranks = mergeable_ranks
        first_special = len(mergeable_ranks)
        names = {i: s for s, i in special_tokens.items()}
        super().__init__(special_tokens, names[first_special + TIKTOKEN_BOS_OFFSET],
                         names[first_special + TIKTOKEN_EOS_OFFSET], names[first_special + TIKTOKEN_PAD_OFFSET])
        self._special_ids = frozenset(special_tokens.values())

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        texts = list(texts)
        pieces = [split_for_encoding(t) if len(t) > MAX_NO_WHITESPACES_CHARS else [t] for t in texts]
        flat = [p for ps in pieces for p in ps]
        if allow_special:
            encoded = self._encoding.encode_batch(flat, allowed_special="all")
        else:
            encoded = self._encoding.encode_ordinary_batch(flat)
        out, k = [], 0
        for ps in pieces:
            out.append([i for e in encoded[k:k + len(ps)] for i in e])
            k += len(ps)
        return out

    def _decode_checked(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return self._encoding.decode(ids)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lines = [f"{base64.b64encode(token).decode()} {rank}\n"
                 for token, rank in sorted(self._ranks.items(), key=lambda kv: kv[1])]
        (directory / TIKTOKEN_FILE).write_text("".join(lines))
        named = {str(i): {"content": s, "special": True}
                 for s, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1])
                 if s != _reserved_name(i)}
        (directory / TIKTOKEN_CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": named}, indent=2))

    def fingerprint(self) -> str:
        h = hashlib.sha256(KIMI_PAT_STR.encode())
        for token, rank in sorted(self._ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token)
        h.update(json.dumps(sorted(self.special_tokens.items())).encode())
        return h.hexdigest()


def _reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one `base64(token_bytes) rank` per line, ranks 0..n-1."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken file not found: {path}")
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_text(encoding="ascii").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            raise ValueError(f"{path}:{line_number}: expected 'base64token rank', got {line[:80]!r}")
        token = base64.b64decode(fields[0], validate=True)
        if token in ranks:
            raise ValueError(f"{path}:{line_number}: token {token!r} appears twice")
        ranks[token] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: byte-level BPE needs all 256 single bytes; byte {missing[0]} "
                         f"(and {len(missing) - 1} more) has no rank")
    return ranks


def load_tiktoken(path: str | Path, special_names: Mapping[int, str] | None = None) -> TiktokenTokenizer:
    """Load a release-style `tiktoken.model` with Kimi's regex and special-token block.

    Special ids are [n, n + 256) where n is the number of BPE ranks (163584 for K3).
    `special_names` maps some of those ids to names (a release's `tokenizer_config.json`
    `added_tokens_decoder`, e.g. Kimi K2's); by default the K3 names at their offsets. The remaining ids
    are `<|reserved_token_{id}|>`. bos/eos/pad are the ids at offsets 0/2/255.
    """
    ranks = read_tiktoken_ranks(path)
    first = len(ranks)
    block = range(first, first + NUM_RESERVED_SPECIAL_TOKENS)
    if special_names is None:
        special_names = {first + offset: name for name, offset in K3_SPECIAL_TOKEN_OFFSETS.items()}
    outside = [i for i in special_names if i not in block]
    if outside:
        raise ValueError(f"special token id {outside[0]} ({special_names[outside[0]]!r}) is outside "
                         f"the reserved block [{block.start}, {block.stop}) that follows the ranks of {path}")
    special_tokens = {special_names.get(i, _reserved_name(i)): i for i in block}
    if len(special_tokens) != len(block):
        raise ValueError(f"special token names for {path} are not unique")
    encoding = tiktoken.Encoding(name=Path(path).name, pat_str=KIMI_PAT_STR,
                                 mergeable_ranks=ranks, special_tokens=special_tokens)
    return TiktokenTokenizer(encoding, ranks, special_tokens)


def _special_names_from_config(config_path: Path) -> dict[int, str]:
    """The id -> name map of a `tokenizer_config.json`'s `added_tokens_decoder`."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" not in config:
        raise ValueError(f"{config_path} has no 'added_tokens_decoder'")
    return {int(i): entry["content"] for i, entry in config["added_tokens_decoder"].items()}
