"""megatron_mtraining.patterns.synthetic (both seeded generators pinned bit for bit: the benchmarks'
numbers depend on them) and megatron_mtraining.patterns.io (pattern files)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from megatron_mtraining.patterns.io import head_lines, load_pattern, pattern_from_arrays, save_pattern
from megatron_mtraining.patterns.synthetic import SyntheticConfig, synthetic_pattern, vertical_slash_indices


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_calibrated_generator_is_pinned():
    idx, st = vertical_slash_indices(4096, 3, 0.9, seed=1)
    assert _digest(idx.block_count, idx.block_index, idx.column_count, idx.column_index) == \
        "0c77fd358d1cc005db8aceaf73716165d35a0ccf9a46d87f6d11f4938a3263dd"
    assert (st.block_tiles, st.column_pairs, st.column_tiles) == (750, 132480, 180)
    assert st.keep == pytest.approx(0.11192640956797657, rel=0, abs=0)
    other, _ = vertical_slash_indices(4096, 3, 0.9, seed=2)                  # negative control: the seed matters
    assert _digest(other.column_count, other.column_index) != _digest(idx.column_count, idx.column_index)


def test_rope_like_generator_is_pinned():
    p = synthetic_pattern(16384, SyntheticConfig(heads=3, sparsity=0.9, sinks=8, window=2, seed=5))
    assert _digest(p.slash, p.slash_count, p.vertical, p.vertical_count) == \
        "967dedba7be75b4a427efa0a1e5b2b7d8f2b06e7db4552638809a157016eda59"


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_pattern_file_round_trip(tmp_path, suffix):
    pat = pattern_from_arrays(1024, [np.array([3, 0, 1, 1]), np.array([0])], [np.array([5, 2]), np.array([], np.int64)])
    assert [(s.tolist(), v.tolist()) for s, v in head_lines(pat)] == [([0, 1, 3], [2, 5]), ([0], [])]
    path = str(tmp_path / f"p{suffix}")
    save_pattern(path, pat, {"model": "m", "layers": 1})
    back, meta = load_pattern(path)
    assert back.same_selection(pat) and back.seq_len == 1024 and meta == {"model": "m", "layers": 1}


def test_out_of_range_lines_and_block_sizes_are_errors(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        pattern_from_arrays(1024, [np.array([16])], [np.array([0])])          # 1024 / 64 = 16 blocks
    with pytest.raises(ValueError, match="out of range"):
        pattern_from_arrays(1024, [np.array([0])], [np.array([1024])])
    path = tmp_path / "b.npz"
    np.savez_compressed(path, seq_len=1024, block_size=128, slash=np.zeros((1, 1), np.int64),
                        vertical=np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match="block_size 128"):
        load_pattern(str(path))


def test_files_that_are_not_patterns_are_named_errors(tmp_path):
    """An empty file, an .npz without the pattern's arrays, a single-array file and a .pt holding a list are
    ValueErrors naming the file (EOFError, KeyError and AttributeError before); a missing file is
    FileNotFoundError."""
    import torch

    empty, other, one, lst = tmp_path / "e.npz", tmp_path / "o.npz", tmp_path / "a.npy", tmp_path / "l.pt"
    empty.write_bytes(b"")
    np.savez(other, x=np.zeros(3))
    np.save(one, np.zeros(3))
    torch.save([1, 2], lst)
    for path in (empty, other, one, lst):
        with pytest.raises(ValueError, match=rf"{path}: not a pattern file written by save_pattern"):
            load_pattern(str(path))
    with pytest.raises(FileNotFoundError, match="pattern file not found"):
        load_pattern(str(tmp_path / "none.npz"))
