"""Training data: corpora, train/val split, tokenization cache, packed resumable batches.

    docs = load_corpus(None)                          # the stdlib's own .py files (default corpus)
    train_docs, val_docs = split_train_val(docs, 0.05, seed=0)
    corpus = tokenize_corpus(train_docs, tokenizer, cache_dir=run_dir)
    data = PackedDataset(corpus, batch_size=8, seq_len=256, seed=0)
    batch = next(data)                                # input_ids, labels, cu_seqlens, seq_ids
    data.seq_len = 512                                # curriculum: any batch may change shape
    state = data.state_dict()                         # resume: load_state_dict(state)

Each document becomes `[BOS] tokens [EOS]`. Documents are shuffled per epoch (seed, epoch) and
concatenated into one endless stream; a batch takes the next B*T tokens of that stream as B rows.
The state of the iterator is a single token offset into the stream, so changing the batch shape
between batches never breaks resuming.

A row holds pieces of several documents. `cu_seqlens` and `seq_ids` describe them so the model
resets the KDA recurrent state and blocks MLA attention at every document start and every row
start: a token only ever sees earlier tokens of its own document in its own row.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from openk3.text.tokenizer import Tokenizer

IGNORE_INDEX = -100  # label of a position with no target (torch cross_entropy's default ignore_index)

# ---------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One training document. `name` is stable across machines and decides the train/val split."""

    name: str
    text: str


# Directory names skipped inside the stdlib: installed packages, test suites (Lib/test,
# idlelib/idle_test, lib2to3/tests, ctypes/test, ...), bytecode, and generated tables:
# pydoc_data/topics.py (750 KB of doc strings) and encodings/ (gencodec charmap tables).
STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",
    "test", "tests", "idle_test",
    "pydoc_data", "encodings",
})


def stdlib_corpus() -> list[Path]:
    """The .py files of the running interpreter's standard library, sorted.

    About 610 files and 10 MB (2.7M tokens at vocab 4096) for CPython 3.11, once tests and
    generated files are excluded.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist")
    paths = []
    for directory, subdirs, files in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages and the test suites entirely.
        subdirs[:] = [d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS]
        paths.extend(Path(directory, f) for f in files if f.endswith(".py"))
    return sorted(paths)


def load_corpus(spec: str | Path | None = None, *, max_bytes: int | None = None) -> list[Document]:
    """Load documents from `spec`, sorted by name.

    spec:
        None        the standard library's .py files (`stdlib_corpus()`), named by their path
                    relative to the stdlib root ("json/decoder.py")
        file.jsonl  one document per line, from its "text" field, named "file.jsonl:LINE"
        a file      one document (any UTF-8 text: .txt, .md, .py, ...), named by its file name
        a directory every UTF-8 text file below it (binaries, non-UTF-8 files and hidden
                    entries such as .git are skipped; .jsonl files inside are read by line),
                    named by path relative to the directory
    max_bytes: keep a deterministic sample of documents (in order of a stable hash of their
        names) until their UTF-8 size reaches `max_bytes`; at least one document is kept.

    Empty documents are dropped. Errors name the offending path (and line, for JSONL).
    """
    if spec is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = [_read_document(p, p.relative_to(root).as_posix()) for p in stdlib_corpus()]
        docs = [d for d in docs if d is not None]
    else:
        path = Path(spec)
        if path.is_dir():
            docs = _load_directory(path)
        elif path.is_file():
            docs = _load_file(path, path.name)
        else:
            raise FileNotFoundError(f"corpus path does not exist: {path}")
    docs = sorted((d for d in docs if d.text), key=lambda d: d.name)
    if not docs:
        raise ValueError(f"no non-empty UTF-8 text documents found in {spec}")
    if max_bytes is not None:
        docs = _cap_bytes(docs, max_bytes)
    return docs


def _load_file(path: Path, name: str) -> list[Document]:
    """A file given by the user: a JSONL file, or one text document (non-UTF-8 is an error)."""
    if path.suffix == ".jsonl":
        return _load_jsonl(path, name)
    doc = _read_document(path, name)
    if doc is None:
        raise ValueError(f"{path} is not a UTF-8 text file")
    return [doc]


def _load_directory(root: Path) -> list[Document]:
    docs: list[Document] = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix == ".jsonl":
            docs.extend(_load_jsonl(path, relative.as_posix()))
        else:
            doc = _read_document(path, relative.as_posix())
            if doc is not None:
                docs.append(doc)
    return docs


def _read_document(path: Path, name: str) -> Document | None:
    """The file as one document, or None if it is binary (a NUL byte early on) or not UTF-8."""
    with path.open("rb") as f:
        head = f.read(8192)
        if b"\0" in head:  # decided from the head: never read a large binary (a checkpoint) whole
            return None
        data = head + f.read()
    try:
        return Document(name, data.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object, str]]:
    """(line number, parsed value, line) for every non-blank line of a JSONL file. Read as bytes, so a non-UTF-8
    line is an error naming the file, the line and the byte offset in the file (JSONL is UTF-8, RFC 8259), as is a
    line that is not JSON."""
    offset = 0  # of the line in the file, in bytes
    with Path(path).open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not UTF-8 (byte {offset + e.start} of the file is "
                                 f"{raw[e.start]:#04x})") from e
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line), line
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({e.msg})") from e


def _load_jsonl(path: Path, name: str) -> list[Document]:
    """One document per non-blank line (`iter_jsonl`; a directory load does not skip a non-UTF-8 .jsonl file as it
    does a binary file, since a .jsonl file is meant as data)."""
    docs = []
    for line_number, record, line in iter_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{line_number}: expected an object with a string field "
                             f"'text', got {line.strip()[:80]!r}")
        docs.append(Document(f"{name}:{line_number}", record["text"]))
    return docs


def _stable_unit_hash(key: str) -> float:
    """A hash of `key` in [0, 1), the same on every machine and run (unlike Python's `hash`)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _cap_bytes(docs: list[Document], max_bytes: int) -> list[Document]:
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    kept, total = [], 0
    for doc in sorted(docs, key=lambda d: _stable_unit_hash(f"cap:{d.name}")):
        if total >= max_bytes:
            break
        kept.append(doc)
        total += len(doc.text.encode("utf-8"))
    return sorted(kept, key=lambda d: d.name)


def split_train_val(docs: Sequence[Document], val_fraction: float,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split whole documents: about `val_fraction` of them go to val, chosen by a stable hash
    of (seed, name). Order within each part is the input order.

    With val_fraction > 0, val and train each get at least one document.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0:
        return list(docs), []
    if len(docs) < 2:
        raise ValueError(f"cannot split {len(docs)} document(s) into train and val by document; "
                         f"give more documents (a directory or JSONL file) or val_fraction=0")
    u = [_stable_unit_hash(f"split:{seed}:{d.name}") for d in docs]
    in_val = [x < val_fraction for x in u]
    # A small corpus can hash every document to one side; move the nearest one across.
    if not any(in_val):
        in_val[min(range(len(docs)), key=u.__getitem__)] = True
    if all(in_val):
        in_val[max(range(len(docs)), key=u.__getitem__)] = False
    train = [d for d, v in zip(docs, in_val) if not v]
    val = [d for d, v in zip(docs, in_val) if v]
    return train, val


# ---------------------------------------------------------------------------------------------
# Tokenization (cached)
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenizedCorpus:
    """All documents as one token array.

    tokens:      int32 [N]     document d is tokens[doc_offsets[d]:doc_offsets[d + 1]],
                               laid out as [BOS] text tokens [EOS]
    doc_offsets: int64 [D + 1] starts of the documents, then N
    """

    tokens: np.ndarray
    doc_offsets: np.ndarray

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def tokenize_corpus(docs: Sequence[Document], tokenizer: Tokenizer,
                    cache_dir: str | Path | None = None) -> TokenizedCorpus:
    """Tokenize every document as [BOS] text [EOS].

    With `cache_dir`, the result is stored as `tokens-<key>.npz` there and reused, where the
    key hashes the tokenizer and every document's name and text: a changed corpus or tokenizer
    gets a new file, never a stale one.
    """
    if not docs:
        raise ValueError("cannot tokenize an empty list of documents")
    cache_path = None
    if cache_dir is not None:
        key = hashlib.sha256(tokenizer.fingerprint().encode())
        for doc in docs:
            key.update(doc.name.encode("utf-8") + b"\0" + doc.text.encode("utf-8") + b"\0")
        cache_path = Path(cache_dir) / f"tokens-{key.hexdigest()[:16]}.npz"
        if cache_path.is_file():
            with np.load(cache_path) as cached:
                return TokenizedCorpus(cached["tokens"], cached["doc_offsets"])

    ids_per_doc = tokenizer.encode_batch([d.text for d in docs])
    lengths = np.array([len(ids) + 2 for ids in ids_per_doc], dtype=np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.empty(doc_offsets[-1], dtype=np.int32)
    for start, ids in zip(doc_offsets[:-1], ids_per_doc):
        tokens[start] = tokenizer.bos_id
        tokens[start + 1:start + 1 + len(ids)] = ids
        tokens[start + 1 + len(ids)] = tokenizer.eos_id
    corpus = TokenizedCorpus(tokens, doc_offsets)

    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a run killed mid-write never leaves a truncated cache behind.
        partial = cache_path.with_name(cache_path.name + ".partial")
        with partial.open("wb") as f:
            np.savez(f, tokens=tokens, doc_offsets=doc_offsets)
        os.replace(partial, cache_path)
    return corpus


# ---------------------------------------------------------------------------------------------
# Packed batches
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """B rows of T tokens packed from the stream (all int64).

    input_ids  [B, T]
    labels     [B, T]  labels[b, t] = input_ids[b, t + 1] (the next token, for the last column
                       the first token of the next row in the stream) when that token belongs to
                       the same document, else IGNORE_INDEX. So the last text token of a document
                       has label EOS, and EOS itself (whose next token is the next document's
                       BOS) has IGNORE_INDEX.
    cu_seqlens [S + 1] over the flattened B*T tokens: the start of each of the S segments (a
                       segment is a run of one document inside one row; every row start and
                       every document start begins one), then B*T. fla's varlen convention.
    seq_ids    [B, T]  index in [0, S) of the segment each token belongs to; a token may
                       attend to token j of the same row iff j <= t and seq_ids are equal.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_ids: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.labels, self.cu_seqlens, self.seq_ids)))


class PackedDataset:
    """An endless, resumable iterator of packed `Batch`es over a `TokenizedCorpus`.

    The stream is epoch 0, epoch 1, ... back to back; epoch e is every document once, in the
    order of a permutation drawn from numpy's PCG64 seeded with (seed, e) (or corpus order
    when shuffle=False). `batch_size` and `seq_len` are plain attributes: set them between
    batches (sequence-length curriculum) and the stream simply continues.
    """

    def __init__(self, corpus: TokenizedCorpus, batch_size: int, seq_len: int, *,
                 seed: int = 0, shuffle: bool = True):
        if corpus.num_tokens == 0:
            raise ValueError("the corpus has no tokens")
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.offset = 0  # tokens of the stream consumed so far
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.offset // self.corpus.num_tokens

    def __iter__(self) -> PackedDataset:
        return self

    def __next__(self) -> Batch:
        B, T = self.batch_size, self.seq_len
        if B < 1 or T < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {B} and {T}")
        # One token more than the batch holds: the label of the last position.
        tokens, doc_start = self._take(self.offset, B * T + 1)
        self.offset += B * T

        input_ids = tokens[:-1]
        labels = np.where(doc_start[1:], IGNORE_INDEX, tokens[1:])
        segment_start = doc_start[:-1].copy()
        segment_start[::T] = True  # every row starts a segment: nothing flows between rows
        cu_seqlens = np.append(np.flatnonzero(segment_start), B * T)
        seq_ids = np.cumsum(segment_start) - 1
        return Batch(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).view(B, T),
            labels=torch.from_numpy(labels.astype(np.int64)).view(B, T),
            cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int64)),
            seq_ids=torch.from_numpy(seq_ids.astype(np.int64)).view(B, T),
        )

    def _take(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream tokens [start, start + n) and, for each, whether it begins a document."""
        N = self.corpus.num_tokens
        token_parts, start_parts = [], []
        while n > 0:
            epoch, within = divmod(start, N)
            chunk = min(n, N - within)
            tokens, doc_start = self._epoch_slice(epoch, within, chunk)
            token_parts.append(tokens)
            start_parts.append(doc_start)
            start, n = start + chunk, n - chunk
        return np.concatenate(token_parts), np.concatenate(start_parts)

    def _epoch_slice(self, epoch: int, within: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [within, within + n) of one epoch (its documents back to back in the epoch's order) and
        whether each begins a document. Only the order is kept per epoch, never a permuted copy of the corpus:
        memory is O(documents), so many streams over one corpus are cheap (train.RowStreams)."""
        order, new_starts = self._epoch_order(epoch)
        pos = np.arange(within, within + n)
        k = np.searchsorted(new_starts, pos, side="right") - 1  # the epoch's k-th document holds pos
        source = self.corpus.doc_offsets[:-1][order[k]] + (pos - new_starts[k])
        return self.corpus.tokens[source], pos == new_starts[k]

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, where each starts in the epoch's stream) of one epoch."""
        if epoch not in self._epoch_cache:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.corpus.num_docs)
            else:
                order = np.arange(self.corpus.num_docs)
            lengths = np.diff(self.corpus.doc_offsets)[order]
            # Epochs are visited in increasing order, so only the previous one can still be needed (by a batch
            # that straddles the boundary).
            self._epoch_cache = {e: v for e, v in self._epoch_cache.items() if e == epoch - 1}
            self._epoch_cache[epoch] = (order, np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        return self._epoch_cache[epoch]

    def state_dict(self) -> dict:
        """Everything needed to continue exactly where this iterator is (plus checks)."""
        return {"offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_tokens": self.corpus.num_tokens, "num_docs": self.corpus.num_docs}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_tokens", "num_docs"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume: the saved data state has {key}={state[key]!r} but "
                                 f"this dataset has {key}={mine[key]!r} (different corpus, tokenizer "
                                 f"or settings)")
        self.offset = int(state["offset"])
