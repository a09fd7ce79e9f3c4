"""tools/eval_long_context.py: perplexity by position bucket, needle in a haystack, plots.

* Pure helpers against hand-computed values: bucket edges (and a bad spec raising a clear
  ValueError), megatron-core's split rule, windowing, the greedy score, needle placement.
* End to end on CPU: a tiny checkpoint trained by examples/pretrain_gpt.py (2 iterations,
  dist_checkpointing), the tool with ``--eval-attention mtraining`` (``pattern: dense`` config) and
  with ``--eval-attention dense`` (megatron-core's stock DotProductAttention); both bucket losses
  must equal an independent computation (a GPTModel built here with the local spec, weights read
  with dist_checkpointing, log-softmax cross entropy in float64, the valid split's documents read
  from the IndexedDataset, bucketed with numpy).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.dist import run_python
from tests.helpers.tiny_data import make_tiny_dataset

from tools import eval_long_context as elc

TOOL = "tools/eval_long_context.py"
SEQ = 256


# ------------------------------------------------------------------------------ pure helpers
def test_bucket_edges_default_and_truncated():
    assert elc.parse_buckets(None, 4096) == [(0, 2048), (2048, 4096)]
    assert elc.parse_buckets(None, 20000) == [(0, 2048), (2048, 8192), (8192, 16384), (16384, 20000)]
    assert elc.parse_buckets("0,2K,8K,16K,32K,64K", 100000)[-1] == (65536, 100000)
    assert elc.parse_buckets("0,64,128,1K", 256) == [(0, 64), (64, 128), (128, 256)]
    assert elc.bucket_label(2048, 8192) == "2K-8K" and elc.bucket_label(0, 100) == "0-100"


@pytest.mark.parametrize("spec,needle", [("0,128,64", "strictly increasing"), ("64,128", "first edge must be 0"),
                                         ("0,abc", "'abc' is not"), ("0,-5", "'-5' is not")])
def test_bad_bucket_spec_is_a_clear_value_error(spec, needle):
    with pytest.raises(ValueError, match="--buckets") as e:
        elc.parse_buckets(spec, 256)
    assert needle in str(e.value)


def test_split_rule_is_megatron_cores():
    # BlendedMegatronDatasetBuilder: beg/end = int(round(cumulative fraction * num_documents))
    fr = [0.9, 0.1, 0.0]
    assert elc.split_document_range(5, fr, "train") == (0, 4)   # round(4.5) = 4
    assert elc.split_document_range(5, fr, "valid") == (4, 5)
    assert elc.split_document_range(5, fr, "test") == (5, 5)
    assert elc.split_document_range(400, fr, "valid") == (360, 400)
    assert elc.split_document_range(7, fr, "all") == (0, 7)


def test_windows_document_and_stream():
    docs = [np.arange(10), np.arange(100, 125)]
    w = elc.make_windows(docs, 8, "document", 10)      # doc 1: 1 window; doc 2: 3 windows (0, 8, 16)
    assert w.shape == (4, 9)
    assert w[0].tolist() == list(range(9)) and w[1][0] == 100 and w[3][0] == 116
    s = elc.make_windows(docs, 8, "stream", 2)
    assert s.shape == (2, 9) and s[1].tolist() == [8, 9, 100, 101, 102, 103, 104, 105, 106]
    with pytest.raises(ValueError, match="try --ppl-mode stream"):
        elc.make_windows(docs, 64, "document", 4)


def test_bucket_means_against_hand_values():
    loss = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    r = elc.bucket_means(loss, mask, [(0, 2), (2, 4)])
    assert [b["tokens"] for b in r["buckets"]] == [4, 3]
    assert r["buckets"][0]["loss"] == pytest.approx(14 / 4) and r["buckets"][1]["loss"] == pytest.approx(18 / 3)
    assert r["overall"]["loss"] == pytest.approx(32 / 7) and r["overall"]["ppl"] == pytest.approx(math.exp(32 / 7))


def test_greedy_score_rule():
    assert elc.greedy_score(" eat a sandwich and sit in Dolores Park on a sunny day.") == 100.0
    assert elc.greedy_score("Sandwich, sunny!\neat sit dolores park day") == pytest.approx(200 / 7)
    assert elc.greedy_score("\n  the best thing is to eat.") == pytest.approx(100 / 7)  # leading blank line skipped
    assert elc.greedy_score("") == 0.0


def test_needle_placement():
    hay = list(range(100, 200))           # ids 109, 119, ... end a sentence
    needle, suffix, gold = [1, 1], [2, 2, 2], [3, 3, 3, 3]
    end = lambda t: t % 10 == 9  # noqa: E731
    # n_ctx = 50 - 2 - 3 - 4 = 41; k = round(41 * d / 100), moved back to just after an id ending in 9
    for depth, k_expected in ((0, 0), (50, 20), (100, 41), (30, 10), (97, 40), (99, 41)):
        prompt, k, n_ctx = elc.niah_prompt(hay, needle, suffix, gold, 50, depth, end)
        assert n_ctx == 41 and len(prompt) + len(gold) == 50
        assert k == k_expected, depth
        assert prompt[k:k + 2] == needle and prompt[-3:] == suffix
        assert prompt[:k] == hay[:k] and prompt[k + 2:-3] == hay[k:n_ctx]
    with pytest.raises(ValueError, match="cannot hold"):
        elc.niah_prompt(hay, needle, suffix, gold, 9, 50, end)
    # a template prefix comes first and takes its tokens from the haystack budget
    prompt, k, n_ctx = elc.niah_prompt(hay, needle, suffix, gold, 50, 50, end, prefix=[7, 7, 7])
    assert n_ctx == 38 and k == 10 and prompt[:3] == [7, 7, 7] and prompt[3 + k:5 + k] == needle
    assert len(prompt) + len(gold) == 50


# ------------------------------------------------------------------------------ end to end
CONFIG_DENSE = "implementation: striped\ngranularity: 64\npattern: dense\n"

MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--seq-length", str(SEQ),
               "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--untie-embeddings-and-output-weights"]

REFERENCE = r'''
"""Independent per-token losses: GPTModel (local spec) + dist_checkpointing + float64 CE."""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import torch
import torch.distributed as dist
import megatron_mtraining.training as pg
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_mtraining.megatron.args import parse_args
from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

out, ckpt, prefix, edges = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[6]
L, nwin = int(sys.argv[4]), int(sys.argv[5])
args = parse_args(sys.argv[7:], world_size=1)
pg.init_distributed(args)
apply_cpu_patches()
ps.initialize_model_parallel(1, context_parallel_size=1)
cpu_seed(1)
vocab = pg.padded_vocab_size(pg.build_tokenizer(args).vocab_size, args)
model = GPTModel(config=pg.transformer_config(args),
                 transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab,
                 max_sequence_length=L, position_embedding_type="rope", share_embeddings_and_output_weights=False)
it = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
state = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(ckpt, f"iter_{it:07d}"))
model.load_state_dict(state["model"])
model.eval()
ds = IndexedDataset(prefix, mmap=True)
n = len(ds)  # one sequence per document here
beg, end = int(round(0.9 * n)), n
stream = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(beg, end)])
wins = [stream[i * L:i * L + L + 1] for i in range(nwin)]
losses = []
for w in wins:
    t = torch.from_numpy(w)
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = model(t[None, :-1], torch.arange(L)[None], mask)[0].double()
    lp = torch.log_softmax(logits, -1)
    losses.append((-lp.gather(1, t[1:, None])[:, 0]).numpy())
loss = np.stack(losses)
e = [int(x) for x in edges.split(",")] + [L]
res = {"buckets": [float(loss[:, a:b].mean()) for a, b in zip(e[:-1], e[1:])], "overall": float(loss.mean()),
       "tokens": [int(loss[:, a:b].size) for a, b in zip(e[:-1], e[1:])]}
open(out, "w").write(json.dumps(res))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-iteration checkpoint of examples/pretrain_gpt.py on the tiny dataset (+ its metrics file)."""
    d = tmp_path_factory.mktemp("eval_ckpt")
    prefix, tok = make_tiny_dataset(d / "data")
    ckpt, metrics = d / "ckpt", d / "train.jsonl"
    argv = MODEL_FLAGS + ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
                          "--lr", "3e-3", "--data-path", prefix, "--split", "90,10,0", "--tokenizer-model", tok,
                          "--eval-iters", "0", "--log-interval", "1", "--save", str(ckpt),
                          "--metrics-file", str(metrics), "--data-cache-path", str(d / "cache")]
    r = run_python("examples/pretrain_gpt.py", argv, timeout=240)
    assert r.returncode == 0, r.tail()
    return {"prefix": prefix, "tok": tok, "ckpt": ckpt, "metrics": metrics, "dir": d}


def _haystack(d: Path) -> Path:
    h = d / "haystack"
    h.mkdir(exist_ok=True)
    (h / "a.txt").write_text("The ring attention reads a long context. Sparse blocks stripe across ranks. "
                             "A token is a token. " * 20)
    (h / "b.txt").write_text("Megatron trains the model on many nodes. The data is parallel. " * 20)
    return h


def _tool(tr, *extra, timeout=240):
    argv = [str(tr["ckpt"])] + MODEL_FLAGS + ["--tokenizer-model", tr["tok"], "--data-path", tr["prefix"],
                                              "--split", "90,10,0", *map(str, extra)]
    return run_python(TOOL, argv, timeout=timeout)


@pytest.mark.slow
def test_end_to_end_matches_independent_losses(trained, tmp_path):
    tr = trained
    cfg = tmp_path / "dense_pattern.yaml"
    cfg.write_text(CONFIG_DENSE)
    edges, nwin = "0,64,128", 3
    common = ["--eval-seq-length", SEQ, "--ppl-mode", "stream", "--max-windows", nwin, "--eval-batch-size", 2,
              "--buckets", edges]
    out_m, plots = tmp_path / "mtraining.json", tmp_path / "plots"
    r = _tool(tr, *common, "--eval-attention", "mtraining", "--mtraining-config", cfg,
              "--haystack-dir", _haystack(tmp_path), "--niah-lengths", "256,512,1K", "--max-context", 512,
              "--niah-depths", "0,50,100", "--max-new-tokens", 3, "--json", out_m, "--plots", plots,
              "--loss-curves", f"tiny={tr['metrics']}", tr["metrics"])
    assert r.returncode == 0, r.tail()
    assert "Perplexity by position" in r.stdout and "greedy retrieval score" in r.stdout, r.stdout
    out_d = tmp_path / "dense.json"
    r2 = _tool(tr, *common, "--eval-attention", "dense", "--skip-niah", "--json", out_d)
    assert r2.returncode == 0, r2.tail()
    ref_out = tmp_path / "ref.json"
    (tmp_path / "ref.py").write_text(REFERENCE)
    r3 = run_python(tmp_path / "ref.py", [ref_out, tr["ckpt"], tr["prefix"], SEQ, nwin, edges] + MODEL_FLAGS
                    + ["--tokenizer-model", tr["tok"], "--data-path", tr["prefix"], "--train-iters", "1",
                       "--lr", "0"], timeout=240)
    assert r3.returncode == 0, r3.tail()
    ref = json.loads(ref_out.read_text())
    m, d = json.loads(out_m.read_text()), json.loads(out_d.read_text())

    # structure
    assert m["iteration"] == 2 and m["attention"].startswith("mtraining (dense") and d["attention"] == "dense"
    assert m["mtraining_config"]["pattern"] == "dense" and d["niah"] is None
    p = m["ppl"]
    assert p["windows"] == nwin and p["seq_length"] == SEQ and p["source"]["documents"] == [360, 400]
    assert [b["bucket"] for b in p["buckets"]] == ["0-64", "64-128", "128-256"]
    assert [b["tokens"] for b in p["buckets"]] == ref["tokens"] == [nwin * 64, nwin * 64, nwin * 128]
    # bucket losses: tool (both attentions) == independent float64 computation
    for res in (m, d):
        for b, rb in zip(res["ppl"]["buckets"], ref["buckets"]):
            assert b["loss"] == pytest.approx(rb, rel=2e-5, abs=2e-5), (res["attention"], b, rb)
            assert b["ppl"] == pytest.approx(math.exp(b["loss"]), rel=1e-9)
        assert res["ppl"]["overall"]["loss"] == pytest.approx(ref["overall"], rel=2e-5)
    # dense pattern through MTrainingAttention vs the stock attention: nearly identical
    for a, b in zip(m["ppl"]["buckets"], d["ppl"]["buckets"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert m["ppl"]["overall"]["loss"] > 1.0  # a 2-iteration model is far from perfect (not a constant 0)

    # needle in a haystack: lengths capped by --max-context, one cell per (length, depth), scores in [0, 100]
    n = m["niah"]
    assert n["lengths"] == [256, 512] and n["depths"] == [0, 50, 100] and len(n["cells"]) == 6
    assert n["haystack"].endswith("(2 files)") and n["template"] == "plain"
    ctrl = n["control_no_needle"]
    assert [c["length"] for c in ctrl] == [256, 512] and all(0 < c["ll_score"] <= 100 for c in ctrl)
    for c in n["cells"]:
        assert 0 <= c["greedy_score"] <= 100 and 0 <= c["ll_score"] <= 100 and 0 <= c["answer_token_acc"] <= 100
        assert c["answer_logprob"] < 0 and c["ll_score"] > 0
        assert c["greedy_score"] == elc.greedy_score(c["generated"])
    assert [c["depth_actual"] for c in n["cells"] if c["depth"] == 0] == [0.0, 0.0]
    assert [c["depth_actual"] for c in n["cells"] if c["depth"] == 100] == [100.0, 100.0]
    assert n["mean"]["ll_score"] == pytest.approx(sum(c["ll_score"] for c in n["cells"]) / 6)
    # plots
    for name in ("ppl_by_position.png", "niah_heatmap.png", "loss_curves.png"):
        f = plots / name
        assert f.is_file() and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert sorted(Path(x).name for x in m["plots"]) == ["loss_curves.png", "niah_heatmap.png", "ppl_by_position.png"]


@pytest.mark.slow
def test_cli_errors_name_the_flag(trained, tmp_path):
    r = _tool(trained, "--buckets", "0,128,64", "--skip-niah", timeout=60)
    assert r.returncode == 2 and "--buckets '0,128,64': edges must be strictly increasing" in r.stderr, r.tail()
    r = _tool(trained, "--num-query-groups", "4", "--skip-niah", timeout=120)   # not the trained shape
    assert r.returncode == 2 and "--num-query-groups 4 (checkpoint: 2)" in r.stderr, r.tail()
    r = _tool(trained, "--skip-ppl", "--haystack-dir", tmp_path, timeout=60)     # no .txt in it
    assert r.returncode == 2 and "no .txt files" in r.stderr, r.tail()
    r = _tool(trained, "--skip-niah", "--eval-seq-length", 100, timeout=60)      # not a multiple of 64
    assert r.returncode == 2 and "granularity" in r.stderr, r.tail()


@pytest.mark.slow
def test_plain_text_file_is_one_document(trained, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(" ".join(["the ring attention reads a long context and sparse blocks stripe across ranks"] * 60))
    out = tmp_path / "text.json"
    r = run_python(TOOL, [trained["ckpt"], *MODEL_FLAGS, "--tokenizer-model", trained["tok"], "--data-path", text,
                          "--skip-niah", "--max-windows", 2, "--json", out], timeout=120)
    assert r.returncode == 0, r.tail()
    p = json.loads(out.read_text())["ppl"]
    assert p["source"] == {"text_file": str(text), "documents": 1} and p["mode"] == "document"
    assert p["windows"] == 2 and p["overall"]["tokens"] == 2 * SEQ
    assert [b["bucket"] for b in p["buckets"]] == ["0-256"]  # default edges 0, 2K, ... truncated to L = 256
