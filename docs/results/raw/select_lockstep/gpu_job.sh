# One job on one GPU, run from the repository root of the tree with the lockstep selection (LOCKSTEP) and the
# one-warp column-bits kernel, with before/select.py and before/launch.py taken from 4073e91 and the
# megatron-core 0.19.2 wheel in .whl/; writes $OUT. The kernel benchmark and GPU tests, then the 32K profile of
# two trees: both files of 4073e91 ("before") and the tree as it is ("lockstep").
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
R=docs/results/raw/select_lockstep
timeout 120 python3 $R/bench_lockstep.py > $OUT/bench_lockstep.jsonl 2>$OUT/bench_lockstep.err
timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_gpu_select.py tests/kernels/test_gpu_kernels.py -k "select or column_plan" > $OUT/gpu_tests.log 2>&1
P="python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 3 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 180"
cp megatron_mtraining/patterns/triton/select.py /tmp/select_kept.py
cp megatron_mtraining/ops/triton/launch.py /tmp/launch_kept.py
cp before/select.py megatron_mtraining/patterns/triton/select.py
cp before/launch.py megatron_mtraining/ops/triton/launch.py
timeout 120 $P --json $OUT/p_before.json > $OUT/p_before.log 2>&1
cp /tmp/launch_kept.py megatron_mtraining/ops/triton/launch.py
cp /tmp/select_kept.py megatron_mtraining/patterns/triton/select.py
timeout 120 $P --json $OUT/p_lockstep.json > $OUT/p_lockstep.log 2>&1
tail -n 3 $OUT/gpu_tests.log
