"""``--metrics-file`` policy: an existing file is appended to, never truncated, and the run says so.

* A new file (in a new directory) is created; nothing extra is logged (negative control).
* An existing file keeps its rows; the run logs that it appends (row count, last iteration); a last
  line cut off mid-write is ended first, so every row this run adds is a whole JSON line.
* ``--help`` documents the policy.
"""

from __future__ import annotations

import json
from argparse import Namespace

import torch

from megatron_mtraining.training import RunMetrics, build_parser, open_metrics_file


def _args(path) -> Namespace:
    return Namespace(metrics_file=str(path), tensorboard_dir=None, global_batch_size=2, seq_length=8,
                     world_size=1, log_interval=10 ** 9, train_iters=10, fp16=False)


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_new_file_is_created_without_note(tmp_path, capsys):
    path = tmp_path / "new" / "m.jsonl"
    m = RunMetrics(_args(path), 1.0, torch.device("cpu"), optimizer=None, rank0=True)
    m.iteration(1, 2.5, 0.1, 1e-3, 16, 0.5)
    m.close()
    assert "appending" not in capsys.readouterr().out
    assert [r["iteration"] for r in _rows(path)] == [1]


def test_existing_file_is_appended_and_the_run_says_so(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    old = '{"iteration": 1, "lm_loss": 9.0}\n{"iteration": 2, "lm_loss": 8.0}\n{"iteration": 3, "lm_'
    path.write_text(old)                                  # a row cut off by a killed run
    m = RunMetrics(_args(path), 1.0, torch.device("cpu"), optimizer=None, rank0=True)
    m.iteration(3, 7.5, 0.1, 1e-3, 16, 0.5)
    m.close()
    out = capsys.readouterr().out
    assert f"--metrics-file {path}: appending to an existing file (3 rows, last iteration 2)" in out
    assert "last line was incomplete" in out
    text = path.read_text()
    assert text.startswith(old + "\n")                    # earlier rows kept, the cut row ended
    new = json.loads(text.splitlines()[-1])
    assert new["iteration"] == 3 and new["lm_loss"] == 7.5


def test_open_metrics_file_note_and_not_rank0(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 4}\n')
    f, note = open_metrics_file(str(path))
    f.close()
    assert note is not None and "1 rows, last iteration 4)" in note and "incomplete" not in note
    assert path.read_text() == '{"iteration": 4}\n'       # opening alone changes nothing
    # only rank 0 writes: another rank neither opens nor touches the file
    RunMetrics(_args(tmp_path / "other.jsonl"), 1.0, torch.device("cpu"), optimizer=None, rank0=False).close()
    assert not (tmp_path / "other.jsonl").exists()


def test_help_documents_the_policy():
    action = next(a for a in build_parser()._actions if "--metrics-file" in a.option_strings)
    assert "appended to, never truncated" in action.help and "Use a new file for a new run" in action.help


def test_sparse_layers_kept_work_is_logged(tmp_path, capsys):
    """The sparse layers' kept share of causal work: in the metrics rows and the log line when given; no key
    and no log field for a dense run (negative control)."""
    path = tmp_path / "m.jsonl"
    args = _args(path)
    args.log_interval = 2
    m = RunMetrics(args, 1.0, torch.device("cpu"), optimizer=None, rank0=True)
    m.iteration(1, 2.5, 0.1, 1e-3, 16, 0.5, kept={"mean": 0.2, "min": 0.1, "max": 0.4, "layers": 2})
    m.iteration(2, 2.4, 0.1, 1e-3, 16, 0.5, kept={"mean": 0.3, "min": 0.1, "max": 0.4, "layers": 2})
    m.iteration(3, 2.3, 0.1, 1e-3, 16, 0.5)
    m.iteration(4, 2.2, 0.1, 1e-3, 16, 0.5)
    m.close()
    rows = _rows(path)
    assert (rows[0]["attention_kept"], rows[0]["attention_kept_min"], rows[0]["attention_kept_max"],
            rows[0]["attention_kept_layers"]) == (0.2, 0.1, 0.4, 2)
    assert "attention_kept" not in rows[2]
    lines = [x for x in capsys.readouterr().out.splitlines() if "iteration" in x]
    assert "attention kept: 0.250 |" in lines[0] and "attention kept" not in lines[1], lines


def test_log_line_loss_leaves_skipped_updates_out(tmp_path, capsys):
    """With a loss scale, the log line averages the loss of the iterations whose update was applied
    (Megatron-LM's training log) and omits it when every update of the interval was skipped; the metrics
    file keeps every iteration's loss. The negative control is the applied interval (both losses)."""
    class Scaler:
        def get_loss_scale(self):
            return torch.tensor(1024.0)

    path = tmp_path / "m.jsonl"
    args = _args(path)
    args.log_interval, args.fp16 = 2, True
    m = RunMetrics(args, 1.0, torch.device("cpu"), optimizer=Scaler(), rank0=True)
    m.iteration(1, 9.0, None, 1e-3, 16, 0.5, skipped=True)
    m.iteration(2, 3.0, 0.1, 1e-3, 16, 0.5)
    m.iteration(3, 8.0, None, 1e-3, 16, 0.5, skipped=True)
    m.iteration(4, 7.0, None, 1e-3, 16, 0.5, skipped=True)
    m.iteration(5, 2.0, 0.1, 1e-3, 16, 0.5)
    m.iteration(6, 4.0, 0.1, 1e-3, 16, 0.5)
    m.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if "iteration " in x]
    assert len(lines) == 3
    assert "lm loss: 3.000000E+00 |" in lines[0] and "number of skipped iterations:   1" in lines[0]
    assert "lm loss" not in lines[1] and "number of skipped iterations:   2" in lines[1]
    assert "lm loss: 3.000000E+00 |" in lines[2] and "number of skipped iterations:   0" in lines[2]
    assert [r["lm_loss"] for r in _rows(path)] == [9.0, 3.0, 8.0, 7.0, 2.0, 4.0]
    assert [r["skipped"] for r in _rows(path)] == [True, False, True, True, False, False]
