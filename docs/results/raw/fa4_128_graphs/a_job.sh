# after runC (carry .rd/b .e2e/runE2.sh .e2e/rd_stage.sh .e2e/fa4cap.py .e2e/next/long_context_fa4_b128_graphs.yaml):
# real SmolLM2-135M: FA4-128 with CUDA graphs against FA4-128 without (32K: same loss and grad norms), then
# FA4-128 graphs against FA4 dense at 128K and 64K (same tokens per iteration)
source .e2e/rd_stage.sh b || exit 3
[ -d /tmp/site/flash_attn ] || { echo "fa4 missing"; exit 3; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch,triton,megatron.core as m,flash_attn.cute as f; import importlib.metadata as md; print(torch.__version__, triton.__version__, m.__version__, md.version('flash-attn-4'), md.version('liger-kernel'))" | tee -a $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
cp data/long_context_64k/split.json $OUT/corpus_split.json 2>/dev/null
G=.e2e/next/long_context_fa4_b128_graphs.yaml
sed 's/cuda_graphs: true/cuda_graphs: false/' $G > /tmp/fa4b128_eager.yaml
run() {  # tag seq gbs iters mode [config]; tags fa4*g: FA4 sparse steps captured (.e2e/fa4cap.py)
  local tag=$1 seq=$2 gbs=$3 it=$4 mode=$5 cfg=$6 tool=tools/extend_context.py
  case $tag in fa4*g) tool=.e2e/fa4cap.py;; esac
  timeout ${TMO:-150} python3 $tool --mode $mode --seq $seq --train-iters 20 --stop-iter $it --global-batch-size $gbs \
    --data-prefix data/long_context_64k/train_text_document --save-root /tmp/runs/${tag}_$seq ${cfg:+--mtraining-config $cfg} -- --lm-loss liger > $OUT/${tag}_$seq.log 2>&1
  echo "$tag $seq rc=$?"
  grep -h "elapsed time per iteration" $OUT/${tag}_$seq.log | sed -E 's/.*iteration +([0-9]+)\/.*per iteration \(ms\): ([0-9.]+).*lm loss: ([0-9.E+-]+).*grad norm: ([0-9.]+).*/  it \1 \2 ms loss \3 gnorm \4/'
}
TMO=90 run r098g 32768 8 3 mtraining configs/long_context_r098_graphs.yaml
TMO=90 run fa4b128e 32768 8 3 mtraining /tmp/fa4b128_eager.yaml
run fa4b128e 131072 2 3 mtraining /tmp/fa4b128_eager.yaml
run dense 131072 2 3 dense
echo "elapsed $SECONDS s"
if [ $SECONDS -lt ${LIM64:-380} ]; then
TMO=80 run fa4b128e 65536 4 3 mtraining /tmp/fa4b128_eager.yaml
TMO=80 run dense 65536 4 3 dense
fi
ls $OUT
