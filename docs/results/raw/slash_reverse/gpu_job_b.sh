# job b, the same machine: 32K and 128K profiles with the files of faa0377 first, then on 330589a
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P32="timeout 95 python3 tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 2 --warmup 2 --timed 2 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 90"
P128="timeout 130 python3 tools/profile_step.py --shape smollm2-135m --seq-length 131072 --global-batch-size 1 --warmup 2 --timed 2 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 125"
for f in megatron_mtraining/patterns/convert.py megatron_mtraining/patterns/triton/convert.py megatron_mtraining/patterns/estimator.py; do git show faa0377:$f > $f; done  # the three files of faa0377 (merged in 4046a13)
$P32 --json $OUT/b_branch_32k.json > /dev/null 2>&1
$P128 --json $OUT/b_branch_128k.json > /dev/null 2>&1
git checkout -q -- megatron_mtraining
$P32 --json $OUT/b_main_32k.json > /dev/null 2>&1
[ $SECONDS -lt 300 ] && $P128 --json $OUT/b_main_128k.json > /dev/null 2>&1
python3 -c "
import json
for f in ('b_main_32k','b_branch_32k','b_main_128k','b_branch_128k'):
    try: r=json.load(open('$OUT/'+f+'.json'))['runs']['mtraining']
    except Exception as e: print(f, e); continue
    o=r['overhead']; g=o['regions']
    print(f, {k.split('.')[-1]: round(g[k],2) for k in g if 'estimator' in k or k in ('mtraining.convert','mtraining.plan')}, 'overhead', round(o['overhead_ms'],2), round(100*o['share'],2), '%', 'step', round(r['step_s'],3), 'loss', r['lm_loss'])"
echo "elapsed $SECONDS"
