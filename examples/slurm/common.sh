# Shared by examples/slurm/*.sbatch (sourced; not a job script). Builds the folders, the
# rendezvous variables and the pretrain_gpt.py command line (Megatron-LM flag names) from
# environment variables. Every variable below can be set when calling sbatch (sbatch exports
# the caller's environment to the job by default).
#
#   MTRAINING_REPO     repository root (default: the directory sbatch was called from)
#   PYTHON             interpreter (default: $MTRAINING_REPO/.venv/bin/python if present, else python)
#   PRETRAIN           training script (default: examples/pretrain_gpt.py; a patched Megatron-LM
#                      pretrain_gpt.py takes the same flags, see patches/)
#   MTRAINING_CPU=1    CPU mode: gloo, no GPUs, tiny model, 3 iterations (smoke test of the launch)
#   DATA_PREFIX        indexed dataset prefix (.bin/.idx)     } both required; examples/run_demo.sh
#   TOKENIZER_MODEL    sentencepiece model of that dataset    } prepares them
#   MODEL              tiny | qwen2.5-0.5b | qwen2.5-3b (default: qwen2.5-3b on GPUs, tiny on CPU)
#   TP, CP             tensor / context parallel sizes (default TP=1, CP = all ranks / TP, DP = 1)
#   SEQ_LENGTH, TRAIN_ITERS, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, LR, SAVE_INTERVAL
#   CP_ATTENTION       mtraining (default) | te
#   MTRAINING_CONFIG   configs/*.yaml for the CP attention (passed as --mtraining-config when the
#                      training script has it, else translated to --cp-layout/--cp-granularity)
#   HIERARCHICAL_CP    auto (default) | 1 | 0: pass --hierarchical-context-parallel-sizes INNER OUTER
#                      with INNER = GPUS_PER_NODE / TP (a node) and OUTER = CP / INNER (across nodes)
#   RUN_DIR            run folder (default: $MTRAINING_REPO/runs/<job name>-<job id>); logs in
#                      RUN_DIR/logs, checkpoints in CKPT_DIR (default RUN_DIR/checkpoints)
#   EXTRA_ARGS         more flags for the training script (word-split)

mt_die() { echo "mtraining sbatch: error: $*" >&2; exit 1; }
mt_log() { echo "mtraining sbatch: $*"; }

# Folders, interpreter, mode, rendezvous. Arg: processes per node (ranks started on each node).
mt_init() {
  local per_node=$1
  MTRAINING_REPO=${MTRAINING_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
  cd "$MTRAINING_REPO" || mt_die "cannot cd to MTRAINING_REPO=$MTRAINING_REPO"
  PRETRAIN=${PRETRAIN:-$MTRAINING_REPO/examples/pretrain_gpt.py}
  [ -f "$PRETRAIN" ] || mt_die "$PRETRAIN not found: submit from the repository root or set MTRAINING_REPO"
  if [ -z "${PYTHON:-}" ]; then
    if [ -x "$MTRAINING_REPO/.venv/bin/python" ]; then PYTHON=$MTRAINING_REPO/.venv/bin/python; else PYTHON=python; fi
  fi
  export PYTHONPATH="$MTRAINING_REPO${PYTHONPATH:+:$PYTHONPATH}"
  # shellcheck disable=SC2015  # (A && B) || die is meant: die when either check fails
  [ -n "${DATA_PREFIX:-}" ] && [ -f "$DATA_PREFIX.bin" ] && [ -f "$DATA_PREFIX.idx" ] \
    || mt_die "DATA_PREFIX='${DATA_PREFIX:-}' has no .bin/.idx (examples/run_demo.sh or tools/preprocess_data.py makes them)"
  # shellcheck disable=SC2015
  [ -n "${TOKENIZER_MODEL:-}" ] && [ -f "$TOKENIZER_MODEL" ] || mt_die "TOKENIZER_MODEL='${TOKENIZER_MODEL:-}' not found"

  MTRAINING_CPU=${MTRAINING_CPU:-0}
  NUM_NODES=${SLURM_NNODES:-1}
  GPUS_PER_NODE=$per_node
  WORLD=$((NUM_NODES * GPUS_PER_NODE))
  TP=${TP:-1}
  [ $((GPUS_PER_NODE % TP)) -eq 0 ] || mt_die "TP=$TP must divide the $GPUS_PER_NODE ranks of a node"
  CP=${CP:-$((WORLD / TP))}
  [ $((WORLD % (TP * CP))) -eq 0 ] || mt_die "world $WORLD is not divisible by TP=$TP x CP=$CP"
  DP=$((WORLD / (TP * CP)))

  RUN_DIR=${RUN_DIR:-$MTRAINING_REPO/runs/${SLURM_JOB_NAME:-mtraining}-${SLURM_JOB_ID:-local}}
  LOG_DIR=$RUN_DIR/logs
  CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
  mkdir -p "$LOG_DIR" "$CKPT_DIR"

  # Rendezvous: rank 0 runs on the first node of the allocation.
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  if ! getent hosts "$MASTER_ADDR" >/dev/null 2>&1; then
    # Node names that are not host names (emulated clusters, some sites): use Slurm's NodeAddr.
    local addr
    addr=$(scontrol show node "$MASTER_ADDR" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
    if [ -n "$addr" ]; then
      mt_log "node name $MASTER_ADDR does not resolve; MASTER_ADDR = its NodeAddr $addr"
      MASTER_ADDR=$addr
    fi
  fi
  MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}  # per job: jobs may share a node
  export MASTER_ADDR MASTER_PORT

  if [ "$MTRAINING_CPU" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""   # never touch a GPU, even on a GPU node
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    BACKEND=gloo
  else
    # Megatron: TP/CP comm kernels must be queued in issue order (validate_args checks it pre-Blackwell).
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    # NCCL: async error handling (a dead peer ends the job instead of hanging it), no NVLink
    # SHARP/multicast (as Megatron's CI), warnings only. Site-specific knobs (NCCL_SOCKET_IFNAME,
    # NCCL_IB_HCA, NCCL_IB_SL, ...) are inherited from the caller's environment when set.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
    BACKEND=nccl
  fi
  mt_log "job ${SLURM_JOB_ID:-?} on $NUM_NODES node(s) [$SLURM_JOB_NODELIST] x $GPUS_PER_NODE ranks:" \
         "world $WORLD = TP $TP x CP $CP x DP $DP, backend $BACKEND, master $MASTER_ADDR:$MASTER_PORT"
  mt_log "run dir $RUN_DIR (logs $LOG_DIR, checkpoints $CKPT_DIR)"
}

# Fills the array ARGS with the training script's command line.
mt_build_args() {
  local help model
  help=$("$PYTHON" "$PRETRAIN" --help 2>/dev/null || true)
  mt_has_flag() { grep -q -- "$1" <<<"$help"; }

  model=${MODEL:-$([ "$MTRAINING_CPU" = 1 ] && echo tiny || echo qwen2.5-3b)}
  case "$model" in
    tiny)  # CPU smoke test: a few seconds per iteration on 2 cores
      MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention
                  --num-query-groups 2 --ffn-hidden-size 128 --normalization RMSNorm --swiglu
                  --position-embedding-type rope --disable-bias-linear)
      : "${SEQ_LENGTH:=256}" ;;
    qwen2.5-0.5b)  # Qwen2.5-0.5B shape (random init): 24 layers, 14 q / 2 kv heads, head_dim 64
      MODEL_ARGS=(--num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14
                  --group-query-attention --num-query-groups 2 --kv-channels 64 --normalization RMSNorm
                  --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000
                  --disable-bias-linear)
      : "${SEQ_LENGTH:=131072}" ;;
    qwen2.5-3b)  # Qwen2.5-3B shape (MTraining §5 main run): 36 layers, 16 q / 2 kv heads, head_dim 128
      MODEL_ARGS=(--num-layers 36 --hidden-size 2048 --ffn-hidden-size 11008 --num-attention-heads 16
                  --group-query-attention --num-query-groups 2 --kv-channels 128 --normalization RMSNorm
                  --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000
                  --disable-bias-linear)
      : "${SEQ_LENGTH:=524288}" ;;
    *) mt_die "MODEL=$model: expected tiny, qwen2.5-0.5b or qwen2.5-3b" ;;
  esac

  local cpu=$MTRAINING_CPU
  TRAIN_ITERS=${TRAIN_ITERS:-$([ "$cpu" = 1 ] && echo 3 || echo 1000)}
  LR=${LR:-$([ "$cpu" = 1 ] && echo 1e-3 || echo 1e-5)}
  MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
  GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * DP))}
  # shellcheck disable=SC2054  # --split 90,10,0 is one argument
  ARGS=("${MODEL_ARGS[@]}"
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
        --attention-dropout 0.0 --hidden-dropout 0.0
        --tensor-model-parallel-size "$TP" --context-parallel-size "$CP"
        --cp-attention "${CP_ATTENTION:-mtraining}" --distributed-backend "$BACKEND"
        --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 0.0 --lr-decay-style cosine
        --lr-warmup-iters "$([ "$cpu" = 1 ] && echo 0 || echo 20)" --clip-grad 1.0 --weight-decay 0.1
        --data-path "$DATA_PREFIX" --split 90,10,0 --tokenizer-type SentencePieceTokenizer
        --tokenizer-model "$TOKENIZER_MODEL" --no-create-attention-mask-in-dataloader
        --calculate-per-token-loss
        --save "$CKPT_DIR" --ckpt-format torch_dist --log-interval 1)
  if [ "$cpu" = 1 ]; then
    ARGS+=(--eval-iters 0)                                # save once, at the end
  else
    ARGS+=(--bf16 --eval-interval 200 --eval-iters 2 --save-interval "${SAVE_INTERVAL:-200}" --load "$CKPT_DIR")
  fi

  # CP attention config.
  if [ -n "${MTRAINING_CONFIG:-}" ]; then
    "$PYTHON" -m megatron_mtraining.config "$MTRAINING_CONFIG" >/dev/null || mt_die "bad MTRAINING_CONFIG"
    if mt_has_flag --mtraining-config; then
      ARGS+=(--mtraining-config "$MTRAINING_CONFIG")
    else
      local flags
      flags=$("$PYTHON" -m megatron_mtraining.config --pretrain-flags "$MTRAINING_CONFIG") \
        || mt_die "$PRETRAIN has no --mtraining-config flag and cannot express $MTRAINING_CONFIG"
      mt_log "$PRETRAIN has no --mtraining-config; using the equivalent flags: $flags"
      # shellcheck disable=SC2206
      ARGS+=($flags)
    fi
  fi

  # Hierarchical CP from the node layout: inner ring = the ranks of one node's CP slice
  # (GPUS_PER_NODE / TP), outer ring = across nodes (CP / inner). Megatron's level-0 groups are
  # consecutive CP ranks, which lie on one node because torchrun/srun number ranks node by node.
  HCP_INNER=$((GPUS_PER_NODE / TP))
  HCP_OUTER=$((CP / HCP_INNER))
  local want=${HIERARCHICAL_CP:-auto}
  if [ "$want" != 0 ] && [ "$HCP_INNER" -ge 2 ] && [ "$HCP_OUTER" -ge 2 ] && [ $((CP % HCP_INNER)) -eq 0 ]; then
    if mt_has_flag --hierarchical-context-parallel-sizes; then
      ARGS+=(--hierarchical-context-parallel-sizes "$HCP_INNER" "$HCP_OUTER")
      mt_log "hierarchical CP: inner $HCP_INNER (in a node) x outer $HCP_OUTER (across nodes)"
    elif [ "$want" = 1 ]; then
      mt_die "HIERARCHICAL_CP=1 but $PRETRAIN has no --hierarchical-context-parallel-sizes"
    else
      mt_log "hierarchical CP sizes would be $HCP_INNER x $HCP_OUTER, but $PRETRAIN has no" \
             "--hierarchical-context-parallel-sizes: flat CP ring"
    fi
  elif [ "$want" = 1 ]; then
    mt_die "HIERARCHICAL_CP=1 needs inner = GPUS_PER_NODE/TP = $HCP_INNER >= 2 and outer = CP/inner = $HCP_OUTER >= 2"
  fi
  # shellcheck disable=SC2206
  [ -n "${EXTRA_ARGS:-}" ] && ARGS+=($EXTRA_ARGS)
  mt_log "command: $PYTHON $PRETRAIN ${ARGS[*]}"
}
