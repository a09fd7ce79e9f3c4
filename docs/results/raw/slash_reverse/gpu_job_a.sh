# job a: 32K profile on 330589a, then with the conversion files of faa0377 (the bench, the GPU conversion tests, the profile)
[ -d /tmp/site/liger_kernel ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
P32="timeout 95 python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 2 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 90"
$P32 --json $OUT/a_p_main_32k.json > $OUT/a_p_main_32k.log 2>&1; grep "^\* " $OUT/a_p_main_32k.log
for f in megatron_mtraining/patterns/convert.py megatron_mtraining/patterns/triton/convert.py megatron_mtraining/patterns/estimator.py; do git show faa0377:$f > $f; done  # the three files of faa0377 (merged in 4046a13)
timeout 100 python3 docs/results/raw/slash_reverse/bench_convert.py $OUT/bench_convert.json > $OUT/bench_convert.log 2>&1; tail -16 $OUT/bench_convert.log
timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_gpu_convert.py -p no:cacheprovider > $OUT/gpu_convert_branch.log 2>&1; tail -2 $OUT/gpu_convert_branch.log
$P32 --json $OUT/a_p_branch_32k.json > $OUT/a_p_branch_32k.log 2>&1; grep "^\* " $OUT/a_p_branch_32k.log
git checkout -q -- megatron_mtraining
python3 -c "
import json
for f in ('a_p_main_32k','a_p_branch_32k'):
    try: r=json.load(open('$OUT/'+f+'.json'))['runs']['mtraining']
    except Exception as e: print(f, e); continue
    o=r['overhead']; g=o['regions']
    print(f, {k.split('.')[-1]: round(g[k],2) for k in g if 'estimator' in k or k in ('mtraining.convert','mtraining.plan')}, 'overhead', round(o['overhead_ms'],2), round(100*o['share'],2), '%', 'step', round(r['step_s'],3), 'loss', r['lm_loss'])"
echo "elapsed $SECONDS"
