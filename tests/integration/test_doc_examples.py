"""Every Python code block of README.md and docs/user_guide.md runs, so that a snippet that no longer
works (or silently does something else) fails here.

Blocks are run in order, each in a fresh namespace holding what a user's training script has
(:func:`_script_context`: a tiny ``TransformerConfig``, one CP rank of a one-rank group with
megatron-core's parallel state, a micro-batch, q/k/v), from the repository root, on the CPU. A block
that cannot run here is marked in the Markdown by ``<!-- not-run: REASON -->`` on the line before
its fence, and the reason must be given.

Before the README's quick start was fixed, it loaded ``configs/demo_sparse.yaml`` and built the
layer spec without it (silently the dense ring); the block now asserts that its layers run the
sparse pattern.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore")

from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_transformer_config_kwargs  # noqa: E402
from tests.helpers.dist import one_rank_megatron  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/user_guide.md")
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, not_run_reason)`` of every fenced Python block; ``not_run_reason`` is the text of
    a ``<!-- not-run: ... -->`` comment on the last non-blank line before the fence (``""`` if empty),
    else ``None``."""
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        mark = _NOT_RUN.search(before[-1]) if before else None
        out.append((line, m.group(1), mark.group(1).strip() if mark else None))
    return out


def _script_context() -> dict:
    """The names a user's script holds where the snippets run (tiny sizes, CP size 1)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    seq_len, vocab_size, b = 256, 128, 2
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab_size, (b, seq_len), generator=g)
    tokens[:, 100] = 0                                                       # EOD: two documents per row
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               hidden_dropout=0.0, attention_dropout=0.0, **cpu_transformer_config_kwargs())
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(b, seq_len),
             "position_ids": torch.arange(seq_len).expand(b, -1).contiguous()}
    q, k, v = (torch.randn(b, seq_len, h, 16, generator=g) for h in (4, 2, 2))
    return dict(config=config, seq_len=seq_len, vocab_size=vocab_size, batch=batch, eod=0, cp_size=1, cp=1,
                cp_rank=0, rank=0, cp_group=None, q=q, k=k, v=v, S=seq_len, b=b,
                cu_seqlens=torch.tensor([0, 100, 256, 300, 512]))


def test_block_extraction_and_marker():
    # negative control for the extraction: a marked block carries its reason, others none
    text = "x\n```python\na = 1\n```\n<!-- not-run: needs CUDA -->\n\n```python\nb = 2\n```\n```bash\nc\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", None), (7, "b = 2\n", "needs CUDA")]


def test_every_python_block_of_the_docs_runs(monkeypatch):
    apply_cpu_patches()
    monkeypatch.chdir(ROOT)
    ran, failures = 0, []
    with one_rank_megatron():
        for doc in DOCS:
            for line, code, reason in python_blocks((ROOT / doc).read_text()):
                where = f"{doc}:{line}"
                if reason is not None:
                    assert reason, f"{where}: a not-run block must say why"
                    continue
                torch.manual_seed(0)
                try:
                    exec(compile(code, where, "exec"), _script_context())
                    ran += 1
                except Exception as e:   # every failing block is reported, not only the first
                    failures.append(f"{where}: {type(e).__name__}: {e}")
    assert not failures, "documentation code blocks that fail:\n" + "\n".join(failures)
    assert ran >= 6, ran
    assert os.getcwd() == str(ROOT)


def test_a_failing_block_is_reported(monkeypatch, tmp_path):
    # negative control: the dense spec where the README promises the sparse pattern fails its assert
    readme = (ROOT / "README.md").read_text()
    (quick,) = [c for _, c, r in python_blocks(readme) if "demo_sparse.yaml" in c and r is None]
    broken = quick.replace("get_gpt_layer_spec_with_mtraining(mtraining_config=cfg)",
                           "get_gpt_layer_spec_with_mtraining()")
    assert broken != quick
    apply_cpu_patches()
    monkeypatch.chdir(ROOT)
    with one_rank_megatron(), pytest.raises(AssertionError):
        exec(compile(broken, "README.md", "exec"), _script_context())
