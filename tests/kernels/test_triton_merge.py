"""The fused LSE merge kernel (``ops.triton.launch.attention_merge``), run by the Triton CPU interpreter.

Checked against an fp64 merge written apart from ``ops.merge`` (``tests/workers/gpu_common.merge_fp64``,
``logaddexp`` form): out and LSE separately, fp32 / bf16 / fp16 partial outputs (read in their own dtype),
head_dim 64 and 96 (padded tile), a masked row tail, ``-inf`` rows on either side and on both (exact: the other
partial unchanged; out 0 and LSE ``-inf``), LSE gaps past fp32's exp range, strided inputs (transposed outputs,
LSE views), no NaN; a swapped LSE gives another result (negative control); the launcher refuses by name what it
cannot index (``b * h >= 65536``, element offsets of 2**31 or more); ``merge_attention_fast`` keeps the torch
merge on the CPU. The kernel compiles for sm_90 (``tests/workers/merge_aot.py``, no GPU needed).

As in test_triton_kernels.py, the interpreter is chosen before triton is imported; in a session that imported
compiled Triton first, the tests re-run this file in a fresh subprocess.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, run_aot_worker, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")   # log(0) of empty rows

from megatron_mtraining.ops.merge import merge_attention, merge_attention_fast  # noqa: E402
from megatron_mtraining.ops.triton.launch import attention_merge, merge_unsupported  # noqa: E402
from tests.workers.gpu_common import merge_fp64, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_merge_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


NEG = float("-inf")


def partials(b, s, h, d, dtype, seed, dtype2=torch.float32):
    """Two partial results with ``-inf`` rows on side 1 only, side 2 only and both, and LSE gaps of +-200."""
    g = torch.Generator().manual_seed(seed)
    o1 = (torch.randn(b, s, h, d, generator=g) * 2).to(dtype)
    o2 = (torch.randn(b, s, h, d, generator=g) * 2).to(dtype2)
    l1 = torch.randn(b, h, s, generator=g) * 4
    l2 = torch.randn(b, h, s, generator=g) * 4
    l1[:, :, 0::7] = NEG                 # partial 1 saw no key
    l2[:, :, 3::7] = NEG                 # partial 2 saw no key
    l1[:, :, 5::7] = NEG                 # neither saw a key
    l2[:, :, 5::7] = NEG
    l1[:, :, 6::14] = 200.0              # gaps past fp32's exp range, either way
    l2[:, :, 13::14] = 200.0
    for o, l in ((o1, l1), (o2, l2)):    # a partial without keys has out 0 (as every kernel writes it)
        o.masked_fill_(torch.isneginf(l).transpose(1, 2)[..., None], 0.0)
    return o1, l1, o2, l2


def check(got, inputs, tol=1e-6):
    out, lse = got
    assert out.dtype == lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = merge_fp64(*inputs)
    assert rel_err(lse, ref_lse) <= tol, rel_err(lse, ref_lse)
    assert rel_err(out, ref_out) <= tol, rel_err(out, ref_out)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    o1, l1, o2, l2 = inputs
    one, two = torch.isneginf(l2), torch.isneginf(l1)                 # only partial 1 / only partial 2 counts
    both = one & two
    assert torch.equal(lse[one & ~two], l1[one & ~two]) and torch.equal(lse[two & ~one], l2[two & ~one])
    assert torch.isneginf(lse[both]).all()
    rows = lambda m: m.transpose(1, 2)  # noqa: E731  [b, h, s] -> [b, s, h]
    assert torch.equal(out[rows(one & ~two)], o1[rows(one & ~two)].float())
    assert torch.equal(out[rows(two & ~one)], o2[rows(two & ~one)].float())
    assert torch.equal(out[rows(both)], torch.zeros_like(out[rows(both)]))


@pytest.mark.parametrize("dtype,dtype2,d,s", [
    (torch.float32, torch.float32, 64, 70),     # a masked tail of rows (BLOCK_S 16)
    (torch.bfloat16, torch.float32, 96, 50),    # FA4's bf16 out with the columns' fp32 out; d padded to 128
    (torch.float16, torch.float16, 64, 40),
])
def test_merge_matches_fp64(dtype, dtype2, d, s):
    inputs = partials(2, s, 3, d, dtype, seed=d + s, dtype2=dtype2)
    check(attention_merge(*inputs), inputs)


def test_merge_reads_strided_inputs():
    """Outputs transposed from ``[b, h, s, d]`` or cut from a wider buffer, LSEs as views of other layouts."""
    b, s, h, d = 2, 33, 3, 64
    o1, l1, o2, l2 = partials(b, s, h, d, torch.bfloat16, seed=5)
    t1 = o1.transpose(1, 2).contiguous().transpose(1, 2)              # [b, s, h, d] view of [b, h, s, d]
    wide = torch.zeros(b, s, h + 2, d, dtype=torch.float32)
    wide[:, :, 1:h + 1] = o2
    t2 = wide[:, :, 1:h + 1]                                          # head stride h + 2, offset
    v1 = l1.transpose(1, 2).contiguous().transpose(1, 2)              # LSE with a strided s
    v2 = torch.cat([l2, l2], -1)[..., s:]                             # an offset view
    assert not any(t.is_contiguous() for t in (t1, t2, v1)) and v2.storage_offset() > 0
    got = attention_merge(t1, v1, t2, v2)
    assert torch.equal(got[0], attention_merge(o1, l1, o2.float(), l2)[0])
    check(got, (o1, l1, o2.float(), l2))


def test_merge_negative_control():
    """Swapping the LSEs of the partials (or merging a partial with itself) is seen."""
    inputs = partials(1, 64, 2, 64, torch.float32, seed=9)
    o1, l1, o2, l2 = inputs
    ref = merge_fp64(*inputs)
    swapped = attention_merge(o1, l2, o2, l1)
    assert rel_err(swapped[0], ref[0]) > 1e-2
    same = attention_merge(o1, l1, o1, l1)
    assert rel_err(same[0], ref[0]) > 1e-2


def test_merge_refuses_what_it_cannot_index():
    """By rule and without computing: ``b * h >= 65536`` (the grid), element offsets >= 2**31 (int32), others."""
    meta = dict(device="meta")
    o = torch.empty(1, 8, 65536, 64, dtype=torch.bfloat16, **meta)
    lse = torch.empty(1, 65536, 8, **meta)
    with pytest.raises(ValueError, match="b \\* h = 65536 must be below 65536"):
        attention_merge(o, lse, o, lse)
    o = torch.empty(2, 2 ** 16 + 1, 128, 128, dtype=torch.bfloat16, **meta)         # offsets up to 2**31 + 32767
    lse = torch.empty(2, 128, 2 ** 16 + 1, **meta)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        attention_merge(o, lse, o, lse)
    o = torch.empty(2, 2 ** 16, 128, 128, dtype=torch.bfloat16, **meta)             # the last offset 2**31 - 1
    lse = torch.empty(2, 128, 2 ** 16, **meta)
    assert merge_unsupported(o, lse, o, lse) is None
    small = torch.empty(1, 4, 2, 64, **meta)
    far = torch.empty(1, 2, 4, **meta).as_strided((1, 2, 4), (0, 2 ** 31, 1))      # an LSE view reaching 2**31
    with pytest.raises(ValueError, match="2\\*\\*31"):
        attention_merge(small, far, small, torch.empty(1, 2, 4, **meta))
    assert merge_unsupported(small, torch.empty(1, 2, 4, **meta), small, torch.empty(1, 2, 4, **meta)) is None
    cpu = partials(1, 8, 2, 64, torch.float32, seed=1)
    cases = (((cpu[0].double(), cpu[1], cpu[2], cpu[3]), "bf16, fp16 or fp32"),
             ((cpu[0], cpu[1].double(), cpu[2], cpu[3]), "must be fp32"),
             ((cpu[0], cpu[1], cpu[2][..., :32], cpu[3]), "must both be"),
             ((cpu[0], cpu[1][:, :1], cpu[2], cpu[3]), "must be \\[b, h, s\\]"),
             ((torch.empty(1, 8, 2, 128)[..., ::2], cpu[1], cpu[2], cpu[3]), "unit stride"))
    for args, rule in cases:
        with pytest.raises(ValueError, match=rule):
            attention_merge(*args)


def test_merge_attention_fast_keeps_torch_off_cuda():
    """The one place that picks the kernel keeps the torch merge for CPU tensors (interpreter or not): bitwise
    merge_attention, also with the FA4 step's bf16 out and fp32 columns out."""
    inputs = partials(1, 64, 2, 64, torch.bfloat16, seed=3)
    got, want = merge_attention_fast(*inputs), merge_attention(*inputs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


def test_merge_kernel_compiles_for_sm90():
    """The interpreter does not compile: the real Triton compiler builds the merge kernel for sm_90 (bf16 / fp16 /
    fp32 partials with an fp32 one, bf16 with bf16; head_dim 64, 96, 128) in a subprocess without
    TRITON_INTERPRET (tests/workers/merge_aot.py), no GPU needed; no variant spills registers."""
    out = run_aot_worker("merge_aot.py")
    lines = [x for x in out.splitlines() if "STACK:" in x]
    assert all("STACK:0 " in x for x in lines), out
