"""tools/bench_e2e.py on CPU: argument handling (--dry-run) and the exact kept-fraction count."""
from __future__ import annotations

import pytest
import torch

from megatron_mtraining.patterns.estimator import VerticalSlashPattern
from tools import bench_e2e as be


def test_dry_run_prints_one_command_per_mode(capsys):
    assert be.main(["--dry-run", "--seqs", "65536,262144", "--num-layers", "4,2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("+ ")]
    assert len(lines) == 4
    assert sum("--mtraining-config" in x for x in lines) == 2
    assert "--num-layers 2" in lines[-1] and "--seq-length 262144" in lines[-1]


def test_bad_layers_list_is_an_error():
    with pytest.raises(SystemExit):
        be.main(["--dry-run", "--seqs", "65536,131072", "--num-layers", "1,2,3"])


def test_bad_lists_and_failed_runs_are_errors(monkeypatch, tmp_path, capsys):
    """Non-numeric or non-positive --seqs are argument errors; training runs that fail (or give no
    iteration time) make the tool exit 1 naming them, with the record still written."""
    for seqs in ("abc", "0", ""):
        with pytest.raises(SystemExit):
            be.main(["--dry-run", "--seqs", seqs])
    import subprocess

    monkeypatch.setattr(be.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, "", "boom"))
    out = tmp_path / "e2e.json"
    assert be.main(["--seqs", "4096", "--num-layers", "1", "--no-microbench", "--json", str(out)]) == 1
    assert "2 of 2 training runs failed or gave no iteration time (4096 dense, 4096 mtraining)" in capsys.readouterr().err
    assert out.exists()


def test_kept_fraction_matches_brute_force():
    S, bs = 1024, 64
    pat = VerticalSlashPattern.from_lists(S, bs, slash=[[[0, 1, 5], [0, 3]]],
                                          vertical=[[[0, 5, 70, 700], [1, 2, 1000]]])
    p, t = torch.arange(S)[:, None], torch.arange(S)[None]
    fr = []
    for h in range(2):
        d = pat.slash[0, h][pat.slash[0, h] >= 0]
        v = pat.vertical[0, h][pat.vertical[0, h] >= 0]
        m = (t <= p) & (torch.isin(p // bs - t // bs, d) | torch.isin(t, v))
        fr.append(m.sum().item() / (S * (S + 1) / 2))
    assert be.kept_fraction(pat) == pytest.approx(sum(fr) / 2, rel=1e-12)
    # per head, on random patterns: against the counted token mask (negative control: without the overlap
    # of columns and block diagonals the fraction is larger)
    gen = torch.Generator().manual_seed(3)
    for S, bs in ((512, 64), (1024, 128)):
        nb = S // bs
        sl = [[sorted(torch.randperm(nb, generator=gen)[:n].tolist()) for n in (0, 2, nb // 2)]]
        vt = [[sorted(torch.randperm(S, generator=gen)[:n].tolist()) for n in (30, 0, 50)]]
        pat = VerticalSlashPattern.from_lists(S, bs, sl, vt)
        counted = pat.dense_mask().double().sum((-1, -2)) / (S * (S + 1) / 2)
        assert torch.allclose(pat.kept_fraction(), counted, rtol=1e-12, atol=0)
        cols = pat.vertical[0, 2][pat.vertical[0, 2] >= 0]
        per_offset = torch.tensor([nb * bs * (bs + 1) / 2] + [(nb - x) * bs * bs for x in range(1, nb)],
                                  dtype=torch.float64)
        naive = (pat.slash_mask()[0, 2].double() * per_offset).sum() + (S - cols).sum()
        assert float(naive) / (S * (S + 1) / 2) > float(counted[0, 2]) + 1e-3


def test_bounds_from_the_synthetic_and_the_model_kept_work():
    row = {"dense": {"step_s": 2.0}, "mtraining": {"step_s": 1.0, "kept_in_model": 0.2},
           "attn": {"attn_dense_s": 0.4, "attn_sparse_s": 0.1, "kept_fraction": 0.1}}
    am = be.add_speedup_and_bounds(row, 4)["amdahl"]        # f = 4 * 0.4 / 2 = 0.8, s = 4
    assert row["speedup"] == 2.0 and am["f"] == pytest.approx(0.8) and am["s"] == pytest.approx(4.0)
    assert am["bound"] == pytest.approx(1 / (0.2 + 0.8 / 4))
    assert am["s_model"] == pytest.approx(2.0) and am["bound_model"] == pytest.approx(1 / (0.2 + 0.8 / 2))
    assert am["achieved_over_bound_model"] == pytest.approx(2.0 * (0.2 + 0.4))
    del row["mtraining"]["kept_in_model"]                     # without the trainer's value: no model bound
    row.pop("amdahl")
    assert "bound_model" not in be.add_speedup_and_bounds(row, 4)["amdahl"]
