"""A tiny sentencepiece tokenizer + Megatron indexed dataset, built in a few seconds on CPU.

Usage::

    from tests.helpers.tiny_data import make_tiny_dataset
    prefix, tok_model = make_tiny_dataset(tmp_path)      # prefix + ".bin"/".idx", "tok.model"
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["make_tiny_dataset"]

_WORDS = ("alpha beta gamma delta ring attention context parallel token sparse megatron stripe "
          "the a of and to in is was for on with as by at from that this it be are").split()


def make_tiny_dataset(directory: str | Path, num_docs: int = 400, vocab_size: int = 128,
                      seed: int = 0) -> tuple[str, str]:
    """Train a ``vocab_size`` BPE sentencepiece model on synthetic text and write ``num_docs``
    documents (ids + EOD) with megatron-core's ``IndexedDatasetBuilder``.

    Documents have random lengths (5-120 words), so EOD tokens (and ``--eod-mask-loss`` masks)
    fall unevenly across sequences and CP ranks.

    Returns:
        ``(data_prefix, tokenizer_model_path)`` as strings.
    """
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    prefix, model = d / "tiny_text_document", d / "tok.model"
    if Path(str(prefix) + ".idx").is_file() and model.is_file():
        return str(prefix), str(model)
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 120))) for _ in range(num_docs)]
    (d / "corpus.txt").write_text("\n".join(docs))
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tok"), vocab_size=vocab_size, model_type="bpe",
        bos_id=-1, eos_id=1, unk_id=0, pad_id=-1, minloglevel=2,
    )
    tok = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(model), metadata_path={"library": "sentencepiece", "model_type": "gpt"})
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=DType.optimal_dtype(tok.vocab_size))
    for text in docs:
        ids = tok.tokenize(text) + [tok.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix), str(model)
