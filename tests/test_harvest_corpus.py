"""The corpus reader: every input kind, BOS and overflow semantics, stats, errors, determinism, laziness."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import tiny

from nnterp_vllm.harvest import corpus as corpus_module
from nnterp_vllm.harvest.corpus import (
    ContextSettings,
    CorpusError,
    CorpusStats,
    Document,
    Row,
    read_documents,
    rows,
)

BOS, EOS = 1, 2
# The tiny byte-level tokenizer: "a".."h" are 67..74, " " is 223.
A, B, C, D, E, F, G, H = range(67, 75)
SPACE = 223


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


class NoSpecials:
    """The tiny tokenizer without BOS and EOS tokens."""

    bos_token_id = None
    eos_token_id = None

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text, add_special_tokens=True):
        return self.inner(text, add_special_tokens=add_special_tokens)

    def __len__(self):
        return len(self.inner)


def counts(**nonzero):
    """``CorpusStats.as_dict()`` with the given counts and zero elsewhere."""
    return {**CorpusStats().as_dict(), **nonzero}


def docs(corpus, **settings):
    return list(read_documents(corpus, settings=ContextSettings(**settings)))


def summary(documents):
    return [(d.index, d.source, d.text, d.token_ids) for d in documents]


def table(produced):
    return [(r.token_ids, r.documents, r.offsets) for r in produced]


def run(corpus, tokenizer, **settings):
    context = ContextSettings(**settings)
    stats = CorpusStats()
    produced = list(rows(read_documents(corpus, settings=context), tokenizer, context, stats))
    return table(produced), stats


# ---------------------------------------------------------------------------------------------- settings


def test_tokenizer_ids_are_what_the_tests_assume(tok):
    assert tok("abcdefgh ", add_special_tokens=False)["input_ids"] == [A, B, C, D, E, F, G, H, SPACE]
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (BOS, EOS, 259)


def test_settings_defaults_and_as_dict():
    settings = ContextSettings(context_length=8, overflow="split", add_bos=False, text_field="body")
    as_dict = settings.as_dict()
    assert as_dict == {
        "context_length": 8,
        "overflow": "split",
        "add_bos": False,
        "text_field": "body",
        "ids_field": "input_ids",
    }
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert ContextSettings().as_dict()["context_length"] is None
    assert ContextSettings().overflow == "truncate"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"context_length": 0}, ["context_length", "positive int or None"]),
        ({"context_length": -3}, ["context_length", "positive int or None"]),
        ({"context_length": 2.5}, ["context_length", "positive int or None"]),
        ({"context_length": True}, ["context_length", "positive int or None"]),
        ({"overflow": "wrap"}, ["overflow", "'truncate', 'split', 'pack'", "'wrap'"]),
        ({"overflow": "pack"}, ["overflow='pack'", "context_length"]),
        ({"add_bos": "yes"}, ["add_bos"]),
        ({"text_field": ""}, ["text_field"]),
        ({"ids_field": 3}, ["ids_field"]),
    ],
)
def test_bad_settings_name_the_field_and_allowed_values(kwargs, names):
    with pytest.raises(ValueError) as raised:
        ContextSettings(**kwargs)
    for name in names:
        assert name in str(raised.value)


def test_stats_as_dict():
    stats = CorpusStats(documents=3, empty=1, rows=2, tokens=9)
    expected = {"documents": 3, "empty": 1, "truncated": 0, "split": 0, "rows": 2, "tokens": 9, "left_out": 0}
    assert stats.as_dict() == expected


# ---------------------------------------------------------------------------------------------- reading


def test_text_file_one_document_per_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"ab\n\ncd\r\n  \nlast")
    assert summary(docs(path)) == [
        (0, f"{path}:1", "ab", None),
        (1, f"{path}:2", "", None),
        (2, f"{path}:3", "cd", None),
        (3, f"{path}:4", "  ", None),
        (4, f"{path}:5", "last", None),
    ]
    assert summary(docs(str(path))) == summary(docs(path))


def test_text_file_trailing_newline_adds_no_document(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("one\ntwo\n", encoding="utf-8")
    assert [d.text for d in docs(path)] == ["one", "two"]


def test_directory_of_text_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second\nline", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "c.txt").write_text("", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / "sub.txt").mkdir()
    assert summary(docs(tmp_path)) == [
        (0, str(tmp_path / "a.txt"), "first", None),
        (1, str(tmp_path / "b.txt"), "second\nline", None),
        (2, str(tmp_path / "c.txt"), "", None),
    ]


def test_jsonl_text_and_ids(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [{"text": "ab", "meta": 1}, {"input_ids": [5, 6]}, {"text": "ignored", "input_ids": [7]}, {"text": ""}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    assert summary(docs(path)) == [
        (0, f"{path}:1", "ab", None),
        (1, f"{path}:2", None, [5, 6]),
        (2, f"{path}:3", None, [7]),
        (3, f"{path}:4", "", None),
    ]


def test_jsonl_custom_fields(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "xy", "text": 3}\n{"toks": [9]}\n', encoding="utf-8")
    assert summary(docs(path, text_field="body", ids_field="toks")) == [
        (0, f"{path}:1", "xy", None),
        (1, f"{path}:2", None, [9]),
    ]


def test_dataset_object_text_and_ids():
    text = datasets.Dataset.from_dict({"text": ["ab", "", "c"], "label": [0, 1, 2]})
    assert summary(docs(text)) == [
        (0, "dataset[0]", "ab", None),
        (1, "dataset[1]", "", None),
        (2, "dataset[2]", "c", None),
    ]
    ids = datasets.Dataset.from_dict({"input_ids": [[3, 4], [], [5]]})
    assert summary(docs(ids)) == [
        (0, "dataset[0]", None, [3, 4]),
        (1, "dataset[1]", None, []),
        (2, "dataset[2]", None, [5]),
    ]


def test_dataset_with_a_tensor_format_yields_plain_ids():
    dataset = datasets.Dataset.from_dict({"input_ids": [[3, 4], [5]]}).with_format("numpy")
    assert [d.token_ids for d in docs(dataset)] == [[3, 4], [5]]


def test_dataset_spanning_several_batches_keeps_order():
    count = corpus_module.DATASET_BATCH * 2 + 7
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(count)]})
    read = docs(dataset)
    assert [d.index for d in read] == list(range(count))
    assert [d.text for d in read] == [f"doc {i}" for i in range(count)]


def test_saved_dataset_directory(tmp_path):
    datasets.Dataset.from_dict({"text": ["ab", "cd"], "other": [1, 2]}).save_to_disk(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    assert (saved / "state.json").exists()
    assert summary(docs(saved)) == [(0, f"{saved}[0]", "ab", None), (1, f"{saved}[1]", "cd", None)]


def test_saved_dataset_dict_asks_for_a_split(tmp_path):
    dataset = datasets.Dataset.from_dict({"text": ["ab"]})
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CorpusError, match=r"dd: a saved DatasetDict; expected one split's directory \(one of: train\)"):
        read_documents(tmp_path / "dd")
    assert [d.text for d in docs(tmp_path / "dd" / "train")] == ["ab"]


def test_dataset_without_the_fields():
    dataset = datasets.Dataset.from_dict({"content": ["ab"]})
    with pytest.raises(CorpusError, match=r"dataset: expected a 'text' or 'input_ids' column, found \['content'\]"):
        read_documents(dataset)
    assert [d.text for d in docs(dataset, text_field="content")] == ["ab"]


def test_lists_and_iterables():
    assert summary(docs(["ab", "", "c"])) == [
        (0, "list[0]", "ab", None),
        (1, "list[1]", "", None),
        (2, "list[2]", "c", None),
    ]
    assert summary(docs([[1, 2], [], (3,)])) == [
        (0, "list[0]", None, [1, 2]),
        (1, "list[1]", None, []),
        (2, "list[2]", None, [3]),
    ]
    assert summary(docs(text for text in ("x", "y"))) == [(0, "list[0]", "x", None), (1, "list[1]", "y", None)]
    assert summary(docs([{"text": "m"}, {"input_ids": [4]}])) == [(0, "list[0]", "m", None), (1, "list[1]", None, [4])]


# ---------------------------------------------------------------------------------------------- reading errors


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match=rf"^{missing}: no such file or directory$"):
        read_documents(missing)


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("ab\n", encoding="utf-8")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(corpus_module, "open", refuse, raising=False)
    documents = read_documents(path)  # opened lazily
    with pytest.raises(CorpusError, match=rf"^{path}: cannot read \(Permission denied\)$"):
        next(documents)


def test_unreadable_file_in_directory(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("ab", encoding="utf-8")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(corpus_module.Path, "read_text", refuse)
    with pytest.raises(CorpusError, match=r"a\.txt: cannot read \(Permission denied\)$"):
        docs(tmp_path)


def test_unsupported_paths(tmp_path):
    other = tmp_path / "corpus.csv"
    other.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"corpus\.csv: unsupported file type '\.csv'; expected a \.txt or \.jsonl"):
        read_documents(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match=r"empty: a directory with no \*\.txt files and no saved dataset"):
        read_documents(empty)


def special_file(kind: str, directory) -> tuple[Path, Any]:
    """A path of ``kind`` (a named pipe, a socket, a character device) and what keeps it alive."""
    if kind == "character device":
        return Path("/dev/null"), None
    path = directory / "corpus.txt"
    if kind == "named pipe (FIFO)":
        os.mkfifo(path)
        return path, None
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    return path, listener


@pytest.mark.parametrize("kind", ["named pipe (FIFO)", "socket", "character device"])
def test_a_path_that_is_no_regular_file_or_directory_is_refused_before_it_is_opened(tmp_path, kind):
    path, keep = special_file(kind, tmp_path)
    try:
        with pytest.raises(CorpusError, match=rf"^{path}: a {re.escape(kind)}, not a regular file or a directory"):
            read_documents(path)  # a FIFO would block here, waiting for a writer
    finally:
        if keep is not None:
            keep.close()


def test_the_harvest_command_refuses_a_fifo_corpus_at_once_and_writes_nothing(tmp_path):
    fifo, _ = special_file("named pipe (FIFO)", tmp_path)
    out = tmp_path / "acts"
    command = [str(Path(sys.executable).with_name("nnterp-vllm")), "harvest", str(tiny.checkpoint("llama"))]
    command += ["--corpus", str(fifo), "--values", "layers.1.layer_output", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("nnterp-vllm: error:")]
    assert "a named pipe (FIFO), not a regular file or a directory" in line and "give a .txt or .jsonl" in line
    assert not out.exists()


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"ok\nbad \xff byte\n")
    documents = read_documents(path)
    assert next(documents).text == "ok"
    with pytest.raises(CorpusError, match=rf"^{path}:2: expected UTF-8 text"):
        next(documents)


def test_utf8_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "ab"}\n')
    assert [d.text for d in docs(path)] == ["ab"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ab"', r"invalid JSON \(Expecting ',' delimiter at column 14\)"),
        ("", r"blank line; expected a JSON object"),
        ("   ", r"blank line; expected a JSON object"),
        ('["ab"]', r"expected a JSON object, got list"),
        ('{"body": "ab"}', r"expected a 'text' \(string\) or 'input_ids' \(list of ints\) field"),
        ('{"text": 5}', r"expected 'text' to be a string, got int"),
        ('{"input_ids": "12"}', r"expected 'input_ids' to be a list of ints, got str"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text(f'{{"text": "a"}}\n{{"text": "b"}}\n{line}\n{{"text": "c"}}\n', encoding="utf-8")
    documents = read_documents(path)
    assert [next(documents).text, next(documents).text] == ["a", "b"]  # the lines before the bad one are fine
    with pytest.raises(CorpusError, match=rf"^{path}:3: {message}$"):
        next(documents)


def test_bad_items_and_corpus_types():
    with pytest.raises(
        CorpusError, match=r"^list\[1\]: expected a string, a list of token ids, or a mapping, got int$"
    ):
        docs(["ok", 5])
    with pytest.raises(CorpusError, match=r"^list\[0\]: expected a 'text' \(string\) or 'input_ids'"):
        docs([{"body": "x"}])
    for bad in (42, b"bytes", {"text": "a"}):
        with pytest.raises(CorpusError, match=r"cannot read a corpus from a (int|bytes|dict)"):
            read_documents(bad)


# ---------------------------------------------------------------------------------------------- rows


def test_no_limit_one_row_per_document_with_bos(tok):
    table_, stats = run(["ab", "c"], tok)
    assert table_ == [([BOS, A, B], [0, 0, 0], [0, 1, 2]), ([BOS, C], [1, 1], [0, 1])]
    assert stats.as_dict() == counts(documents=2, rows=2, tokens=5)


def test_bos_off(tok):
    table_, _ = run(["ab", "c"], tok, add_bos=False)
    assert table_ == [([A, B], [0, 0], [0, 1]), ([C], [1], [0])]


def test_bos_not_doubled(tok):
    table_, _ = run(["<s>ab", [BOS, 5], [6]], tok)
    assert table_ == [([BOS, A, B], [0, 0, 0], [0, 1, 2]), ([BOS, 5], [1, 1], [0, 1]), ([BOS, 6], [2, 2], [0, 1])]


def test_tokenizer_without_bos_or_eos(tok):
    plain = NoSpecials(tok)
    table_, _ = run(["ab", "c"], plain)
    assert table_ == [([A, B], [0, 0], [0, 1]), ([C], [1], [0])]
    packed, _ = run(["ab", "cd", "e"], plain, context_length=3, overflow="pack")
    assert packed == [([A, B, C], [0, 0, 1], [0, 1, 0]), ([D, E], [1, 2], [1, 0])]


def test_empty_documents_skipped_and_counted(tok, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("ab\n\n   \nc\n\t\n", encoding="utf-8")
    table_, stats = run(path, tok)
    assert table_ == [([BOS, A, B], [0, 0, 0], [0, 1, 2]), ([BOS, C], [3, 3], [0, 1])]
    assert (stats.documents, stats.empty, stats.rows, stats.tokens) == (5, 3, 2, 5)
    ids_table, ids_stats = run([[], [7], []], tok)
    assert ids_table == [([BOS, 7], [1, 1], [0, 1])]
    assert (ids_stats.documents, ids_stats.empty) == (3, 2)


def test_truncate(tok):
    table_, stats = run(["abcdef", "ab", "abc"], tok, context_length=3)
    assert table_ == [
        ([BOS, A, B], [0, 0, 0], [0, 1, 2]),
        ([BOS, A, B], [1, 1, 1], [0, 1, 2]),
        ([BOS, A, B], [2, 2, 2], [0, 1, 2]),
    ]
    assert stats.as_dict() == counts(documents=3, truncated=2, rows=3, tokens=9)


def test_split(tok):
    table_, stats = run(["abcdefg", "", "ab"], tok, context_length=3, overflow="split")
    assert table_ == [
        ([BOS, A, B], [0, 0, 0], [0, 1, 2]),
        ([C, D, E], [0, 0, 0], [3, 4, 5]),
        ([F, G], [0, 0], [6, 7]),
        ([BOS, A, B], [2, 2, 2], [0, 1, 2]),
    ]
    assert stats.as_dict() == counts(documents=3, empty=1, split=1, rows=4, tokens=11)


def test_split_exact_multiple_of_context(tok):
    table_, stats = run(["abcde"], tok, context_length=3, overflow="split")
    assert table_ == [([BOS, A, B], [0, 0, 0], [0, 1, 2]), ([C, D, E], [0, 0, 0], [3, 4, 5])]
    assert (stats.split, stats.rows, stats.tokens) == (1, 2, 6)


def test_pack_with_eos_separators(tok):
    table_, stats = run(["ab", "", "cde", "f"], tok, context_length=3, overflow="pack")
    # stream: <s> a b </s> | <s> c d e </s> | <s> f   (the EOS belongs to the document before it)
    assert table_ == [
        ([BOS, A, B], [0, 0, 0], [0, 1, 2]),
        ([EOS, BOS, C], [0, 2, 2], [3, 0, 1]),
        ([D, E, EOS], [2, 2, 2], [2, 3, 4]),
        ([BOS, F], [3, 3], [0, 1]),
    ]
    assert stats.as_dict() == counts(documents=4, empty=1, split=1, rows=4, tokens=11)


def test_pack_rows_are_exactly_the_context_and_keep_every_token(tok):
    texts = ["abcdefgh" * 3, "a", "bc", "defgh" * 5, "", "h"]
    table_, stats = run(texts, tok, context_length=5, overflow="pack", add_bos=False)
    assert all(len(ids) == 5 for ids, _, _ in table_[:-1]) and 0 < len(table_[-1][0]) <= 5
    stream = [token for ids, _, _ in table_ for token in ids]
    expected = []
    for text in [t for t in texts if t]:
        expected += tok(text, add_special_tokens=False)["input_ids"] + [EOS]
    assert stream == expected[:-1]
    assert stats.tokens == len(stream) and stats.rows == len(table_) and stats.empty == 1
    assert stats.split == 2  # the two long documents cross a row boundary


def test_pack_single_row_and_long_document(tok):
    short, _ = run(["ab"], tok, context_length=8, overflow="pack")
    assert short == [([BOS, A, B], [0, 0, 0], [0, 1, 2])]
    long, stats = run([[5] * 7], tok, context_length=2, overflow="pack")
    assert long == [
        ([BOS, 5], [0, 0], [0, 1]),
        ([5, 5], [0, 0], [2, 3]),
        ([5, 5], [0, 0], [4, 5]),
        ([5, 5], [0, 0], [6, 7]),
    ]
    assert (stats.split, stats.rows, stats.tokens) == (1, 4, 8)


def test_documents_built_by_hand(tok):
    documents = [Document(index=10, source="mine", text="ab", token_ids=None), Document(11, "mine2", None, [4])]
    produced = list(rows(documents, tok, ContextSettings()))
    assert produced == [Row([BOS, A, B], [10, 10, 10], [0, 1, 2]), Row([BOS, 4], [11, 11], [0, 1])]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([3, 259], r"token 1 is 259, outside the tokenizer's vocabulary \[0, 259\)"),
        ([-1], r"token 0 is -1, outside the tokenizer's vocabulary \[0, 259\)"),
        ([3, 4.0], r"token 1 is 4\.0; expected an int token id in \[0, 259\)"),
        (["3"], r"token 0 is '3'; expected an int token id in \[0, 259\)"),
        ([True], r"token 0 is True; expected an int token id in \[0, 259\)"),
    ],
)
def test_bad_token_ids_name_the_source(tok, tmp_path, ids, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"input_ids": [5]}) + "\n" + json.dumps({"input_ids": ids}) + "\n", encoding="utf-8")
    settings = ContextSettings()
    produced = rows(read_documents(path, settings=settings), tok, settings)
    assert next(produced).token_ids == [BOS, 5]
    with pytest.raises(CorpusError, match=rf"^{path}:2: {message}$"):
        next(produced)


def test_bad_token_ids_in_a_list(tok):
    with pytest.raises(CorpusError, match=r"^list\[1\]: token 2 is 300"):
        list(rows(read_documents([[1], [1, 2, 300]]), tok, ContextSettings()))


# ---------------------------------------------------------------------------------------------- determinism, laziness


def test_two_passes_give_identical_rows(tok, tmp_path):
    path = tmp_path / "corpus.jsonl"
    records = [
        {"text": "abc " * (i % 7) + "h"} if i % 3 else {"input_ids": list(range(3, 3 + i % 11))} for i in range(60)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for overflow in ("truncate", "split", "pack"):
        first = run(path, tok, context_length=6, overflow=overflow)
        second = run(path, tok, context_length=6, overflow=overflow)
        assert first[0] == second[0] and first[1] == second[1]
        assert first[1].documents == 60


def test_reading_is_lazy(tok):
    consumed = []

    def texts():
        for i in range(3):
            consumed.append(i)
            yield "ab"
        raise RuntimeError("read past the third document")

    settings = ContextSettings()
    stats = CorpusStats()
    produced = rows(read_documents(texts(), settings=settings), tok, settings, stats)
    assert consumed == []  # nothing read before the first row is asked for
    assert [next(produced).documents[0] for _ in range(3)] == [0, 1, 2]
    assert consumed == [0, 1, 2] and stats.documents == 3 and stats.rows == 3
    with pytest.raises(RuntimeError, match="read past the third document"):
        next(produced)


def test_packing_reads_only_what_a_row_needs(tok):
    consumed = []

    def texts():
        for i in range(1000):
            consumed.append(i)
            yield "abc"

    settings = ContextSettings(context_length=8, overflow="pack")
    produced = rows(read_documents(texts(), settings=settings), tok, settings)
    first = next(produced)  # <s> a b c </s> <s> a b  -> two documents
    assert first.documents == [0, 0, 0, 0, 0, 1, 1, 1]
    assert consumed == [0, 1]


def test_file_is_read_line_by_line(tok, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "ab"}\n{"text": "cd"}\nnot json\n', encoding="utf-8")
    settings = ContextSettings()
    produced = rows(read_documents(path, settings=settings), tok, settings)
    assert [next(produced).token_ids, next(produced).token_ids] == [[BOS, A, B], [BOS, C, D]]
    with pytest.raises(CorpusError, match=rf"^{path}:3: invalid JSON"):
        next(produced)


# ---------------------------------------------------------------------------------------------- a real tokenizer


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from nnterp_vllm.checkpoints import smollm2

    return AutoTokenizer.from_pretrained(smollm2())


def test_smollm2_tokenizer(smol, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("Hello world\n\nHello world\n", encoding="utf-8")
    hello = smol("Hello world", add_special_tokens=False)["input_ids"]
    assert len(hello) == 2
    bos, eos = smol.bos_token_id, smol.eos_token_id
    assert bos is not None and eos is not None
    unlimited, stats = run(path, smol)
    assert unlimited == [([bos, *hello], [0, 0, 0], [0, 1, 2]), ([bos, *hello], [2, 2, 2], [0, 1, 2])]
    assert (stats.documents, stats.empty) == (3, 1)
    packed, _ = run(path, smol, context_length=4, overflow="pack")
    assert packed == [([bos, *hello, eos], [0, 0, 0, 0], [0, 1, 2, 3]), ([bos, *hello], [2, 2, 2], [0, 1, 2])]
    with pytest.raises(CorpusError, match=rf"list\[0\]: token 0 is {len(smol)}, outside"):
        list(rows(read_documents([[len(smol)]]), smol, ContextSettings()))
