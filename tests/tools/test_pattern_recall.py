"""tools/pattern_recall.py on a tiny fresh model and tiny data: JSON report, and a pattern file
(--save-pattern) that tools/imbalance.py --pattern file replays with the same per-head lines."""
import json

import numpy as np
import pytest

from tests.helpers.dist import run_python
from tests.helpers.tiny_data import make_tiny_dataset


def test_pattern_recall_saves_a_pattern_the_imbalance_tool_reads(tmp_path):
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    out, pat = tmp_path / "rec", tmp_path / "pat.npz"
    res = run_python("tools/pattern_recall.py", [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "512", "--recall", "0.9",
        "--timing-repeats", "1", "--plot-heads", "0", "--out", str(out), "--save-pattern", str(pat)], timeout=300)
    assert res.returncode == 0, res.tail()
    report = json.loads((tmp_path / "rec.json").read_text())
    assert len(report["layers"]) == 2
    z = np.load(pat)
    meta = json.loads(str(z["meta"]))
    assert int(z["seq_len"]) == 512 and meta["layers"] == 2 and meta["rows_per_layer"] == 4
    assert z["slash"].shape[0] == z["vertical"].shape[0] == 8            # 2 layers x 1 sample x 4 heads
    for li, layer in enumerate(report["layers"]):                        # rows match the report's budgets
        for h, head in enumerate(layer["heads"]):
            row = li * 4 + h
            assert (z["slash"][row] >= 0).sum() == head["slash"][0]
            assert (z["vertical"][row] >= 0).sum() == head["vertical"][0]
    js = tmp_path / "imb.json"
    res = run_python("tools/imbalance.py", ["--model", "flops", "--cp", "2", "--seq-len", "512", "--layout", "striped",
                                            "--granularity", "64", "--pattern", "file", "--pattern-file", str(pat),
                                            "--json", str(js)], timeout=300)
    assert res.returncode == 0, res.tail()
    imb = json.loads(js.read_text())
    text = json.dumps(imb)
    assert "worker_imbalance" in text and "step_imbalance" in text


def test_pattern_recall_bad_inputs_are_clear_errors(tmp_path):
    """Checked before the model runs: a --save-pattern that imbalance.py could not read back under
    that name (no .npz/.pt suffix: numpy appends .npz), bad estimator budgets, no samples."""
    import pytest

    from tools.pattern_recall import main

    base = ["--data-path", str(tmp_path / "none"), "--seq-length", "256", "--out", str(tmp_path / "rec")]
    cases = [(["--save-pattern", str(tmp_path / "pat")], "--save-pattern"),
             (["--recall", "1.5"], "recall"), (["--num-samples", "0"], "--num-samples"),
             (["--recall-stride", "0"], "--recall-stride"),
             (["--recall-stride", "4"], "--recall-stride 4 samples no query rows at --seq-length 256"),
             (["--seq-length", "32768"], "--plot-heads"),
             (["--last-q", "1000"], "--last-q 1000 probe rows do not fit in --seq-length 256"),
             (["--rotary-base", "-10000"], "--rotary-base must be >= 1, got -10000"),
             (["--rotary-base", "0"], "--rotary-base must be >= 1, got 0"),
             (["--num-attention-heads", "4", "--num-query-groups", "3"],
              "--num-attention-heads 4 is not a multiple of --num-query-groups 3"),
             (["--hidden-size", "60"], "--hidden-size 60 must be --num-attention-heads 4 times an even head size"),
             (["--jsonl", str(tmp_path / "none.jsonl")], "none.jsonl: file not found"),
             ([], "none.idx not found")]                 # the data file last, before the model is built
    import torch

    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda"))
    for extra, needle in cases:
        with pytest.raises(SystemExit) as exc:
            main(base + extra)
        assert str(exc.value).startswith("error: ") and needle in str(exc.value), (extra, exc.value)


def test_load_refuses_shape_flags_that_disagree_with_the_checkpoint(tmp_path):
    """With --load the checkpoint gives the network: an explicit shape flag that differs from its saved
    arguments (or a fresh model's --vocab-size) is an error naming each flag, not silently dropped."""
    import pytest
    import torch

    from tests.helpers.tiny_data import make_tiny_dataset
    from tools.pattern_recall import main

    prefix, _ = make_tiny_dataset(tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "padded_vocab_size": 128}
    torch.save({"args": saved, "model": {}}, ckpt / "iter_0000001" / "mp_rank_00.pt")
    base = ["--load", str(ckpt), "--data-path", prefix, "--seq-length", "256", "--out", str(tmp_path / "rec")]
    with pytest.raises(SystemExit) as exc:
        main(base + ["--num-layers", "3", "--hidden-size", "128", "--vocab-size", "64"])
    msg = str(exc.value)
    assert "--num-layers 3 (checkpoint: 2); --hidden-size 128 (checkpoint: 64); --vocab-size 64" in msg, msg
    assert "--num-attention-heads" not in msg                  # not given: the checkpoint's 4 is used


def test_vocab_of_a_huggingface_tokenizer_checkpoint(tmp_path):
    """A pretrain_gpt.py checkpoint trained with --tokenizer-type HuggingFaceTokenizer saves a
    tokenizer.json as tokenizer_model: its vocabulary is read with the tokenizers library (it was
    handed to sentencepiece: 'could not parse ModelProto')."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from tests.helpers.tiny_data import make_tiny_dataset
    from tools.pattern_recall import tokenizer_vocab_size

    path = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({f"w{i}": i for i in range(37)}, unk_token="w0")).save(str(path))
    assert tokenizer_vocab_size(str(path), "HuggingFaceTokenizer") == 37
    assert tokenizer_vocab_size(str(path)) == 37
    _, spm_model = make_tiny_dataset(tmp_path / "data")
    assert tokenizer_vocab_size(spm_model, "SentencePieceTokenizer") == 128


def test_recall_stride_samples_whole_chunks_and_keeps_the_probe_rows():
    """--recall-stride K: every K-th chunk of rows (centred) and the chunks holding the last last_q rows are
    bitwise the full computation's; the other rows are NaN (the report averages with nanmean).
    Negative control: the full computation has no NaN, so the sampled rows are a strict subset."""
    import math

    import torch

    from tools.pattern_recall import exact_mass_inside, sampled_rows

    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 1, 640, 4, 2, 16
    q = torch.randn(b, s, hq, d, generator=g)
    k = torch.randn(b, s, hkv, d, generator=g)
    keep = torch.rand(b, hq, s, s, generator=g) < 0.5
    mask = lambda r0, r1: keep[:, :, r0:r1, :r1].double()  # noqa: E731
    full = exact_mass_inside(q, k, mask, 1 / math.sqrt(d), rows=64)
    part = exact_mass_inside(q, k, mask, 1 / math.sqrt(d), rows=64, stride=3, last_q=100)
    assert not full.isnan().any()
    computed = ~part[0, 0].isnan()
    chunk = torch.arange(s) // 64
    grid = chunk % 3 == 1                           # centred in each stride: chunks 1, 4, 7
    assert torch.equal(sampled_rows(s, 3, rows=64), grid)
    assert torch.equal(sampled_rows(s, 1, rows=64), torch.ones(s, dtype=torch.bool))
    want = grid | (chunk >= (s - 100) // 64)
    assert torch.equal(computed, want)
    assert torch.equal(part[..., want], full[..., want])
    assert part.isnan().sum() > 0


def test_strided_recall_without_timings_end_to_end(tmp_path):
    """--recall-stride 2 --timing-repeats 0 through main(): strict JSON (no NaN), null timings, the
    probe recall equal to the stride-1 run's (bitwise: the same rows), the budgets and sparsity
    unchanged, and recall over the sampled rows only (recall_rows)."""
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    reports = {}
    for stride in (1, 2):
        out = tmp_path / f"rec{stride}"
        res = run_python("tools/pattern_recall.py", [
            "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "1024", "--recall", "0.9",
            "--timing-repeats", "0", "--plot-heads", "0", "--recall-stride", str(stride), "--out", str(out)],
            timeout=300)
        assert res.returncode == 0, res.tail()
        text = (tmp_path / f"rec{stride}.json").read_text()
        reports[stride] = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    one, two = reports[1], reports[2]
    assert (one["recall_stride"], one["recall_rows"]) == (1, 1024)
    assert (two["recall_stride"], two["recall_rows"]) == (2, 512)            # chunks 1 and 3 of 4
    assert two["summary"]["est_time_ratio_mean"] is None
    (l1,), (l2,) = one["layers"], two["layers"]
    assert l2["estimator_s"] is None and l2["est_time_ratio"] is None
    for h1, h2 in zip(l1["heads"], l2["heads"]):
        assert h2["probe_recall"] == h1["probe_recall"]
        assert (h2["vertical"], h2["slash"], h2["sparsity"]) == (h1["vertical"], h1["slash"], h1["sparsity"])
        assert 0 < h2["recall"] <= 1


def test_share_pattern_kv_group_reports_recall_per_query_head(tmp_path):
    """--share-pattern kv_group: one pattern per KV head (saved rows: layer x sample x KV head), recall
    and sparsity still per query head, the heads of a group with the same budgets."""
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    out, pat = tmp_path / "rec", tmp_path / "pat.npz"
    res = run_python("tools/pattern_recall.py", [
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "256", "--recall", "0.9",
        "--sink-tokens", "16", "--share-pattern", "kv_group", "--timing-repeats", "0", "--plot-heads", "0",
        "--out", str(out), "--save-pattern", str(pat)], timeout=300)
    assert res.returncode == 0, res.tail()
    report = json.loads((tmp_path / "rec.json").read_text())
    assert report["config"]["share_pattern"] == "kv_group"
    heads = report["layers"][0]["heads"]
    assert [h["kv_head"] for h in heads] == [0, 0, 1, 1]
    for a, b in ((0, 1), (2, 3)):                         # one pattern per group
        assert heads[a]["vertical"] == heads[b]["vertical"] and heads[a]["slash"] == heads[b]["slash"]
        assert heads[a]["sparsity"] == heads[b]["sparsity"]
    assert all(0.0 < h["recall"] <= 1.0 for h in heads)
    z = np.load(pat)
    meta = json.loads(str(z["meta"]))
    assert meta["rows_per_layer"] == 2 and meta["share_pattern"] == "kv_group" and z["slash"].shape[0] == 2


def test_pattern_recall_reports_per_layer_under_a_config_policy(tmp_path):
    """--mtraining-config: each layer is measured with its own budgets (layer_overrides), dense_layers
    are reported as exact; every layer carries Megatron's 1-based layer_number."""
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.5, max_slash: 2, max_vertical: 64}\n"
                   "dense_layers: [1]\nlayer_overrides: {'3': {recall: 1.0, max_slash: 8, max_vertical: 512}}\n")
    out = tmp_path / "rec"
    res = run_python("tools/pattern_recall.py", [
        "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "512", "--timing-repeats", "0",
        "--plot-heads", "0", "--out", str(out), "--mtraining-config", str(cfg),
        "--write-policy", str(tmp_path / "new_dir" / "chosen.yaml"), "--policy-min-recall", "0.999",
        "--policy-min-speedup", "1e-6", "--policy-timing-repeats", "1"], timeout=300)
    assert res.returncode == 0, res.tail()
    assert "layer 0 (layer_number 1): dense (dense_layers)" in res.stdout, res.tail()
    report = json.loads((tmp_path / "rec.json").read_text())
    layers = report["layers"]
    assert [l["layer_number"] for l in layers] == [1, 2, 3] and [l["dense"] for l in layers] == [True, False, False]
    assert layers[0]["recall_mean"] == 1.0 and layers[0]["heads"] == []
    assert [l["recall_target"] for l in layers[1:]] == [0.5, 1.0]
    # recall 1.0 with caps over every line keeps all the mass; the tight budgets of layer 2 lose some
    assert layers[2]["recall_mean"] == pytest.approx(1.0, abs=1e-12)
    assert layers[1]["recall_mean"] < 0.999
    assert report["layer_policy"] == "dense 1; layers 3: max_slash=8,max_vertical=512,recall=1.0"
    below = report["summary"]["layers_below_recall_target"]
    assert set(below) <= {2} and all(isinstance(n, int) for n in below)
    # --write-policy: layer 2 (recall below 0.999) joins dense_layers, layer 3 (recall 1.0) keeps its override
    from megatron_mtraining.config import load_mtraining_config
    chosen = load_mtraining_config(tmp_path / "new_dir" / "chosen.yaml")   # its folder is made, as OUT's
    assert chosen.dense_layers == (1, 2) and chosen.layer_policy_text().endswith("layers 3: max_slash=8,max_vertical=512,recall=1.0")
    assert [d["layer_number"] for d in report["policy"]["dense_layers_added"]] == [2]
    assert "policy: layer_number 2 runs dense (recall" in res.stdout
    # --policy-min-speedup 1e-6 (negative control): both sparse layers timed, sparse and dense, on the torch
    # kernels of the CPU; no speedup is that low, so speed adds no layer (layer 2's reason is its recall only)
    assert layers[0]["speedup"] is None and report["policy"]["min_speedup"] == 1e-6
    for layer in layers[1:]:
        assert layer["sparse_ms"] > 0 and layer["dense_ms"] > 0
        assert layer["speedup"] == pytest.approx(layer["dense_ms"] / layer["sparse_ms"])
        assert (layer["sparse_kernels"], layer["dense_kernels"]) == ("sparse: torch", "dense: torch")
    assert "speedup" not in report["policy"]["dense_layers_added"][0]["reason"]
    assert report["speed_timing"] == {"dtype": "float32", "repeats": 1, "warmup": 2, "clock": "perf_counter"}


def test_policy_dense_layers_thresholds():
    from tools.pattern_recall import policy_dense_layers

    layers = [{"layer_number": 1, "dense": True, "sparsity_mean": 0.0, "recall_mean": 1.0},
              {"layer_number": 2, "dense": False, "sparsity_mean": 0.4, "recall_mean": 0.99},
              {"layer_number": 3, "dense": False, "sparsity_mean": 0.9, "recall_mean": 0.95}]
    assert policy_dense_layers(layers, 0.5, None) == [(2, "kept 0.600 > 0.5")]
    assert policy_dense_layers(layers, 0.6, None) == []                      # not above: stays sparse
    assert [n for n, _ in policy_dense_layers(layers, None, 0.98)] == [3]
    assert [n for n, _ in policy_dense_layers(layers, 0.05, 0.999)] == [2, 3]
    # a recall that was not measured (NaN) never compares below: it must not pass as good enough
    layers[2]["recall_mean"] = float("nan")
    with pytest.raises(ValueError, match="layer_number 3: recall nan was not measured"):
        policy_dense_layers(layers, None, 0.98)
    assert [n for n, _ in policy_dense_layers(layers, 0.5, None)] == [2]


def test_policy_min_speedup_picks_exactly_the_slow_layers():
    """--policy-min-speedup S on injected speedups: dense exactly for the sparse layers below S (equal to S
    stays sparse), with the reason; S small: none (negative control); a layer whose speedup was not measured
    is an error, not a pass."""
    from tools.pattern_recall import policy_dense_layers

    speedups = {2: 0.82, 3: 1.0, 4: 1.31, 5: 0.999}
    layers = [{"layer_number": 1, "dense": True, "sparsity_mean": 0.0, "recall_mean": 1.0, "speedup": None}] + [
        {"layer_number": n, "dense": False, "sparsity_mean": 0.9, "recall_mean": 0.99, "speedup": x}
        for n, x in speedups.items()]
    for s in (0.5, 0.82, 1.0, 1.05, 2.0):
        chosen = policy_dense_layers(layers, None, None, s)
        assert [n for n, _ in chosen] == [n for n, x in speedups.items() if x < s], s
    assert policy_dense_layers(layers, None, None, 1.0) == [(2, "speedup 0.82 < 1.0"), (5, "speedup 1.00 < 1.0")]
    assert policy_dense_layers(layers, None, None, 1e-6) == []
    assert policy_dense_layers(layers, None, 0.995, 1.05)[0] == (2, "recall 0.9900 < 0.995, speedup 0.82 < 1.05")
    layers[3]["speedup"] = None
    with pytest.raises(ValueError, match="layer_number 4: speedup None was not measured"):
        policy_dense_layers(layers, None, None, 1.0)


def test_layer_speed_times_each_layer_as_its_plan_runs_it():
    """tools/pattern_recall.layer_speed: the layer's sparse plan (its own budgets: estimator, index
    conversion, kernels) against the same config's dense plan, forward and backward, on sample 0 only; the
    times come from the injected timer (here: sparse 4 ms, dense 3 ms: speedup 0.75)."""
    import math

    import torch

    from megatron_mtraining.bench import Timing
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.plan import resolve
    from tools.pattern_recall import layer_speed

    cfg = load_mtraining_config({"pattern": "vertical_slash", "vertical_slash": {"recall": 0.5, "max_slash": 2},
                                 "layer_overrides": {"2": {"recall": 0.9}}})
    sparse_plan, dense_plan = (resolve(c, cp_group=None, seq_len=256, num_layers=2).for_layer(2)
                               for c in (cfg, cfg.with_dense_layers([1, 2])))
    assert sparse_plan.pattern.recall == 0.9 and dense_plan.pattern is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 256, h, 16, generator=g) for h in (4, 2, 2))
    seen = []

    def fake_timer(step, *, device, warmup, repeats):
        grads = step()
        seen.append([tuple(x.shape) for x in grads])
        return Timing((4.0 if len(seen) == 1 else 3.0,) * repeats, warmup, "fake")

    speed = layer_speed(q, k, v, sparse_plan, dense_plan, 1 / math.sqrt(16), repeats=2, timer=fake_timer)
    assert seen == [[(1, 256, 4, 16), (1, 256, 2, 16), (1, 256, 2, 16)]] * 2          # the first sample only
    assert speed == {"sparse_ms": 4.0, "dense_ms": 3.0, "speedup": 0.75, "repeats": 2, "warmup": 2, "clock": "fake",
                     "sparse_kernels": "sparse: torch", "dense_kernels": "dense: torch", "dtype": "float32"}


def test_policy_min_speedup_writes_a_config_that_round_trips(tmp_path):
    """--policy-min-speedup end to end on the CPU: with S = 1e6 no layer pays, so every sparse layer joins
    dense_layers; the written YAML loads, dumps and loads to the same MTrainingConfig, and its plan runs
    those layers dense."""
    from megatron_mtraining.config import dump_mtraining_config, load_mtraining_config
    from megatron_mtraining.plan import resolve

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg, written = tmp_path / "run.yaml", tmp_path / "policy.yaml"
    cfg.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.9}\nlayer_overrides: {'2': {recall: 0.5}}\n")
    res = run_python("tools/pattern_recall.py", [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--data-path", prefix, "--tokenizer-model", tok, "--seq-length", "256", "--timing-repeats", "0",
        "--plot-heads", "0", "--out", str(tmp_path / "rec"), "--mtraining-config", str(cfg),
        "--write-policy", str(written), "--policy-min-speedup", "1e6", "--policy-timing-repeats", "1"], timeout=300)
    assert res.returncode == 0, res.tail()
    report = json.loads((tmp_path / "rec.json").read_text())
    added = report["policy"]["dense_layers_added"]
    assert [d["layer_number"] for d in added] == [1, 2]
    for d, layer in zip(added, report["layers"]):
        assert d["reason"] == f"speedup {layer['speedup']:.2f} < 1000000.0"
    assert "policy: layer_number 2 runs dense (speedup" in res.stdout and "wrote " + str(written) in res.stdout
    chosen = load_mtraining_config(written)
    assert chosen.dense_layers == (1, 2) and not chosen.layer_overrides and chosen.vertical_slash.recall == 0.9
    dump_mtraining_config(chosen, tmp_path / "again.yaml")
    assert load_mtraining_config(tmp_path / "again.yaml") == chosen
    assert (tmp_path / "again.yaml").read_text() == written.read_text()
    plan = resolve(chosen, cp_group=None, seq_len=256, num_layers=2)
    assert [plan.for_layer(n).sparse for n in (1, 2)] == [False, False]
    assert report["layer_policy"] == "layers 2: recall=0.5" and report["policy"]["layer_policy"] == "dense 1,2"


def test_config_with_dense_layers_splits_overrides():
    from megatron_mtraining.config import load_mtraining_config

    cfg = load_mtraining_config({"pattern": "vertical_slash", "dense_layers": [1],
                                 "layer_overrides": {"2-6": {"recall": 0.98}}})
    out = cfg.with_dense_layers([4, 7])
    assert out.dense_layers == (1, 4, 7)
    assert out.layer_policy_text() == "dense 1,4,7; layers 2-3: recall=0.98; layers 5-6: recall=0.98"
    assert cfg.with_dense_layers([]) is cfg
    for bad in ([0], [3, "4"], [True], [2.0]):
        with pytest.raises(ValueError, match="1-based layer number"):
            cfg.with_dense_layers(bad)
    import numpy as np
    assert cfg.with_dense_layers([np.int64(3)]).dense_layers == (1, 3)
    with pytest.raises(ValueError, match="needs pattern: vertical_slash"):
        load_mtraining_config({"pattern": "dense"}).with_dense_layers([2])


def test_pattern_recall_config_policy_errors(tmp_path):
    from tools.pattern_recall import main

    base = ["--data-path", str(tmp_path / "none"), "--seq-length", "256", "--out", str(tmp_path / "rec")]
    dense, sparse = tmp_path / "dense.yaml", tmp_path / "sparse.yaml"
    dense.write_text("pattern: dense\n")
    sparse.write_text("pattern: vertical_slash\ndense_layers: [1]\n")
    for extra, needle in [(["--mtraining-config", str(dense)], "needs pattern: vertical_slash"),
                          (["--mtraining-config", str(sparse), "--recall", "0.8"], "drop --recall"),
                          (["--mtraining-config", str(sparse), "--save-pattern", str(tmp_path / "p.npz")],
                           "a dense layer has none"),
                          (["--write-policy", str(tmp_path / "w.yaml"), "--policy-max-kept", "0.3"],
                           "go together with --mtraining-config"),
                          (["--mtraining-config", str(sparse), "--write-policy", str(tmp_path / "w.yaml")],
                           "needs --policy-max-kept"),
                          (["--mtraining-config", str(sparse), "--write-policy", str(tmp_path / "w.yaml"),
                            "--policy-max-kept", "1.5"], "must be in [0, 1]"),
                          (["--policy-min-speedup", "1.0"], "error: --policy-min-speedup: "),
                          (["--mtraining-config", str(sparse), "--policy-min-speedup", "1.0"],
                           "go together with --mtraining-config and --write-policy"),
                          (["--mtraining-config", str(sparse), "--write-policy", str(tmp_path / "w.yaml"),
                            "--policy-min-speedup", "1.0", "--packed"], "--policy-min-speedup with --packed")]:
        with pytest.raises(SystemExit) as exc:
            main(base + extra)
        assert str(exc.value).startswith("error: ") and needle in str(exc.value), (extra, exc.value)
    assert not (tmp_path / "w.yaml").exists()


@pytest.mark.parametrize("flag, value", [("--policy-min-speedup", "0"), ("--policy-min-speedup", "-1"),
                                         ("--policy-min-speedup", "nan"), ("--policy-min-speedup", "inf"),
                                         ("--policy-min-speedup", "fast"), ("--policy-timing-repeats", "0")])
def test_policy_speed_flags_bad_values_are_argparse_errors(flag, value, capsys):
    from tools.pattern_recall import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be" in err and repr(value) in err, err


def test_packed_mode_compares_stream_and_document_probes(tmp_path):
    """--packed: one stream of several documents (forward with the documents' PackedSeqParams, positions
    restarting per document), recall of the library's per-stream estimate, of per-document estimates and of
    the library's estimate with per-document probes,
    each in [0, 1] with their sparsities, also at the --sweep-recall targets (recall 1.0 with caps over every
    line keeps all the mass of both)."""
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    res = run_python("tools/pattern_recall.py", [
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--data-path", prefix, "--tokenizer-model", tok, "--recall", "0.9", "--sink-tokens", "8",
        "--timing-repeats", "0", "--packed", "--seq-length", "512", "--sweep-recall", "0.5", "1.0",
        "--out", str(tmp_path / "many")], timeout=300)
    assert res.returncode == 0, res.tail()
    many = json.loads((tmp_path / "many.json").read_text())
    assert many["packed"]["documents_per_stream"][0] >= 3 and many["recall_rows"] == 512
    for h in many["layers"][0]["heads"]:
        for key in ("recall_stream", "recall_document", "recall_document_probes", "probe_recall_stream"):
            assert 0.0 < h[key] <= 1.0 + 1e-12, (key, h)
        for key in ("sparsity_stream", "sparsity_document", "sparsity_document_probes"):
            assert 0.0 <= h[key] < 1.0, (key, h)
        assert len(h["vertical_document"]) == many["packed"]["documents_per_stream"][0]
    s = many["summary"]
    assert {"recall_stream_mean", "recall_document_mean", "recall_document_probes_mean", "sparsity_stream_mean",
            "sparsity_document_mean", "sparsity_document_probes_mean"} <= set(s)
    assert [r["recall_target"] for r in s["sweep"]] == [0.9, 0.5, 1.0]
    assert s["sweep"][0]["recall_stream"] == s["recall_stream_mean"]
    full = s["sweep"][2]
    for key in ("recall_stream", "recall_document", "recall_document_probes"):
        assert full[key] == pytest.approx(1.0, abs=1e-12), key


def test_packed_recall_is_scored_under_the_document_mask():
    """The packed recall pieces on random q/k: the exact attention with the document bounds sums to 1 per
    row inside the document mask and differs from plain causal attention (negative control: the same
    pattern scored without the bounds); the per-document union restricted to one document is that
    document's own pattern, and its work equals the estimator's own step accounting for one document."""
    import math

    import torch

    from megatron_mtraining.layout import PackedDocuments
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
    from megatron_mtraining.layout import Layout
    from tools.pattern_recall import (document_union_rows, estimate_per_document, exact_mass_inside,
                                      pattern_rows, per_query_head, union_work, work)
    from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents

    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 1, 512, 4, 2, 16
    q = torch.randn(b, s, hq, d, generator=g)
    k = torch.randn(b, s, hkv, d, generator=g)
    k[:, 200] *= 6                       # a strong key in the second document: a causal-only score sees it
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 150, 330, 512]), s)
    cfg = VerticalSlashConfig(recall=0.8, last_q=64, sink_tokens=8, max_vertical=64, max_slash=4)
    scale = 1 / math.sqrt(d)
    lay = Layout("striped", 1, 64)
    stream = per_query_head(estimate_vertical_slash(q, k, layout=lay, config=cfg, softmax_scale=scale,
                                                    documents=docs), hq)
    bounds = (docs.lo, docs.hi)
    ones = lambda r0, r1, k0: torch.ones(b, hq, r1 - r0, r1 - k0, dtype=torch.bool)  # noqa: E731
    assert torch.allclose(exact_mass_inside(q, k, ones, scale, bounds=bounds), torch.ones(b, hq, s, dtype=torch.float64))
    same_doc = lambda r0, r1: ((torch.arange(r1)[None, :] >= docs.lo[0, r0:r1, None])  # noqa: E731
                               .expand(b, hq, -1, -1))
    plain = exact_mass_inside(q, k, same_doc, scale)            # causal only: mass leaks to other documents
    assert plain[..., 150:].min() < 0.9
    with_docs = exact_mass_inside(q, k, lambda r0, r1, k0: pattern_rows(stream, r0, r1, k0), scale, bounds=bounds)
    without = exact_mass_inside(q, k, lambda r0, r1: pattern_rows(stream, r0, r1), scale)
    assert (with_docs - without).abs().max() > 1e-3
    per_doc = estimate_per_document(q, k, docs, cfg, scale)
    assert [(a, s0, n) for _, a, s0, n, _, _ in per_doc] == [(0, 0, 150), (128, 150, 180), (320, 330, 182)]
    row, a, s0, n, pat, steps = per_doc[1]
    union = document_union_rows(per_doc, (b, hq), 192, 256, q.device)
    assert torch.equal(union[0, :, :, a:256], pattern_rows(pat, 192 - a, 256 - a)[0])
    assert not union[0, :, :, :a].any()
    assert torch.equal(document_union_rows(per_doc, (b, hq), 192, 256, q.device, k0=150), union[..., 150:])
    assert torch.equal(union_work(per_doc[1:2], (b, hq), s, 64), work(steps, 64))
    whole = PackedDocuments.from_cu_seqlens(torch.tensor([0, s]), s)
    pw = per_query_head(estimate_vertical_slash(q, k, layout=lay, config=cfg, softmax_scale=scale), hq)
    one = estimate_per_document(q, k, whole, cfg, scale)
    assert torch.equal(one[0][4].vertical, pw.vertical) and torch.equal(one[0][4].slash, pw.slash)
    assert torch.equal(union_work(one, (b, hq), s, 64),
                       work(restrict_to_documents(convert_pattern(pw, lay, 0), whole, lay, 0), 64))
