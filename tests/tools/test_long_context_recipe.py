"""The long-context extension recipe at tiny scale on CPU, offline.

* ``tools/build_long_context_data.py``: a document-disjoint train / held-out split of long documents,
  written exactly as ``tools/preprocess_data.py --append-eod`` writes them.
* ``tools/extend_context.py``: a run split over several calls (time budget, ``--stop-iter``, then to
  the end) gives the same losses, learning rates and gradient norms as one uninterrupted run; a
  finished run is a no-op; the mtraining mode (vertical-slash config) runs on the same data; the
  dry run prints the command with the raised RoPE base.

All driver calls run in one worker process (``main`` called repeatedly on fresh ports) so the
test costs one interpreter start-up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.dist import REPO_ROOT, run_python
from tests.helpers.tiny_data import make_tiny_dataset

sys.path.insert(0, str(REPO_ROOT / "tools"))

import extend_context as ec  # noqa: E402

TINY_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
              "--position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --swiglu "
              "--disable-bias-linear --tokenizer-type SentencePieceTokenizer --tokenizer-model {tok} --load {base}")

WORKER = r'''
import json, os, socket, sys
sys.path.insert(0, os.path.join({repo!r}, "tools"))
import extend_context as ec

def call(root, mode, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    argv = ["--mode", mode, "--seq", "512", "--train-iters", "4", "--global-batch-size", "2",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--rotary-base", "40000",
            "--base", {base!r}, "--data-prefix", {data!r}, "--save-root", os.path.join({out!r}, root),
            *extra]
    assert ec.main(argv) == 0, (root, extra)

if __name__ == "__main__":                             # the checkpoint writer starts a multiprocessing Manager
    fp32, bf16 = ["--precision", "fp32"], ["--precision", "bf16"]
    call("ref", "dense", *fp32)                               # uninterrupted
    call("split", "dense", *fp32, "--time-budget-s", "1")     # run 1: the budget is spent -> stops after iteration 1
    call("split", "dense", *fp32, "--stop-iter", "3")         # run 2: iterations 2-3
    call("split", "dense", *fp32)                             # run 3: iteration 4
    call("split", "dense", *fp32)                             # run 4: finished, nothing to do
    call("sparse", "mtraining", *fp32, "--stop-iter", "2")    # mtraining mode, same data and seed
    call("ref_bf16", "dense", *bf16)                          # bf16 (as on the GPU): fp32 main weights and
    call("split_bf16", "dense", *bf16, "--stop-iter", "2")    # Adam moments must survive the checkpoint
    call("split_bf16", "dense", *bf16)
    print("WORKER_OK")
'''


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("long_context")
    prefix, tok = make_tiny_dataset(d / "data")
    base = d / "base"                       # no tracker: the first call starts from the seeded init
    base.mkdir()
    (base / "pretrain_flags.txt").write_text(TINY_FLAGS.format(tok=tok, base=base))
    script = d / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO_ROOT), base=str(base), data=prefix, out=str(d / "runs")))
    res = run_python(str(script), [], timeout=300)
    assert res.returncode == 0 and "WORKER_OK" in res.stdout, res.tail()
    return d / "runs", res.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_split_run_resumes_exactly(recipe_runs):
    runs, _ = recipe_runs
    ref = _rows(runs / "ref" / "dense_0k" / "metrics.jsonl")
    split = _rows(runs / "split" / "dense_0k" / "metrics.jsonl")
    assert [r["iteration"] for r in ref] == [1, 2, 3, 4]
    assert [r["iteration"] for r in split] == [1, 2, 3, 4]       # no repeated or skipped iteration
    for a, b in zip(ref, split):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6, abs=0), (a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
        assert b["tokens"] == a["tokens"]
    assert len({r["lr"] for r in ref}) > 2                        # warm-up + cosine: the schedule moves
    calls = _rows(runs / "split" / "dense_0k" / "calls.jsonl")
    assert [(c["start_iteration"], c["end_iteration"], c["checkpoint"]) for c in calls] == \
        [(0, 1, "1"), (1, 3, "3"), (3, 4, "4")]
    assert calls[0]["stop_reason"].startswith("time budget") and calls[1]["stop_reason"] == "--stop-iter 3"
    assert calls[2]["stop_reason"] is None
    assert (runs / "split" / "dense_0k" / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_bf16_split_run_resumes_exactly(recipe_runs):
    runs, _ = recipe_runs
    ref = _rows(runs / "ref_bf16" / "dense_0k" / "metrics.jsonl")
    split = _rows(runs / "split_bf16" / "dense_0k" / "metrics.jsonl")
    assert [r["iteration"] for r in split] == [r["iteration"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, split):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6, abs=0), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)


def test_finished_run_is_a_no_op_and_mtraining_runs(recipe_runs):
    runs, out = recipe_runs
    assert "is finished (iteration 4 of 4); nothing to do" in out
    sparse = _rows(runs / "sparse" / "mtraining_0k" / "metrics.jsonl")
    ref = _rows(runs / "ref" / "dense_0k" / "metrics.jsonl")
    assert [r["iteration"] for r in sparse] == [1, 2]
    assert all(np.isfinite(r["lm_loss"]) for r in sparse)
    assert sparse[0]["tokens"] == ref[0]["tokens"]                # same samples
    assert "pattern vertical_slash" in out                        # the config was used


def test_dry_run_and_rope_base(tmp_path, capsys):
    assert (ec.abf_rotary_base(8192), ec.abf_rotary_base(32768), ec.abf_rotary_base(65536)) == \
        (100000, 1000000, 3200000)
    base = tmp_path / "base"
    base.mkdir()
    (base / "pretrain_flags.txt").write_text(TINY_FLAGS.format(tok="tok.model", base=base) + " --seq-length 8")
    assert ec.main(["--mode", "mtraining", "--base", str(base), "--save-root", str(tmp_path / "r"),
                    "--precision", "bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    cmd = out.splitlines()[-1].split()
    assert cmd[cmd.index("--rotary-base") + 1] == "1000000" and cmd.count("--rotary-base") == 1
    assert cmd[cmd.index("--seq-length") + 1] == "32768" and cmd.count("--seq-length") == 1
    assert cmd[cmd.index("--load") + 1] == str(base) and "--bf16" in cmd
    assert cmd[cmd.index("--mtraining-config") + 1] == ec.DEFAULT_CONFIG
    assert not (tmp_path / "r").exists()
    # resume: once the run directory holds a checkpoint, --load points there
    rd = tmp_path / "r" / "dense_32k"
    rd.mkdir(parents=True)
    (rd / "latest_checkpointed_iteration.txt").write_text("7")
    assert ec.main(["--mode", "dense", "--base", str(base), "--save-root", str(tmp_path / "r"),
                    "--precision", "fp32", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1].split()
    assert cmd[cmd.index("--load") + 1] == str(rd) and "--mtraining-config" not in cmd and "--bf16" not in cmd



def test_a_missing_base_is_named(tmp_path, capsys):
    """No converted checkpoint at --base (or a --base-flags that is not a file): an argument error naming it
    and the conversion, before anything runs (it was a FileNotFoundError traceback, dry run or not)."""
    for extra, needle in (([], f"--base {tmp_path}: no pretrain_flags.txt there; convert the model first"),
                          (["--base-flags", str(tmp_path / "f.txt")], f"--base-flags {tmp_path / 'f.txt'}: not a file")):
        with pytest.raises(SystemExit) as e:
            ec.main(["--mode", "dense", "--base", str(tmp_path), "--save-root", str(tmp_path / "r"), "--dry-run", *extra])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # a finished run needs no base: still nothing to do
    rd = tmp_path / "r" / "dense_32k"
    rd.mkdir(parents=True)
    (rd / "latest_checkpointed_iteration.txt").write_text("120")
    assert ec.main(["--mode", "dense", "--base", str(tmp_path), "--save-root", str(tmp_path / "r")]) == 0
    assert "is finished (iteration 120 of 120); nothing to do" in capsys.readouterr().out

# ------------------------------------------------------------------------------------- data
def _tiny_tokenizer_json(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog int main void return"] * 50, trainer)
    tok.save(str(path))
    return path


def test_build_long_context_data(tmp_path):
    import build_long_context_data as bl
    import preprocess_data
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = _tiny_tokenizer_json(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over lazy dog".split()
    docs = []
    for i in range(24):
        source, ident = [("books", f"b{i}"), ("python_docs", f"d{i}"), ("linux", f"k{i}.c")][i % 3]
        n = int(rng.integers(20, 400)) if i % 4 else 10        # every 4th document is short
        docs.append({"source": source, "id": ident, "license": "x", "text": " ".join(rng.choice(words, n))})
    docs.append({"source": "linux", "id": "table.c", "license": "x", "text": "0xff, 0x12, " * 200})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs + docs[:2]))  # duplicates
    out = tmp_path / "out"
    assert bl.main(["--inputs", str(tmp_path / "c.jsonl"), "--tokenizer-model", str(tok), "--out-dir", str(out),
                    "--min-tokens", "100", "--heldout-every", "3", "--max-train-tokens", "2000",
                    "--heldout-max-tokens", "150"]) == 0
    s = json.loads((out / "split.json").read_text())
    assert s["data_tables_dropped"] == 1 and s["documents_read"] == 25
    per = {(d["source"], d["id"]): d for d in s["documents"]}
    train = [k for k, d in per.items() if d["split"] == "train"]
    held = [k for k, d in per.items() if d["split"] == "heldout"]
    assert train and held and not set(train) & set(held)
    assert all(d["tokens"] >= 100 for d in s["documents"])
    assert {per[k]["source"] for k in held} == {"books", "python_docs", "linux"}   # every group held out
    assert sum(per[k]["tokens"] for k in train) <= 2000
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tok))
    for split in ("train", "heldout"):
        ds = IndexedDataset(str(out / f"{split}_text_document"))
        info = s["splits"][split]
        assert len(ds) == info["documents"] and int(ds.sequence_lengths.sum()) == info["tokens_with_eod"]
        recs = [json.loads(x) for x in (out / f"{split}.jsonl").read_text().splitlines()]
        for j, r in enumerate(recs):   # ids + EOD; held-out documents cut to their first 150 tokens
            ids = hf.encode(r["text"], add_special_tokens=False).ids[:r.get("eval_tokens")] + [0]
            assert np.array_equal(np.asarray(ds[j]), np.asarray(ids)), (split, j)
        assert (split == "heldout") == any("eval_tokens" in r for r in recs)
    # the training split is exactly what preprocess_data.py --append-eod writes for its texts
    assert preprocess_data.main(["--input", str(out / "train.jsonl"), "--output-prefix", str(tmp_path / "pp"),
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok),
                                 "--append-eod"]) == 0
    pp, ds = IndexedDataset(str(tmp_path / "pp_text_document")), IndexedDataset(str(out / "train_text_document"))
    assert len(pp) == len(ds) and all(np.array_equal(np.asarray(ds[j]), np.asarray(pp[j])) for j in range(len(ds)))
    # held-out order: round-robin over the groups, so the first windows of an evaluation see every group
    assert [bl.doc_group({"source": o.split("/")[0], "id": o.split("/", 1)[1]})
            for o in s["splits"]["heldout"]["order"][:3]] == ["prose", "docs", "code"]


def test_build_long_context_data_names_a_tokenizer_that_does_not_load(tmp_path):
    import build_long_context_data as bl

    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    (tmp_path / "c.jsonl").write_text("")
    with pytest.raises(SystemExit, match=rf"--tokenizer-model {bad}: cannot be loaded as a tokenizer.json"):
        bl.main(["--inputs", str(tmp_path / "c.jsonl"), "--tokenizer-model", str(bad), "--out-dir", str(tmp_path)])


@pytest.mark.skipif(not (REPO_ROOT / "checkpoints" / "smollm2_135m" / "pretrain_flags.txt").is_file(),
                    reason="needs the converted SmolLM2 checkpoint's flags (tools/convert_smollm2.py; git-ignored)")
def test_shell_scripts_dry_run():
    """examples/long_context/*.sh print consistent pretrain / eval commands (RoPE base per checkpoint)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1"}

    def sh(script, **kw):
        r = subprocess.run(["bash", str(REPO_ROOT / "examples" / "long_context" / script)], env={**env, **kw},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return [line for line in r.stdout.splitlines() if line.strip()][-1].split()

    cmd = sh("extend_smollm2.sh", MODE="mtraining", SEQ="65536", GBS="4", STOP_ITER="7")
    for flag, val in (("--rotary-base", "3200000"), ("--seq-length", "65536"), ("--global-batch-size", "4"),
                      ("--data-path", "data/long_context_64k/train_text_document")):
        assert cmd[cmd.index(flag) + 1] == val, (flag, cmd)
    base = sh("eval_smollm2.sh", WHICH="base")
    dense = sh("eval_smollm2.sh", WHICH="dense")
    assert base[base.index("--rotary-base") + 1] == "100000" and base.count("--rotary-base") == 1
    assert dense[dense.index("--rotary-base") + 1] == "1000000"
    assert dense[2] == "checkpoints/long_context/dense_32k" and "--load" not in dense
    assert dense[dense.index("--data-path") + 1] == "data/long_context/heldout_text_document"
