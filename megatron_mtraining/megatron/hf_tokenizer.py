"""A Megatron-Core tokenizer over a Hugging Face ``tokenizer.json`` (``tokenizers`` library only).

megatron-core's own ``HuggingFaceTokenizer`` wraps ``transformers.AutoTokenizer`` (a large extra
dependency); this adapter gives training and ``tools/preprocess_data.py`` the interface they use
(``tokenize``, ``detokenize``, ``vocab_size``, ``vocab``, ``eod``, ``pad``, ``unique_identifiers``)
with nothing but the ``tokenizers`` package. It is what ``--tokenizer-type HuggingFaceTokenizer
--tokenizer-model PATH`` loads, PATH being a ``tokenizer.json`` file or a directory holding one
(e.g. the output of ``tools/convert_smollm2.py``).

Conventions (GPT pretraining):

* ``tokenize(text)`` returns the ids of the text alone: no BOS/EOS or template tokens are added
  (``add_special_tokens=False``); special tokens written literally in the text (``<|endoftext|>``)
  are matched as such.
* ``eod`` (appended by ``--append-eod``, used for ``--eod-mask-loss``) is the id of the first of
  ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` found in the vocabulary; a tokenizer
  with none of them has ``eod = None`` (``--append-eod`` then fails with a clear error).
* ``pad`` is -1 (no padding token: megatron-core's GPTDataset never pads with it).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Union

from megatron.core.tokenizers import MegatronTokenizerBase

__all__ = ["TokenizersTokenizer", "resolve_tokenizer_json", "EOD_CANDIDATES"]

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def resolve_tokenizer_json(path: Union[str, Path]) -> Path:
    """``path`` itself if it is a file, else ``path/tokenizer.json``.

    Raises:
        FileNotFoundError: neither exists (the message names the path).
    """
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p / "tokenizer.json"
    raise FileNotFoundError(f"no tokenizer.json at {p} (give a tokenizer.json file or a directory holding one)")


class TokenizersTokenizer(MegatronTokenizerBase):
    """Megatron tokenizer interface over ``tokenizers.Tokenizer.from_file(tokenizer.json)``.

    Args:
        path: a ``tokenizer.json`` file or a directory containing one.

    Raises:
        FileNotFoundError: no tokenizer.json at ``path``.
        ValueError: the file is not a valid ``tokenizers`` JSON.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        from tokenizers import Tokenizer

        file = resolve_tokenizer_json(path)
        super().__init__(str(file), {"library": "tokenizers", "model_type": "gpt"})
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._eod = next((self._vocab[t] for t in EOD_CANDIDATES if t in self._vocab), None)

    # -- encode / decode
    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added); a list of Python ints."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept, so ``detokenize(tokenize(t)) == t`` for byte-level BPE)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("TokenizersTokenizer has no chat template (pretraining only)")

    # -- vocabulary
    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> Optional[int]:
        return self._eod

    @property
    def eos(self) -> Optional[int]:
        return self._eod

    @property
    def eos_id(self) -> Optional[int]:
        return self._eod

    @property
    def pad(self) -> int:
        return -1

    @property
    def pad_id(self) -> int:
        return -1

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron-core's dataset cache hashes (class and file)."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.path)])
