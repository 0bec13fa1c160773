"""Turn a corpus into a stream of token rows for the model: lazily, in a fixed order, in bounded memory.

``read_documents`` reads a corpus (a text or JSONL file, a directory, a ``datasets.Dataset``, or an
iterable of strings or of token-id lists) one document at a time; ``rows`` tokenizes the documents,
adds the BOS token, and cuts or packs them into rows no longer than the context. Nothing reads
ahead of what the consumer asks for, and two passes over the same corpus give the same rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import numbers
import os
import stat
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OVERFLOW_MODES = ("truncate", "split", "pack")
DATASET_MARKERS = ("dataset_info.json", "state.json")
DATASET_BATCH = 256


class CorpusError(ValueError):
    """A corpus that cannot be read as documents: the message names the file and line (or row) and what was expected."""


@dataclass(frozen=True)
class ContextSettings:
    """How documents become rows.

    ``context_length`` is the most tokens a row holds (None: no limit). ``overflow`` says what happens to a
    document longer than that: ``"truncate"`` keeps its first ``context_length`` tokens, ``"split"`` cuts it
    into consecutive rows, ``"pack"`` concatenates all documents (separated by the tokenizer's EOS token if it
    has one) into rows of exactly ``context_length`` tokens, the last row possibly shorter. ``add_bos``
    prepends the tokenizer's BOS token to every document. ``text_field`` and ``ids_field`` name the JSONL or
    dataset fields holding the text or the pre-tokenized ids (the ids win when both are present).
    """

    context_length: int | None = None
    overflow: str = "truncate"
    add_bos: bool = True
    text_field: str = "text"
    ids_field: str = "input_ids"

    def __post_init__(self) -> None:
        length = self.context_length
        if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length <= 0):
            raise ValueError(f"context_length must be a positive int or None, not {length!r}")
        if self.overflow not in OVERFLOW_MODES:
            allowed = ", ".join(repr(mode) for mode in OVERFLOW_MODES)
            raise ValueError(f"overflow must be one of {allowed}, not {self.overflow!r}")
        if self.overflow == "pack" and length is None:
            raise ValueError("overflow='pack' needs a context_length (a positive int), not None")
        if not isinstance(self.add_bos, bool):
            raise ValueError(f"add_bos must be True or False, not {self.add_bos!r}")
        for name in ("text_field", "ids_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, not {value!r}")

    def as_dict(self) -> dict[str, Any]:
        """The settings as a JSON-serializable dict, for the manifest."""
        return dataclasses.asdict(self)


@dataclass
class Document:
    """One document of the corpus: its text, or its token ids when the corpus is pre-tokenized."""

    index: int
    source: str
    text: str | None
    token_ids: list[int] | None = None


@dataclass
class Row:
    """One model input: token ids, and for each token the document it came from and its position there."""

    token_ids: list[int] = field(default_factory=list)
    documents: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class CorpusStats:
    """Counts kept by ``rows`` as it consumes documents."""

    documents: int = 0
    empty: int = 0
    truncated: int = 0
    split: int = 0
    rows: int = 0
    tokens: int = 0
    #: Tokens of rows left out because a layout holds whole context rows only (packing's last, short row).
    left_out: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts as a JSON-serializable dict, for the manifest."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- reading


def read_documents(corpus: Any, *, settings: ContextSettings | None = None) -> Iterator[Document]:
    """The documents of ``corpus``, one at a time, in a fixed order.

    Accepts: a path (str or Path) to a ``.txt`` file (one document per line; a blank line is an empty
    document), a directory (every ``*.txt`` file in sorted order is one document; a directory written by
    ``datasets.Dataset.save_to_disk``, recognized by its ``dataset_info.json``/``state.json``, is read as that
    dataset), a ``.jsonl`` file (one JSON object per line with ``settings.text_field`` or
    ``settings.ids_field``; a blank line is an error), a ``datasets.Dataset`` (rows with either field), or an
    iterable of strings, of lists of ints (pre-tokenized), or of mappings with either field.

    Files are read line by line and iterables are consumed only as far as the caller iterates. The kind of
    corpus and the existence of a path are checked at once; everything else (unreadable files, bad lines)
    raises ``CorpusError`` when iteration reaches it, naming the file and 1-based line or the row.
    """
    settings = settings if settings is not None else ContextSettings()
    if isinstance(corpus, str | os.PathLike):
        return _read_path(Path(corpus), settings)
    if _is_dataset(corpus):
        return _read_dataset(corpus, "dataset", settings)
    if isinstance(corpus, bytes | bytearray | Mapping) or not isinstance(corpus, Iterable):
        raise CorpusError(
            f"cannot read a corpus from a {type(corpus).__name__}: expected a path, a datasets.Dataset, "
            "or an iterable of strings or of token-id lists"
        )
    return _read_items(corpus, settings)


def _is_dataset(corpus: Any) -> bool:
    datasets = sys.modules.get("datasets")  # a Dataset exists only if its module is loaded
    return datasets is not None and isinstance(corpus, datasets.Dataset)


def _read_path(path: Path, settings: ContextSettings) -> Iterator[Document]:
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
            raise CorpusError(
                f"{path}: a saved DatasetDict; expected one split's directory (one of: {splits or 'none'})"
            )
        if any((path / marker).exists() for marker in DATASET_MARKERS):
            return _read_saved_dataset(path, settings)
        files = sorted((p for p in path.glob("*.txt") if p.is_file()), key=lambda p: p.name)
        if not files:
            raise CorpusError(f"{path}: a directory with no *.txt files and no saved dataset")
        return _read_text_files(files)
    if not path.is_file():
        raise CorpusError(
            f"{path}: a {_file_kind(path)}, not a regular file or a directory; a corpus is read twice (checked, then "
            "harvested), so give a .txt or .jsonl file, or a directory"
        )
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_text_lines(path)
    if suffix == ".jsonl":
        return _read_jsonl(path, settings)
    raise CorpusError(f"{path}: unsupported file type {path.suffix!r}; expected a .txt or .jsonl file or a directory")


def _file_kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = {stat.S_ISFIFO: "named pipe (FIFO)", stat.S_ISSOCK: "socket", stat.S_ISCHR: "character device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "block device")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline), split on "\\n" only, decoded as UTF-8."""
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise CorpusError(f"{path}: cannot read ({error.strerror or error})") from error
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(f"{path}:{number}: expected UTF-8 text ({error.reason})") from error
            if line.endswith("\n"):
                line = line[:-1]
                if line.endswith("\r"):
                    line = line[:-1]
            yield number, line


def _read_text_lines(path: Path) -> Iterator[Document]:
    for index, (number, line) in enumerate(_lines(path)):
        yield Document(index=index, source=f"{path}:{number}", text=line, token_ids=None)


def _read_text_files(files: list[Path]) -> Iterator[Document]:
    for index, path in enumerate(files):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}: expected UTF-8 text ({error.reason})") from error
        except OSError as error:
            raise CorpusError(f"{path}: cannot read ({error.strerror or error})") from error
        yield Document(index=index, source=str(path), text=text, token_ids=None)


def _read_jsonl(path: Path, settings: ContextSettings) -> Iterator[Document]:
    for index, (number, line) in enumerate(_lines(path)):
        source = f"{path}:{number}"
        if not line.strip():
            raise CorpusError(f"{source}: blank line; expected a JSON object")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{source}: invalid JSON ({error.msg} at column {error.colno})") from error
        if not isinstance(record, dict):
            raise CorpusError(f"{source}: expected a JSON object, got {type(record).__name__}")
        yield _from_record(record, index, source, settings)


def _read_saved_dataset(path: Path, settings: ContextSettings) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as error:
        raise CorpusError(f"{path}: a saved dataset, but the `datasets` package is not installed") from error
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as error:  # any failure to load is a corpus error naming the path
        raise CorpusError(f"{path}: cannot load the saved dataset ({error})") from error
    if not isinstance(dataset, datasets.Dataset):
        raise CorpusError(f"{path}: expected a saved Dataset, got a {type(dataset).__name__}")
    return _read_dataset(dataset, str(path), settings)


def _read_dataset(dataset: Any, name: str, settings: ContextSettings) -> Iterator[Document]:
    columns = [c for c in (settings.ids_field, settings.text_field) if c in dataset.column_names]
    if not columns:
        raise CorpusError(
            f"{name}: expected a {settings.text_field!r} or {settings.ids_field!r} column, found {dataset.column_names}"
        )
    return _dataset_documents(dataset.select_columns(columns).with_format(None), name, settings)


def _dataset_documents(dataset: Any, name: str, settings: ContextSettings) -> Iterator[Document]:
    index = 0
    for batch in dataset.iter(batch_size=DATASET_BATCH):
        values = list(batch.values())
        for record in (dict(zip(batch, row)) for row in zip(*values)):
            yield _from_record(record, index, f"{name}[{index}]", settings)
            index += 1


def _read_items(items: Iterable[Any], settings: ContextSettings) -> Iterator[Document]:
    for index, item in enumerate(items):
        source = f"list[{index}]"
        if isinstance(item, str):
            yield Document(index=index, source=source, text=item, token_ids=None)
        elif isinstance(item, Mapping):
            yield _from_record(item, index, source, settings)
        else:
            ids = _as_id_list(item)
            if ids is None:
                raise CorpusError(
                    f"{source}: expected a string, a list of token ids, or a mapping, got {type(item).__name__}"
                )
            yield Document(index=index, source=source, text=None, token_ids=ids)


def _as_id_list(value: Any) -> list[Any] | None:
    """``value`` as a list if it is a list-like of ids (list, tuple, array or tensor), else None."""
    if isinstance(value, list | tuple):
        return list(value)
    if not isinstance(value, str | bytes) and hasattr(value, "tolist"):
        value = value.tolist()
        return value if isinstance(value, list) else None
    return None


def _from_record(record: Mapping[str, Any], index: int, source: str, settings: ContextSettings) -> Document:
    ids = record.get(settings.ids_field)
    if ids is not None:
        token_ids = _as_id_list(ids)
        if token_ids is None:
            raise CorpusError(
                f"{source}: expected {settings.ids_field!r} to be a list of ints, got {type(ids).__name__}"
            )
        return Document(index=index, source=source, text=None, token_ids=token_ids)
    text = record.get(settings.text_field)
    if text is None:
        raise CorpusError(
            f"{source}: expected a {settings.text_field!r} (string) or {settings.ids_field!r} (list of ints) field"
        )
    if not isinstance(text, str):
        raise CorpusError(f"{source}: expected {settings.text_field!r} to be a string, got {type(text).__name__}")
    return Document(index=index, source=source, text=text, token_ids=None)


# ---------------------------------------------------------------------------------------------- a harvest's corpus


class Digested:
    """Documents passed through unchanged, with a running SHA-256 of their content (text or token ids), in order."""

    def __init__(self, documents: Iterable[Document]) -> None:
        self._documents = documents
        self._digest = hashlib.sha256()

    def __iter__(self) -> Iterator[Document]:
        for document in self._documents:
            self._digest.update(_content(document))
            yield document

    def hexdigest(self) -> str:
        """The digest of every document read so far."""
        return self._digest.hexdigest()


def _content(document: Document) -> bytes:
    if document.token_ids is not None:
        try:
            data = array("q", document.token_ids).tobytes()
        except (TypeError, OverflowError):  # not ints: `rows` refuses them, naming the source
            data = repr(document.token_ids).encode()
        kind = b"ids"
    else:
        data = (document.text or "").encode("utf-8", "surrogatepass")
        kind = b"text"
    return kind + len(data).to_bytes(8, "little") + data


class Corpus:
    """A corpus opened for a harvest: its kind, its existence and its first document checked at once.

    Each `read` is a new pass over the documents (`Digested`, so the pass carries a digest of
    what it read). A one-shot iterable (an iterator or a generator) is read exactly once: its
    first document, read to check it, is handed on to that one pass, and a second `read` is
    refused.
    """

    def __init__(self, corpus: Any, settings: ContextSettings) -> None:
        self.source = corpus
        self.settings = settings
        self.one_shot = isinstance(corpus, Iterator)
        documents = read_documents(corpus, settings=settings)
        first = next(documents, None)
        if first is None:
            raise CorpusError(f"{self.description}: holds no documents")
        if self.one_shot:
            self._unread: Iterator[Document] | None = itertools.chain([first], documents)
        else:
            documents.close()
            self._unread = None

    @property
    def description(self) -> str:
        """What the corpus is, for the manifest and messages: a path, or the kind of object."""
        if isinstance(self.source, str | os.PathLike):
            return str(Path(self.source).resolve())
        if _is_dataset(self.source):
            return f"datasets.Dataset ({len(self.source)} rows)"
        return f"in-memory {type(self.source).__name__}"

    def read(self) -> Digested:
        """A pass over the documents, in order."""
        if not self.one_shot:
            return Digested(read_documents(self.source, settings=self.settings))
        if self._unread is None:
            raise CorpusError(f"{self.description}: a one-shot iterable, already read once")
        documents, self._unread = self._unread, None
        return Digested(documents)


# ---------------------------------------------------------------------------------------------- rows


def rows(
    documents: Iterable[Document], tokenizer: Any, settings: ContextSettings, stats: CorpusStats | None = None
) -> Iterator[Row]:
    """Rows of at most ``settings.context_length`` tokens from ``documents``, in order.

    Text is tokenized with ``tokenizer(text, add_special_tokens=False)["input_ids"]``; pre-tokenized ids
    are taken as given but must be ints in ``[0, len(tokenizer))`` (else ``CorpusError`` naming the source).
    With ``settings.add_bos`` each document (not each row) starts with the tokenizer's BOS token, if it has
    one and the document does not already start with it; the BOS token is position 0 of the document.
    Documents with no tokens (empty or whitespace-only text, an empty id list) are skipped and counted.
    A document longer than the context is truncated (and counted), split, or packed as
    ``settings.overflow`` says; none is dropped silently. ``stats``, when given, is updated as rows are
    produced.
    """
    stats = stats if stats is not None else CorpusStats()
    length = settings.context_length
    sequences = _token_sequences(documents, tokenizer, settings, stats)
    if settings.overflow == "pack":
        yield from _pack(sequences, length, getattr(tokenizer, "eos_token_id", None), stats)
        return
    for index, ids in sequences:
        if length is None or len(ids) <= length:
            pieces = [0]
        elif settings.overflow == "truncate":
            stats.truncated += 1
            pieces = [0]
        else:
            stats.split += 1
            pieces = range(0, len(ids), length)
        for start in pieces:
            chunk = ids[start : start + length] if length is not None else ids
            stats.rows += 1
            stats.tokens += len(chunk)
            yield Row(token_ids=chunk, documents=[index] * len(chunk), offsets=list(range(start, start + len(chunk))))


def _token_sequences(
    documents: Iterable[Document], tokenizer: Any, settings: ContextSettings, stats: CorpusStats
) -> Iterator[tuple[int, list[int]]]:
    """(document index, its token ids with BOS) for every document that has tokens."""
    bos = getattr(tokenizer, "bos_token_id", None) if settings.add_bos else None
    vocab = len(tokenizer)
    for document in documents:
        stats.documents += 1
        if document.token_ids is not None:
            ids = _checked_ids(document, vocab)
        elif document.text is None or not document.text.strip():
            ids = []
        else:
            ids = [int(i) for i in tokenizer(document.text, add_special_tokens=False)["input_ids"]]
        if not ids:
            stats.empty += 1
            continue
        if bos is not None and ids[0] != bos:
            ids.insert(0, bos)
        yield document.index, ids


def _checked_ids(document: Document, vocab: int) -> list[int]:
    ids = []
    for position, value in enumerate(document.token_ids):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise CorpusError(
                f"{document.source}: token {position} is {value!r}; expected an int token id in [0, {vocab})"
            )
        if not 0 <= value < vocab:
            raise CorpusError(
                f"{document.source}: token {position} is {int(value)}, outside the tokenizer's vocabulary [0, {vocab})"
            )
        ids.append(int(value))
    return ids


def _pack(
    sequences: Iterator[tuple[int, list[int]]], length: int, eos: int | None, stats: CorpusStats
) -> Iterator[Row]:
    """Concatenate the sequences into rows of exactly ``length`` tokens (the last may be shorter).

    Between two documents goes the EOS token (when there is one), counted as the last position of the
    document before it. A document whose own tokens land in more than one row counts as split.
    """
    tokens: list[int] = []
    documents: list[int] = []
    offsets: list[int] = []
    emitted = 0  # tokens already emitted in full rows
    previous: tuple[int, int] | None = None  # (index, token count) of the last document placed
    for index, ids in sequences:
        if previous is not None and eos is not None:
            tokens.append(eos)
            documents.append(previous[0])
            offsets.append(previous[1])
        start = emitted + len(tokens)
        if start // length != (start + len(ids) - 1) // length:
            stats.split += 1
        tokens.extend(ids)
        documents.extend([index] * len(ids))
        offsets.extend(range(len(ids)))
        previous = (index, len(ids))
        cut = 0
        while len(tokens) - cut >= length:
            stats.rows += 1
            stats.tokens += length
            yield Row(
                token_ids=tokens[cut : cut + length],
                documents=documents[cut : cut + length],
                offsets=offsets[cut : cut + length],
            )
            cut += length
        if cut:
            del tokens[:cut], documents[:cut], offsets[:cut]
            emitted += cut
    if tokens:
        stats.rows += 1
        stats.tokens += len(tokens)
        yield Row(token_ids=tokens, documents=documents, offsets=offsets)
