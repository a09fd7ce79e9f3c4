# Second job, the tree as kept (the selection kernel of 4073e91, the one-warp column-bits kernel): the 32K profile
# of the tree before the bits change (launch.py of 4073e91 copied over from before/), then of the kept tree.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P="python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 3 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 180"
cp megatron_mtraining/ops/triton/launch.py /tmp/launch_kept.py
cp before/launch.py megatron_mtraining/ops/triton/launch.py
timeout 190 $P --json $OUT/p2_before.json > $OUT/p2_before.log 2>&1
cp /tmp/launch_kept.py megatron_mtraining/ops/triton/launch.py
timeout 190 $P --json $OUT/p2_kept.json > $OUT/p2_kept.log 2>&1
grep -h "step\|overhead" $OUT/p2_*.log | tail -8
