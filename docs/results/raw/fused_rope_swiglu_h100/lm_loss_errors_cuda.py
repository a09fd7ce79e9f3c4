"""bf16 LM-head losses against fp64 on CUDA at 32K tokens of SmolLM2-135M's head, with the helpers of
tests/integration/test_lm_loss.py (the inputs of test_lm_losses_bf16_gpu). Run from the repository root:
PYTHONPATH=$PWD python docs/results/raw/fused_rope_swiglu_h100/lm_loss_errors_cuda.py"""
from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches
from tests.helpers.dist import one_rank_megatron
from tests.integration.test_lm_loss import _bf16_errors, _chunks_summed_in_bf16, chunked_lm_loss, fused_lm_loss

apply_cpu_patches()
with one_rank_megatron('gloo'):
    ref, got = _bf16_errors('cuda', {'fused': fused_lm_loss, 'chunked': lambda h, w, y: chunked_lm_loss(h, w, y, 1024),
                                     'bf16 sum': lambda h, w, y: _chunks_summed_in_bf16(h, w, y, 1024)}, 32768, 576, 49152)
    print('ref', ref)
    [print(k, v) for k, v in got.items()]
