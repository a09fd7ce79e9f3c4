"""One vertical-slash pattern per GQA group (``VerticalSlashConfig.share_pattern="kv_group"``).

The estimator against an independent fp64 reference of the rule (probe softmax per query head,
scores averaged over the group, greedy budget with floors and caps), its negative control (a
per-head pattern differs on inputs whose heads disagree), the config front doors (dataclass, YAML,
cross-rank agreement fields) and :meth:`StepIndices.per_query_head`.
"""
import dataclasses

import pytest
import torch

from megatron_mtraining.config import load_mtraining_config
from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.sparse_reference import sparse_attention_forward
from megatron_mtraining.patterns.convert import convert_pattern
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
from megatron_mtraining.ring.sparse import sparse_agreement_fields
from tests.workers.vs_data import make_qkv, probe_scores

ONE = Layout("striped", 1, 64)
S, D, L, BS = 256, 16, 64, 64
SCALE = D ** -0.5


def _reference_select(scores, n_floor, cap, target):
    """Independent greedy budget: floors (by position), then decreasing score (ties: position);
    the shortest prefix whose mass reaches ``target``, at least the floors, at most the cap."""
    n = scores.numel()
    floors = list(range(min(n_floor, n)))
    rest = sorted(range(len(floors), n), key=lambda i: (-float(scores[i]), i))
    order = floors + rest
    total, count = 0.0, 0
    for i in order:
        count += 1
        total += float(scores[i])
        if total >= target:
            break
    count = min(max(count, len(floors)), cap, n)
    return sorted(order[:count])


def _reference_pattern(q, k, cfg):
    """``(vertical, slash)`` lists ``[b][hkv]`` of the group rule from fp64 per-head probe scores."""
    col, slash = probe_scores(q, k, cfg.last_q, cfg.block_size, SCALE)       # [b, hq, S], [b, hq, S/bs]
    b, hq, _ = col.shape
    hkv = k.shape[2]
    col = col.view(b, hkv, hq // hkv, -1).mean(2)
    slash = slash.view(b, hkv, hq // hkv, -1).mean(2)
    target = cfg.recall * cfg.last_q
    vert = [[_reference_select(col[i, g], cfg.sink_tokens, cfg.max_vertical, target) for g in range(hkv)]
            for i in range(b)]
    sl = [[_reference_select(slash[i, g], cfg.local_blocks, cfg.max_slash, target) for g in range(hkv)]
          for i in range(b)]
    return vert, sl, col, slash


def _lists(pat):
    vert = [[pat.vertical[i, h, :pat.vertical_count[i, h]].tolist() for h in range(pat.num_heads)]
            for i in range(pat.batch)]
    sl = [[pat.slash[i, h, :pat.slash_count[i, h]].tolist() for h in range(pat.num_heads)] for i in range(pat.batch)]
    return vert, sl


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (4, 1), (3, 3)])
def test_group_pattern_matches_fp64_reference(hq, hkv):
    q, k, _ = make_qkv(2, S, hq, hkv, D, seed=hq + hkv)
    cfg = VerticalSlashConfig(recall=0.9, last_q=L, block_size=BS, sink_tokens=16, local_blocks=1,
                              max_vertical=S, max_slash=S // BS, share_pattern="kv_group")
    pat = estimate_vertical_slash(q, k, layout=ONE, config=cfg, softmax_scale=SCALE, impl="torch")
    assert pat.num_heads == hkv and pat.batch == 2
    vert, sl, col, slash = _reference_pattern(q, k, cfg)
    assert _lists(pat) == (vert, sl)
    # the diagnostics are the group-mean mass of the chosen lines
    for i in range(2):
        for g in range(hkv):
            assert abs(pat.est_vertical_mass[i, g].item() * L - col[i, g, vert[i][g]].sum().item()) <= 1e-10 * L
            assert abs(pat.est_slash_mass[i, g].item() * L - slash[i, g, sl[i][g]].sum().item()) <= 1e-10 * L


def test_group_pattern_converts_per_group_exactly_once():
    """The conversion of a kv_group pattern at cp 2 keeps one index row per KV head and lists every
    (query, key) pair of the pattern exactly once on each rank."""
    q, k, _ = make_qkv(1, S, 4, 2, D, seed=9)
    cfg = VerticalSlashConfig(recall=0.9, sink_tokens=16, local_blocks=1, share_pattern="kv_group")
    pat = estimate_vertical_slash(q, k, layout=ONE, config=cfg, softmax_scale=SCALE)
    lay = Layout("striped", 2, 64)
    from megatron_mtraining.patterns.convert import step_key_mask
    mask = pat.dense_mask()                                               # [1, hkv, S, S]
    for r in range(2):
        steps = convert_pattern(pat, lay, r)
        assert all(st.num_heads == 2 for st in steps)
        qpos = lay.positions(r, S)
        for o, st in enumerate(steps):
            kpos = lay.positions(o, S)
            m = step_key_mask(st, S // 2, counts=True)
            assert m.max() <= 1
            assert torch.equal(m.bool(), mask[:, :, qpos][:, :, :, kpos])


def _disagreeing_heads():
    """One KV head, two query heads: head 0 attends sharply to key column 100, head 1 to column 150
    (orthogonal directions of the shared keys); every probe query sees both."""
    q = torch.zeros(1, S, 2, D, dtype=torch.float64)
    k = torch.zeros(1, S, 1, D, dtype=torch.float64)
    k[0, 100, 0, 0] = 12.0
    k[0, 150, 0, 1] = 12.0
    q[0, :, 0, 0] = 12.0
    q[0, :, 1, 1] = 12.0
    return q, k


def test_headwise_pattern_differs_when_heads_disagree():
    q, k = _disagreeing_heads()
    base = dict(recall=0.9, sink_tokens=0, local_blocks=1, max_vertical=S, max_slash=S // BS)
    head = estimate_vertical_slash(q, k, layout=ONE, config=VerticalSlashConfig(**base), softmax_scale=1.0)
    group = estimate_vertical_slash(q, k, layout=ONE, config=VerticalSlashConfig(**base, share_pattern="kv_group"),
                                    softmax_scale=1.0)
    hv, _ = _lists(head)
    gv, _ = _lists(group)
    assert hv[0] == [[100], [150]], hv                 # construction: each head has its own column
    assert gv[0] == [[100, 150]], gv                   # the group keeps both (each holds half the mean mass)
    assert not torch.equal(head.dense_mask(), group.dense_mask().expand(1, 2, S, S))
    # and the reference of the rule agrees
    vert, _, _, _ = _reference_pattern(q, k, VerticalSlashConfig(**base, share_pattern="kv_group", last_q=L))
    assert vert == gv


def test_config_front_doors(tmp_path):
    with pytest.raises(ValueError, match="share_pattern"):
        VerticalSlashConfig(share_pattern="group")
    with pytest.raises(ValueError, match="share_pattern"):
        VerticalSlashConfig(share_pattern=None)
    f = tmp_path / "c.yaml"
    f.write_text("pattern: vertical_slash\nvertical_slash:\n  share_pattern: kv_group\n")
    cfg = load_mtraining_config(str(f))
    assert cfg.vertical_slash.share_pattern == "kv_group"
    assert load_mtraining_config(str(f)).to_dict()["vertical_slash"]["share_pattern"] == "kv_group"
    f.write_text("pattern: vertical_slash\nvertical_slash:\n  share_pattern: kv\n")
    with pytest.raises(ValueError, match="'vertical_slash.share_pattern' must be one of 'head', 'kv_group'"):
        load_mtraining_config(str(f))
    a = sparse_agreement_fields(VerticalSlashConfig(), "in_ring")
    b = sparse_agreement_fields(VerticalSlashConfig(share_pattern="kv_group"), "in_ring")
    assert a != b and a["share_pattern"] != b["share_pattern"]


def test_per_query_head_repeats_group_rows_adjacently():
    q, k, v = make_qkv(1, S, 4, 2, D, seed=4)
    cfg = VerticalSlashConfig(recall=0.9, sink_tokens=16, local_blocks=1, share_pattern="kv_group")
    pat = estimate_vertical_slash(q, k, layout=ONE, config=cfg, softmax_scale=SCALE)
    st = convert_pattern(pat, ONE, 0)[0]
    full = st.per_query_head(4)
    assert full.num_heads == 4 and st.per_query_head(2) is st
    for h in range(4):
        assert torch.equal(full.block_count[:, h], st.block_count[:, h // 2])
        assert torch.equal(full.column_index[:, h], st.column_index[:, h // 2])
    # the reference kernels accept the per-group indices directly (same numbers as the repeated ones)
    o1, l1 = sparse_attention_forward(q, k, v, st, SCALE)
    o2, l2 = sparse_attention_forward(q, k, v, full, SCALE)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    with pytest.raises(ValueError, match="GQA"):
        st.per_query_head(3)
    assert dataclasses.replace(st, known_max=None).per_query_head(4).num_heads == 4


def test_plan_carries_share_pattern_to_the_ring_and_the_agreement(tmp_path):
    """The option reaches the consumers through the plan: its pattern config (what the attention
    module passes to the sparse ring) and the fields every CP rank must agree on."""
    from megatron_mtraining.plan import resolve

    f = tmp_path / "c.yaml"
    f.write_text("implementation: striped\ngranularity: 64\npattern: vertical_slash\n"
                 "vertical_slash:\n  share_pattern: kv_group\n")
    plan = resolve(str(f), cp_group=None, seq_len=1024, device="cpu", dtype=torch.float32)
    assert plan.pattern.share_pattern == "kv_group"
    fields = plan.agreement_fields(softmax_scale=0.125)
    assert fields["share_pattern"] == 1
    f.write_text("implementation: striped\ngranularity: 64\npattern: vertical_slash\n")
    assert resolve(str(f), cp_group=None, seq_len=1024).agreement_fields(softmax_scale=0.125)["share_pattern"] == 0
