# one call, no FA4 (carry .whl .e2e): the selection kernels (main lockstep; radix 6-bit with register bisection;
# radix with register histograms at 6 and 8 bits), then the 32K iteration profile with the fastest radix vs main
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
cp .e2e/select_radix.py megatron_mtraining/patterns/triton/select_radix.py
cp .e2e/select_radix_bis.py megatron_mtraining/patterns/triton/select_radix_bis.py
timeout 90 python3 .e2e/bench_radix.py > $OUT/bench_radix.jsonl 2> $OUT/bench_radix.err
cut -c1-150 $OUT/bench_radix.jsonl; tail -3 $OUT/bench_radix.err
P="timeout 95 python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 3 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 90"
cp megatron_mtraining/patterns/triton/select.py /tmp/select_main.py
cp .e2e/select_radix.py megatron_mtraining/patterns/triton/select.py
timeout 40 python3 -m pytest -q -m gpu tests/kernels/test_gpu_select.py -p no:cacheprovider > $OUT/gpu_select_radix.log 2>&1; tail -2 $OUT/gpu_select_radix.log
$P --json $OUT/p_radix.json > $OUT/p_radix.log 2>&1; grep "^\* " $OUT/p_radix.log
cp /tmp/select_main.py megatron_mtraining/patterns/triton/select.py
$P --json $OUT/p_main.json > $OUT/p_main.log 2>&1; grep "^\* " $OUT/p_main.log
python3 -c "
import json
for f in ('p_radix','p_main'):
    r=json.load(open('$OUT/'+f+'.json'))['runs']['mtraining']; o=r['overhead']
    print(f, 'selection', round(o['regions']['mtraining.estimator.selection'],2), 'overhead', round(o['overhead_ms'],2), round(100*o['share'],2), '%')"
