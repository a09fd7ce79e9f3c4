"""Build a tiny tokenized dataset for launch tests: a ~200-piece sentencepiece model trained on
synthetic text, a JSONL corpus, and ``tools/preprocess_data.py`` (as a subprocess, exactly as a
user runs it) -> ``<out>/tiny_text_document.{bin,idx}``.

    python tests/helpers/tiny_dataset.py OUT_DIR   # prints DATA_PREFIX and TOKENIZER_MODEL lines
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over a lazy dog while context parallel attention reads long documents "
         "and sparse blocks stripe across ranks in megatron slurm nodes train tokens").split()


def _text(rng: random.Random, sentences: int) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                    for _ in range(sentences))


def build(out: Path, docs: int = 40, sentences: int = 30) -> tuple[Path, Path]:
    """Returns ``(data_prefix, tokenizer_model)``; cached (reuses existing files)."""
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny_spm.model"
    prefix = out / "tiny_text_document"
    if model.is_file() and prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file():
        return prefix, model
    rng = random.Random(0)
    (out / "spm_train.txt").write_text("\n".join(_text(rng, 1) for _ in range(600)), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(out / "spm_train.txt"), model_prefix=str(out / "tiny_spm"),
                                   vocab_size=200, model_type="bpe", character_coverage=1.0, minloglevel=2)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(docs):
            f.write(json.dumps({"id": str(i), "text": _text(rng, sentences)}) + "\n")
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(out / "corpus.jsonl"),
                    "--json-keys", "text", "--output-prefix", str(out / "tiny"), "--tokenizer-type",
                    "SentencePieceTokenizer", "--tokenizer-model", str(model), "--append-eod", "--workers", "1"],
                   check=True, capture_output=True, text=True, timeout=300)
    return prefix, model


if __name__ == "__main__":
    p, m = build(Path(sys.argv[1]))
    print(f"DATA_PREFIX={p}\nTOKENIZER_MODEL={m}")
