# One H100. before = a checkout of a698006; after = `git archive 0f59afc` unpacked in ./after beside it (PYTHONPATH puts
# it first). Both read configs/long_context_fa4_b128_graphs.yaml of the checkout (the file is the same in both commits).
prof() {  # tree seq out
  tree=.; [ $1 = after ] && tree=after
  PYTHONPATH=$PWD/$tree:$PYTHONPATH python3 $tree/tools/profile_step.py --shape smollm2-135m --seq-length $2 \
    --global-batch-size 2 --modes mtraining --warmup 2 --timed ${TIMED} --active 1 --kernels 30 \
    --mtraining-config configs/long_context_fa4_b128_graphs.yaml --json $3 -- --lm-loss liger
}
(cd after && python3 -m pytest -q -m gpu tests/kernels/test_gpu_graphs.py tests/kernels/test_gpu_convert.py tests/unit/test_host_syncs.py)
(cd after && python3 -m pytest -q -m gpu tests/kernels/test_gpu_merge.py tests/kernels/test_fa4_ring_steps.py tests/kernels/test_gpu_graphs.py)
TIMED=4 prof after 65536 r1_after_64k.json;  TIMED=4 prof before 65536 r1_before_64k.json
TIMED=6 prof after 32768 r2_after_32k.json;  TIMED=6 prof before 32768 r2_before_32k.json
(cd after && python3 -m pytest -q -m gpu tests/kernels/test_gpu_merge.py tests/kernels/test_gpu_column_phase.py)
(cd after && python3 -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py)
TIMED=4 prof before 65536 r3_before_64k.json; TIMED=4 prof after 65536 r3_after_64k.json
