# one call, no FA4: 128K profile main vs the convert-fuse files, then GPU tests of main's graphs (non-FA4)
set -x
[ -d /tmp/site/liger_kernel ] || exit 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
P="timeout 130 python3 tools/profile_step.py --shape smollm2-135m --seq-length 131072 --global-batch-size 1 --warmup 2 --timed 2 --active 1 --kernels 40 --modes mtraining --mtraining-config configs/long_context_r098.yaml --run-timeout 125"
$P --json $OUT/p_main.json > $OUT/p_main.log 2>&1; grep "^\* " $OUT/p_main.log
cp .e2e/n70/convert_branch.py megatron_mtraining/patterns/convert.py; cp .e2e/n70/triton_convert_branch.py megatron_mtraining/patterns/triton/convert.py
cp .e2e/n70/launch_branch.py megatron_mtraining/ops/triton/launch.py; cp .e2e/n70/kernels_branch.py megatron_mtraining/ops/triton/kernels.py; cp .e2e/n70/estimator_branch.py megatron_mtraining/patterns/estimator.py
$P --json $OUT/p_branch.json > $OUT/p_branch.log 2>&1; grep "^\* " $OUT/p_branch.log
git checkout -q -- megatron_mtraining
python3 -c "
import json
for f in ('p_main','p_branch'):
    r=json.load(open('$OUT/'+f+'.json'))['runs']['mtraining']; o=r['overhead']; g=o['regions']
    print(f, {k.split('.')[-1]: round(g[k],2) for k in g if 'estimator' in k or k in ('mtraining.convert','mtraining.plan')}, 'overhead', round(o['overhead_ms'],2), round(100*o['share'],2), '%', 'step', round(r['step_s'],3), 'loss', r['lm_loss'])"
