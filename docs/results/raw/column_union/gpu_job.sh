# One job on one GPU, run from the repository root of the tree at af1e885 (the column union from the
# conversion) with the megatron-core 0.19.2 wheel in .whl/ and, in .e2e/before/, the seven library files
# of 9e0a92f (the column plan building its own union); writes $OUT. The GPU tests, then one layer's
# attention (bench_layer.py) and the 32K iteration profile, each on both trees: after, then before.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gpu_convert.py tests/kernels/test_gpu_graphs.py tests/kernels/test_gpu_kernels.py -x > $OUT/gpu_tests.log 2>&1
B="timeout 70 python3 tools/bench_layer.py --seq-lengths 32768,131072 --modes sparse,graphs --mtraining-config configs/long_context_r098.yaml --inputs random --warmup 3 --repeats 5"
$B --json $OUT/layer_after.json > $OUT/layer_after.log 2>&1
mkdir -p /tmp/kept
for f in $(cd .e2e/before && find . -type f); do mkdir -p /tmp/kept/$(dirname $f); cp $f /tmp/kept/$f; cp .e2e/before/$f $f; done
$B --json $OUT/layer_before.json > $OUT/layer_before.log 2>&1
P="timeout 90 python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 3 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 85"
$P --json $OUT/p_before.json > $OUT/p_before.log 2>&1
for f in $(cd /tmp/kept && find . -type f); do cp /tmp/kept/$f $f; done
$P --json $OUT/p_after.json > $OUT/p_after.log 2>&1
