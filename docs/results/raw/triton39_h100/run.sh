#!/usr/bin/env bash
# Triton 3.6 (installed with torch 2.11) against Triton 3.9.0 on the sparse kernels, 128K, 95 %, one job on one GPU;
# then the unmasked loops warp-specialized under 3.9. $OUT: the output directory. /tmp/t39: the
# triton-3.9.0-cp312 wheel unpacked there (python -m zipfile -e triton-3.9.0-*.whl /tmp/t39) without its AMD backend
# and its ptxas-blackwell (hence TRITON_BACKENDS_IN_TREE=1 and TRITON_PTXAS_BLACKWELL_PATH below).
nvidia-smi --query-gpu=name --format=csv,noheader; /tmp/t39/triton/backends/nvidia/bin/ptxas --version | tail -1
b="--seqs 131072 --sparsity 0.95 --impls ours --budget 0.5"
run() { local tag=$1; shift; local t0=$SECONDS; timeout 75 python tools/bench_attention.py --json $OUT/$tag.json $b "$@" > $OUT/$tag.log 2>&1; echo "$tag rc=$? $((SECONDS-t0))s"; grep -E "ours" $OUT/$tag.log | tail -4 | cut -c1-220; }
export PYTHONPATH=$PWD; unset TRITON_BACKENDS_IN_TREE TRITON_PTXAS_BLACKWELL_PATH
run b36_64 --head-dims 64 --heads 9 --kv-heads 3
export PYTHONPATH=/tmp/t39:$PWD TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/tmp/t39/triton/backends/nvidia/bin/ptxas
python -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
run b39_64 --head-dims 64 --heads 9 --kv-heads 3
export PYTHONPATH=$PWD; unset TRITON_BACKENDS_IN_TREE TRITON_PTXAS_BLACKWELL_PATH
run b36_128 --head-dims 128 --heads 16 --kv-heads 2
export PYTHONPATH=/tmp/t39:$PWD TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/tmp/t39/triton/backends/nvidia/bin/ptxas
run b39_128 --head-dims 128 --heads 16 --kv-heads 2
timeout 60 python -m pytest -m gpu tests/kernels/test_gpu_kernels.py -k "test_kernel_case_on_gpu and (vs4k-90-d128 or vs4k-90-d64)" -q -p no:cacheprovider 2>&1 | tail -3
mkdir -p /tmp/ws && cp -r megatron_mtraining tools /tmp/ws/ && cd /tmp/ws
sed -i 's/for i in range(0, split):/for i in tl.range(0, split, warp_specialize=True):/; s/for e in range(start, mid):          # tiles/for e in tl.range(start, mid, warp_specialize=True):          # tiles/' megatron_mtraining/ops/triton/kernels.py
grep -c "warp_specialize=True" megatron_mtraining/ops/triton/kernels.py
export PYTHONPATH=/tmp/t39:/tmp/ws TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/tmp/t39/triton/backends/nvidia/bin/ptxas
run ws39_64 --head-dims 64 --heads 9 --kv-heads 3
