# after rd stage a (carry .rd/b .e2e/n70 .e2e/rd_stage.sh), FA4 installed by n1/n2 on this machine:
# real SmolLM2-135M, configs/long_context_fa4_b128_graphs.yaml against FA4 dense at 64K and 32K (and 128K if time)
source .e2e/rd_stage.sh b || exit 3
[ -d /tmp/site/flash_attn ] || { echo "fa4 missing"; exit 3; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch,triton,megatron.core as m,flash_attn.cute as f; import importlib.metadata as md; print(torch.__version__, triton.__version__, m.__version__, md.version('flash-attn-4'), md.version('liger-kernel'))" | tee -a $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
cp data/long_context_64k/split.json $OUT/corpus_split.json 2>/dev/null
G=configs/long_context_fa4_b128_graphs.yaml
run() {  # tag seq gbs iters mode [config]
  local tag=$1 seq=$2 gbs=$3 it=$4 mode=$5 cfg=$6
  timeout ${TMO:-150} python3 tools/extend_context.py --mode $mode --seq $seq --train-iters 20 --stop-iter $it --global-batch-size $gbs \
    --data-prefix data/long_context_64k/train_text_document --save-root /tmp/runs/${tag}_$seq ${cfg:+--mtraining-config $cfg} -- --lm-loss liger > $OUT/${tag}_$seq.log 2>&1
  echo "$tag $seq rc=$?"
  cp /tmp/runs/${tag}_$seq/*/metrics.jsonl $OUT/${tag}_${seq}_metrics.jsonl 2>/dev/null
  grep -h "elapsed time per iteration" $OUT/${tag}_$seq.log | sed -E 's/.*iteration +([0-9]+)\/.*per iteration \(ms\): ([0-9.]+).*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+).*/  it \1 \2 ms loss \3 gnorm \4/'
}
TMO=110 run fa4b128g 65536 4 5 mtraining $G
TMO=110 run dense 65536 4 5 dense
echo "elapsed $SECONDS s"
if [ $SECONDS -lt ${LIM32:-480} ]; then
TMO=90 run fa4b128g 32768 8 4 mtraining $G
TMO=90 run dense 32768 8 4 dense
fi
ls $OUT
