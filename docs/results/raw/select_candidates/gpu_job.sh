# One job on one GPU: the selection kernel (candidates against passes), its GPU tests, then the 32K profile of
# the tree with the candidate selection and the one-warp column-bits kernel ("after") and of the tree before
# them ("before": the two files of 4073e91 copied over, from before/). Run from the repository root at 14a3dd5 with
# before/select.py and before/launch.py taken from 4073e91 and the megatron-core 0.19.2 wheel in .whl/; writes $OUT.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
R=docs/results/raw/select_candidates
timeout 150 python3 $R/bench_select.py > $OUT/bench_select.jsonl 2>$OUT/bench_select.err
timeout 90 python3 -m pytest -q -m gpu tests/kernels/test_gpu_select.py tests/kernels/test_gpu_kernels.py -k "select or column_plan or diagonal" > $OUT/gpu_tests.log 2>&1
P="python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 3 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 180"
timeout 190 $P --json $OUT/p_after.json > $OUT/p_after.log 2>&1
cp before/select.py megatron_mtraining/patterns/triton/select.py
cp before/launch.py megatron_mtraining/ops/triton/launch.py
timeout 190 $P --json $OUT/p_before.json > $OUT/p_before.log 2>&1
tail -3 $OUT/*.log
