#!/usr/bin/env python
"""Fetch a real tokenizer and real long documents from PyPI and Debian into a local cache.

Everything comes through the two package registries with their ordinary clients
(``python -m pip download`` and ``apt-get download`` + ``dpkg -x``); nothing else is contacted.

Outputs, under ``--out-dir`` (default ``$MTRAINING_DATA`` or ``<repo>/data``; never committed):

* ``tokenizer/mistral_v1.model``: the Mistral v1 sentencepiece model (32 000 pieces, Apache-2.0)
  from the ``mistral-common`` wheel, with its licence as ``tokenizer/mistral_v1.LICENSE``.
* ``corpus/<name>.jsonl``: one ``{"source", "id", "license", "text"}`` record per document.
* ``corpus/<name>.licenses.json`` and ``corpus/<name>.LICENSES.md``: per-source document count,
  bytes, tokens and licence, plus where each source was fetched from.
* ``downloads/`` and ``extracted/``: the downloaded packages and their unpacked contents (cache).

The run is idempotent: if the corpus, its licence summary and the tokenizer already exist, it
prints the stored table and does nothing (``--force`` rebuilds the corpus from the cache).

Sources (``--sources``, comma separated, or ``all``):

  books          Canterbury corpus texts (brotli 1.2.1 sdist) + Botchan (sentencepiece 0.2.3 sdist)
  austen         6 Jane Austen novels (Debian r-cran-janeaustenr; installs PyPI rdata on demand)
  bible          World English Bible, OT + NT (Debian sword-text-web)
  python_docs    Python 3.11 reST docs, one document per section (Debian python3.11-doc)
  perl_docs      Perl pod pages, one document per pod (Debian perl-doc)
  postgres_docs  PostgreSQL 15 manual as text, one document per page family (Debian postgresql-doc-15)
  linux          Linux 6.1 Documentation/ per subdirectory + .c files >= 256 KB (Debian
                 linux-source-6.1, a 139 MB download; only when named)
"""

from __future__ import annotations

import argparse
import collections
import html.parser
import importlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from megatron_mtraining.data.corpus import (
    Document,
    default_data_dir,
    format_licenses_md,
    format_table,
    stats_from_json,
    stats_to_json,
    summarize_corpus,
    write_atomic,
    write_jsonl,
)

TOKENIZER_WHEEL = "mistral-common==1.13.1"
TOKENIZER_MEMBER = "mistral_common/data/tokenizer.model.v1"
TOKENIZER_VOCAB = 32000
RDATA_SPEC = "rdata==1.1.0"
MIN_DOC_CHARS = 1000  # shorter texts (stubs, index pages) are dropped
LINUX_BIG_C_BYTES = 256_000


class FetchError(RuntimeError):
    """A package could not be downloaded or unpacked; the message says which and why."""


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command, capturing output; never raises on a non-zero exit."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _decode(data: bytes) -> str:
    """Decode bytes as UTF-8 (dropping a BOM), falling back to Latin-1 for legacy texts; normalise CRLF."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n")


def _doc(source: str, doc_id: str, license_: str, text: str) -> Document | None:
    """Build a corpus record, or None if the text is too short to be a useful document."""
    text = text.replace("\r\n", "\n")
    if len(text) < MIN_DOC_CHARS:
        return None
    return Document(source=source, id=doc_id, license=license_, text=text)


class Cache:
    """Downloads and unpacks registry packages under ``<out>/downloads`` and ``<out>/extracted``,
    reusing whatever an earlier run left there."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.downloads = out_dir / "downloads"
        self.extracted = out_dir / "extracted"
        self._apt_updated = False

    def pip_download(self, spec: str, sdist: bool) -> Path:
        """Download one PyPI distribution (``name==version``) without dependencies.

        Args:
            spec: a pinned requirement, e.g. ``brotli==1.2.1``.
            sdist: fetch the source distribution (``--no-binary :all:``) instead of a wheel.

        Returns:
            Path of the downloaded archive (cached under ``downloads/pypi/<spec>/``).

        Raises:
            FetchError: pip failed (its output is included).
        """
        dest = self.downloads / "pypi" / spec.replace("==", "-")
        found = sorted(p for p in dest.glob("*") if p.suffix in (".whl", ".gz", ".zip"))
        if found:
            return found[0]
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
        if sdist:
            cmd += ["--no-binary", ":all:"]
        print(f"  pip download {spec}{' (sdist)' if sdist else ''}", flush=True)
        res = _run(cmd + [spec])
        found = sorted(p for p in dest.glob("*") if p.suffix in (".whl", ".gz", ".zip"))
        if res.returncode != 0 or not found:
            raise FetchError(f"pip download {spec} failed (exit {res.returncode}):\n{res.stdout}{res.stderr}")
        return found[0]

    def sdist_members(self, spec: str, wanted: Iterable[str]) -> dict[str, bytes]:
        """Read selected files out of a PyPI sdist without unpacking the rest.

        Args:
            spec: pinned requirement of the sdist.
            wanted: paths inside the sdist relative to its top directory, e.g. ``test/botchan.txt``.

        Returns:
            Mapping from each wanted path to its content.

        Raises:
            FetchError: the download failed or a wanted file is missing from the archive.
        """
        archive = self.pip_download(spec, sdist=True)
        wanted = set(wanted)
        out: dict[str, bytes] = {}
        with tarfile.open(archive) as tf:
            for m in tf.getmembers():
                rel = m.name.split("/", 1)[-1]
                if m.isfile() and rel in wanted:
                    out[rel] = tf.extractfile(m).read()
        if missing := wanted - out.keys():
            raise FetchError(f"{archive.name} lacks {sorted(missing)}")
        return out

    def deb_root(self, package: str) -> tuple[Path, str]:
        """Download a Debian binary package and unpack it with ``dpkg -x`` (no install, no deps).

        Returns:
            (root directory of the unpacked files, the .deb file name with its version).

        Raises:
            FetchError: apt-get/dpkg are missing, or download/unpack failed (with their output).
        """
        for tool in ("apt-get", "dpkg"):
            if shutil.which(tool) is None:
                raise FetchError(f"source needs Debian package {package!r}, but {tool} is not on PATH "
                                 "(this source works only on Debian/Ubuntu)")
        debdir = self.downloads / "deb"
        debdir.mkdir(parents=True, exist_ok=True)
        debs = sorted(debdir.glob(f"{package}_*.deb"))
        if not debs:
            print(f"  apt-get download {package}", flush=True)
            res = _run(["apt-get", "download", package], cwd=debdir)
            if res.returncode != 0 and not self._apt_updated:
                print("  apt-get download failed; running apt-get update once and retrying", flush=True)
                upd = _run(["apt-get", "update"])
                self._apt_updated = True
                if upd.returncode != 0:
                    raise FetchError(f"apt-get update failed (exit {upd.returncode}; needs root and access to "
                                     f"the Debian mirror):\n{upd.stdout}{upd.stderr}")
                res = _run(["apt-get", "download", package], cwd=debdir)
            debs = sorted(debdir.glob(f"{package}_*.deb"))
            if res.returncode != 0 or not debs:
                raise FetchError(f"apt-get download {package} failed (exit {res.returncode}):\n"
                                 f"{res.stdout}{res.stderr}")
        deb = debs[-1]
        root = self.extracted / "deb" / package
        done = root / ".unpacked"
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            res = _run(["dpkg", "-x", str(deb), str(root)])
            if res.returncode != 0:
                raise FetchError(f"dpkg -x {deb.name} failed (exit {res.returncode}):\n{res.stderr}")
            done.write_text(deb.name + "\n")
        return root, deb.name

    def tokenizer(self) -> Path:
        """Fetch the Mistral v1 sentencepiece model and check that it loads with 32 000 pieces.

        Returns:
            Path of ``tokenizer/mistral_v1.model``.

        Raises:
            FetchError: download failed, the member is missing, or the model is not the expected one.
        """
        dest = self.out_dir / "tokenizer" / "mistral_v1.model"
        if not dest.exists():
            wheel = self.pip_download(TOKENIZER_WHEEL, sdist=False)
            with zipfile.ZipFile(wheel) as zf:
                names = zf.namelist()
                if TOKENIZER_MEMBER not in names:
                    raise FetchError(f"{wheel.name} lacks {TOKENIZER_MEMBER}")
                lic = next((n for n in names if n.endswith(".dist-info/licenses/LICENSE")), None)
                if lic:
                    write_atomic(dest.with_suffix(".LICENSE"), zf.read(lic))
                write_atomic(dest, zf.read(TOKENIZER_MEMBER))
        import sentencepiece as spm

        try:
            vocab = spm.SentencePieceProcessor(model_file=str(dest)).get_piece_size()
        except (OSError, RuntimeError) as e:
            raise FetchError(f"{dest} does not load in sentencepiece ({e}); delete it and rerun") from None
        if vocab != TOKENIZER_VOCAB:
            raise FetchError(f"{dest} has {vocab} pieces, expected {TOKENIZER_VOCAB}; delete it and rerun")
        return dest


# --------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    """A selectable document source.

    Attributes:
        name: value used in ``--sources`` and in the records' ``source`` field.
        help: one-line description for ``--help``.
        fetch: produces the documents from the cache; returns (documents, provenance text).
    """

    name: str
    help: str
    fetch: Callable[[Cache], tuple[list[Document], str]]


# brotli sdist tests/testdata: Alice's Adventures in Wonderland, As You Like It, the Library of
# Congress "Workshop on Electronic Texts" proceedings (1992) and Paradise Lost.
CANTERBURY = ("alice29", "asyoulik", "lcet10", "plrabn12")


def fetch_books(cache: Cache) -> tuple[list[Document], str]:
    """Public-domain books shipped as test data in two PyPI sdists (Canterbury corpus + Botchan)."""
    lic_cant = "public-domain text; brotli sdist MIT"
    docs = []
    files = cache.sdist_members("brotli==1.2.1", [f"tests/testdata/{f}.txt" for f in CANTERBURY])
    for name in CANTERBURY:
        docs.append(_doc("books", f"canterbury/{name}", lic_cant, _decode(files[f"tests/testdata/{name}.txt"])))
    botchan = cache.sdist_members("sentencepiece==0.2.3", ["test/botchan.txt"])["test/botchan.txt"]
    docs.append(_doc("books", "gutenberg/botchan", "public-domain text; sentencepiece sdist Apache-2.0",
                     _decode(botchan)))
    return [d for d in docs if d], "PyPI sdists brotli 1.2.1 (tests/testdata), sentencepiece 0.2.3 (test/botchan.txt)"


def _import_rdata():
    """Import the PyPI ``rdata`` package, pip-installing it into this interpreter if absent."""
    try:
        return importlib.import_module("rdata")
    except ImportError:
        print(f"  austen: the R data reader is missing; installing PyPI {RDATA_SPEC} into {sys.prefix} "
              "(pulls numpy, pandas, xarray)", flush=True)
        res = _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", RDATA_SPEC])
        if res.returncode != 0:
            raise FetchError(f"pip install {RDATA_SPEC} failed (exit {res.returncode}):\n{res.stdout}{res.stderr}")
        importlib.invalidate_caches()
        return importlib.import_module("rdata")


def fetch_austen(cache: Cache) -> tuple[list[Document], str]:
    """Six Austen novels from the R lazy-load database of Debian r-cran-janeaustenr (no R needed).

    The ``.rdx`` index (gzip-compressed R serialisation) maps each dataset to an (offset, length)
    in the ``.rdb`` file, where each entry is a 4-byte length followed by a zlib stream holding
    an R character vector with one element per line of the novel.
    """
    import gzip
    import warnings

    rdata = _import_rdata()
    root, deb = cache.deb_root("r-cran-janeaustenr")
    ddir = root / "usr/lib/R/site-library/janeaustenr/data"

    def parse(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress((ddir / "Rdata.rdx").read_bytes()))
    blob = (ddir / "Rdata.rdb").read_bytes()
    docs = []
    for name, (off, length) in sorted(index["variables"].items()):
        lines = parse(zlib.decompress(blob[int(off) + 4:int(off) + int(length)]))
        text = "\n".join("" if x is None else str(x) for x in lines)
        docs.append(_doc("austen", name, "public-domain text (r-cran-janeaustenr package MIT)", text))
    return [d for d in docs if d], f"Debian {deb}"


_OSIS_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
_OSIS_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r" (?=[,.;:!?\u2019\u201d)])")


def read_sword_ztext(module_dir: Path, testament: str) -> list[str]:
    """Read one testament of a SWORD zText module (OSIS markup) as plain-text lines.

    File layout: ``<t>.bzs`` holds 12-byte block records (offset, compressed size, size: u32 LE)
    into ``<t>.bzz`` (zlib streams); ``<t>.bzv`` holds 10-byte verse records (block u32, start
    u32, size u16) into the decompressed block. Notes are dropped (leaving a word break), titles
    become their own lines, other markup is stripped; entries with no text (milestones) are skipped.

    Args:
        module_dir: directory with the ``ot.*``/``nt.*`` files.
        testament: ``"ot"`` or ``"nt"``.

    Returns:
        One string per verse or heading, in canonical order.
    """
    bzs, bzz, bzv = ((module_dir / f"{testament}.{ext}").read_bytes() for ext in ("bzs", "bzz", "bzv"))
    blocks: dict[int, bytes] = {}
    lines: list[str] = []
    for i in range(len(bzv) // 10):
        block, start, size = struct.unpack_from("<IIH", bzv, i * 10)
        if size == 0:
            continue
        if block not in blocks:
            off, csize, _ = struct.unpack_from("<III", bzs, block * 12)
            blocks[block] = zlib.decompress(bzz[off:off + csize])
        raw = blocks[block][start:start + size].decode("utf-8", "replace")
        raw = _OSIS_NOTE.sub(" ", raw)  # a note can sit between two words; the space is undone before punctuation
        raw = _OSIS_TITLE.sub(lambda m: "\n" + m.group(1) + "\n", raw)
        for part in _TAG.sub("", raw).split("\n"):
            part = _SPACE_BEFORE_PUNCT.sub("", _SPACE.sub(" ", part)).strip()
            if part:
                lines.append(part)
    return lines


def fetch_bible(cache: Cache) -> tuple[list[Document], str]:
    """World English Bible (2015, with deuterocanon) from Debian sword-text-web: one document per testament."""
    root, deb = cache.deb_root("sword-text-web")
    mods = sorted((root / "usr/share/sword/modules/texts/ztext").glob("*/ot.bzs"))
    if not mods:
        raise FetchError(f"{deb}: no zText module with ot.bzs found")
    mod = mods[0].parent
    docs = [_doc("bible", f"{mod.name}/{t}", "public-domain", "\n".join(read_sword_ztext(mod, t)))
            for t in ("ot", "nt")]
    return [d for d in docs if d], f"Debian {deb} (module {mod.name})"


def _grouped(files: Iterable[Path], key: Callable[[Path], str]) -> dict[str, list[str]]:
    """Read text files and group their contents by ``key(path)``, keeping file order."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for p in files:
        if p.is_file():
            groups[key(p)].append(_decode(p.read_bytes()))
    return groups


def fetch_python_docs(cache: Cache) -> tuple[list[Document], str]:
    """Python 3.11 documentation reST sources, one document per top-level section (library, c-api, ...)."""
    root, deb = cache.deb_root("python3.11-doc")
    src = root / "usr/share/doc/python3.11/html/_sources"
    groups = _grouped(sorted(src.rglob("*.txt")), lambda p: p.relative_to(src).parts[0].removesuffix(".rst.txt"))
    docs = [_doc("python_docs", g, "PSF-2.0", "\n\n".join(t)) for g, t in sorted(groups.items())]
    return [d for d in docs if d], f"Debian {deb}"


def fetch_perl_docs(cache: Cache) -> tuple[list[Document], str]:
    """Perl core documentation, one document per ``.pod`` file."""
    root, deb = cache.deb_root("perl-doc")
    pods = sorted(root.glob("usr/share/perl/*/pod/*.pod"))
    docs = [_doc("perl_docs", p.stem, "GPL-1.0-or-later OR Artistic-1.0-Perl", _decode(p.read_bytes()))
            for p in pods if p.is_file()]
    return [d for d in docs if d], f"Debian {deb}"


class _HTMLText(html.parser.HTMLParser):
    """Collect the visible text of an HTML page; block elements become line breaks."""

    SKIP = {"script", "style", "head", "title"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table", "ul", "ol"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")
        if tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")
        if tag == "pre":
            self._pre = max(0, self._pre - 1)

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data if self._pre else _SPACE.sub(" ", data))


def html_to_text(page: str) -> str:
    """Convert an HTML page to plain text: visible text only, paragraphs separated by a blank
    line, whitespace runs (non-breaking spaces included) collapsed to one space except inside
    ``<pre>`` blocks, which are kept verbatim; runs of blank lines squeezed."""
    p = _HTMLText()
    p.feed(page)
    p.close()
    lines = [ln.rstrip() for ln in "".join(p.parts).split("\n")]
    text = "\n".join(ln if ln.strip() else "" for ln in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def fetch_postgres_docs(cache: Cache) -> tuple[list[Document], str]:
    """PostgreSQL 15 HTML manual as text, one document per page family (file-name prefix before '-')."""
    root, deb = cache.deb_root("postgresql-doc-15")
    pages = sorted(root.glob("usr/share/doc/postgresql-doc-15/html/*.html"))
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for p in pages:
        groups[p.stem.split("-")[0]].append(html_to_text(_decode(p.read_bytes())))
    docs = [_doc("postgres_docs", g, "PostgreSQL", "\n\n".join(t)) for g, t in sorted(groups.items())]
    return [d for d in docs if d], f"Debian {deb}"


def fetch_linux(cache: Cache) -> tuple[list[Document], str]:
    """Linux 6.1: Documentation/ (.rst/.txt) grouped per top-level subdirectory, plus every
    ``.c`` file of at least 256 KB, streamed out of the source tarball in one pass."""
    root, deb = cache.deb_root("linux-source-6.1")
    tarballs = sorted(root.glob("usr/src/linux-source-*.tar.xz"))
    if not tarballs:
        raise FetchError(f"{deb}: no usr/src/linux-source-*.tar.xz inside")
    print(f"  reading {tarballs[0].name} (about a minute)", flush=True)
    doc_groups: dict[str, list[str]] = collections.defaultdict(list)
    c_files: list[Document] = []
    with tarfile.open(tarballs[0], mode="r|xz") as tf:
        for m in tf:
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[-1]
            if rel.startswith("Documentation/") and rel.endswith((".rst", ".txt")):
                sub = rel.split("/")[1] if rel.count("/") > 1 else "top"
                doc_groups[sub].append(_decode(tf.extractfile(m).read()))
            elif rel.endswith(".c") and m.size >= LINUX_BIG_C_BYTES:
                c_files.append(_doc("linux", f"c/{rel}", "GPL-2.0-only", _decode(tf.extractfile(m).read())))
    docs = [_doc("linux", f"Documentation/{g}", "GPL-2.0-only", "\n\n".join(t)) for g, t in sorted(doc_groups.items())]
    docs += sorted((d for d in c_files if d), key=lambda d: d["id"])
    return [d for d in docs if d], f"Debian {deb}"


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("books", "Canterbury corpus + Botchan, PyPI sdists (public domain; ~1.7 MB)", fetch_books),
    Source("austen", "6 Austen novels, Debian r-cran-janeaustenr (public domain; installs PyPI rdata)", fetch_austen),
    Source("bible", "World English Bible, Debian sword-text-web (public domain)", fetch_bible),
    Source("python_docs", "Python 3.11 docs, Debian python3.11-doc (PSF-2.0)", fetch_python_docs),
    Source("perl_docs", "Perl pods, Debian perl-doc (GPL-1+ or Artistic)", fetch_perl_docs),
    Source("postgres_docs", "PostgreSQL 15 manual, Debian postgresql-doc-15 (PostgreSQL licence)", fetch_postgres_docs),
    Source("linux", "Linux 6.1 docs + big .c files, Debian linux-source-6.1 (GPL-2.0; 139 MB download)", fetch_linux),
]}


def parse_sources(value: str) -> list[str]:
    """Parse ``--sources``: comma-separated names from SOURCES, or ``all``; order kept, duplicates dropped.

    Raises:
        argparse.ArgumentTypeError: empty list or an unknown name (the message lists valid names).
    """
    names = [n.strip() for n in value.split(",")]
    if "" in names:
        raise argparse.ArgumentTypeError(f"empty source name in {value!r}; choose from {', '.join(SOURCES)} or 'all'")
    if names == ["all"]:
        return list(SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown source(s) {unknown or [value]}; choose from {', '.join(SOURCES)} or 'all'")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of this tool."""
    p = argparse.ArgumentParser(
        description="Fetch the Mistral v1 tokenizer and public long documents from PyPI/Debian packages "
                    "into a JSONL corpus with a licence summary.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sources:\n" + "\n".join(f"  {s.name:<14} {s.help}" for s in SOURCES.values()),
    )
    p.add_argument("--sources", type=parse_sources, default=["books"],
                   help="comma-separated source names, or 'all' (default: books)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="cache/output directory (default: $MTRAINING_DATA, else <repo>/data)")
    p.add_argument("--name", default=None,
                   help="corpus name: writes corpus/<name>.jsonl (default: the source names joined by '_', "
                        "'all' for all sources)")
    p.add_argument("--force", action="store_true",
                   help="rebuild the corpus files even if they exist (downloads stay cached)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit code (0 ok, 1 fetch error or mismatched cache)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.name is not None and (not args.name or args.name in (".", "..") or "/" in args.name
                                  or os.sep in args.name):
        parser.error(f"--name {args.name!r}: a file name without directories (the corpus goes to "
                     "<out-dir>/corpus/<name>.jsonl)")
    if args.out_dir is not None and args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: not a directory")
    out_dir: Path = (args.out_dir or default_data_dir()).resolve()
    sources: list[str] = args.sources
    name = args.name or ("all" if sources == list(SOURCES) else "_".join(sources))
    corpus = out_dir / "corpus" / f"{name}.jsonl"
    summary_json = corpus.with_suffix(".licenses.json")
    summary_md = corpus.with_suffix(".LICENSES.md")
    tok_path = out_dir / "tokenizer" / "mistral_v1.model"
    cache = Cache(out_dir)

    if not args.force and corpus.exists() and summary_json.exists() and tok_path.exists():
        meta = json.loads(summary_json.read_text(encoding="utf-8"))
        if meta.get("sources") != sources:
            print(f"error: {corpus} was built from sources {meta.get('sources')}, not {sources}; "
                  "pass --force to rebuild it or --name to write another corpus", file=sys.stderr)
            return 1
        print(f"Nothing to do: {corpus} and {tok_path} already exist (--force rebuilds the corpus).")
        print(format_table(stats_from_json(meta["stats"])))
        return 0

    t0 = time.perf_counter()
    try:
        print(f"tokenizer: {TOKENIZER_WHEEL} -> {tok_path}", flush=True)
        tok = cache.tokenizer()
        docs: list[Document] = []
        provenance: dict[str, str] = {}
        for s in sources:
            ts = time.perf_counter()
            print(f"source {s}:", flush=True)
            got, provenance[s] = SOURCES[s].fetch(cache)
            if not got:
                raise FetchError(f"source {s} produced no documents")
            print(f"  {len(got)} documents ({time.perf_counter() - ts:.1f} s)", flush=True)
            docs += got
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    write_jsonl(corpus, docs)
    stats = summarize_corpus(corpus, tok)
    meta = {
        "corpus": corpus.name,
        "sources": sources,
        "tokenizer": {"path": str(tok.relative_to(out_dir)), "package": TOKENIZER_WHEEL,
                      "member": TOKENIZER_MEMBER, "license": "Apache-2.0", "vocab_size": TOKENIZER_VOCAB},
        "provenance": provenance,
        "stats": stats_to_json(stats),
    }
    md = format_licenses_md(name, stats, provenance)
    md += f"\nTokenizer `{meta['tokenizer']['path']}`: `{TOKENIZER_MEMBER}` from PyPI {TOKENIZER_WHEEL}, Apache-2.0.\n"
    write_atomic(summary_md, md)
    write_atomic(summary_json, json.dumps(meta, indent=2) + "\n")  # written last: marks the corpus complete
    print(format_table(stats))
    print(f"wrote {corpus}, {summary_md.name}, {summary_json.name} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
