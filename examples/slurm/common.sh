# Shared by examples/slurm/*.sbatch (sourced; not a job script). Builds the folders, the
# rendezvous variables and the pretrain_gpt.py command line (Megatron-LM flag names) from
# environment variables, launches it, and requeues the job when the run stopped early.
# Every variable below can be set when calling sbatch (sbatch exports the caller's environment
# to the job by default).
#
#   MTRAINING_REPO     repository root (default: the directory sbatch was called from)
#   PYTHON             interpreter (default: $MTRAINING_REPO/.venv/bin/python if present, else python)
#   PRETRAIN           training script (default: examples/pretrain_gpt.py; a patched Megatron-LM
#                      pretrain_gpt.py takes the same flags, see patches/)
#   MTRAINING_CPU=1    CPU mode: gloo, no GPUs, tiny model, 3 iterations (smoke test of the launch)
#   DATA_PREFIX        indexed dataset prefix (.bin/.idx)     } both required; examples/run_demo.sh
#   TOKENIZER_MODEL    sentencepiece model of that dataset    } prepares them
#   MODEL              tiny | qwen2.5-0.5b | qwen2.5-3b (default: qwen2.5-3b on GPUs, tiny on CPU)
#   GPUS_PER_NODE      ranks per node (default: from the allocation: SLURM_GPUS_ON_NODE, else
#                      SLURM_GPUS_PER_NODE, else SLURM_NTASKS_PER_NODE; CPU mode: the tasks per node)
#   TP, CP             tensor / context parallel sizes (default TP=1, CP = all ranks / TP, DP = 1)
#   SEQ_LENGTH, TRAIN_ITERS, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, LR, SAVE_INTERVAL
#   CP_ATTENTION       mtraining (default) | te
#   MTRAINING_CONFIG   configs/*.yaml for the CP attention (passed as --mtraining-config when the
#                      training script has it, else translated to --cp-layout/--cp-granularity)
#   HIERARCHICAL_CP    auto (default) | 1 | 0. auto: --hierarchical-context-parallel-sizes INNER OUTER
#                      exactly when MTRAINING_CONFIG has implementation: hierarchical, with the
#                      config's sizes or, when it has none, INNER = GPUS_PER_NODE / TP (a node) and
#                      OUTER = CP / INNER (across nodes). 1 without a config: the dense hierarchical
#                      ring with those sizes. 0: never (an error with a hierarchical config).
#   OUTPUT_DIR         where runs go (default: $SCRATCH/mtraining-runs, or $HOME/mtraining-runs
#                      without SCRATCH); never inside the repository unless you set it so
#   RUN_NAME           the run's folder name (default: the job name, sbatch -J NAME). The folder
#                      does not hold the job id: a requeued, resubmitted or chained job with the same
#                      name continues the same run.
#   RUN_DIR            run folder (default: OUTPUT_DIR/RUN_NAME); logs in RUN_DIR/logs,
#                      checkpoints in CKPT_DIR (default RUN_DIR/checkpoints). --load CKPT_DIR is
#                      passed whenever CKPT_DIR holds a checkpoint (latest_checkpointed_iteration.txt).
#   EXIT_MARGIN_MINS   minutes kept free before the job's time limit (default 10): the run gets
#                      --exit-duration-in-mins = time left at the start - EXIT_MARGIN_MINS, then saves
#   EXIT_DURATION_MINS explicit --exit-duration-in-mins (0: none); overrides the time-limit rule
#   EXIT_SIGNAL        signal the ranks save and exit on (--exit-signal-handler --exit-signal;
#                      default SIGUSR1, what the scripts' #SBATCH --signal=USR1@120 sends)
#   AUTO_REQUEUE       1 (default) | 0: after a clean exit before TRAIN_ITERS that made progress,
#                      `scontrol requeue` the job (same job id, same RUN_DIR: it resumes). Use 0
#                      with `sbatch --dependency=singleton` chains.
#   SRUN_EXTRA_ARGS    more srun options (word-split), e.g. "--mpi=pmix --container-image=..."
#   EXTRA_ARGS         more flags for the training script (word-split)
#   DRY_RUN=1          check the training script's arguments as its ranks would (examples/pretrain_gpt.py:
#                      e.g. a SEQ_LENGTH the CP layout cannot split is an error), print the launch
#                      command and exit 0 without starting or creating anything (no run folders)

mt_die() { echo "mtraining sbatch: error: $*" >&2; exit 1; }
mt_log() { echo "mtraining sbatch: $*"; }

# "D-HH:MM:SS", "HH:MM:SS", "MM:SS", "D-HH", "D-HH:MM" (squeue %L, sbatch --time) -> whole minutes
# (rounded down); prints nothing for UNLIMITED / NOT_SET / anything else.
mt_minutes() {
  local t=$1 d=0 h=0 m=0 s=0 rest
  [[ $t =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] || return 0
  if [[ $t == *-* ]]; then
    d=${t%%-*}; rest=${t#*-}
    IFS=: read -r h m s <<<"$rest"
  else
    local a b c
    IFS=: read -r a b c <<<"$t"
    if [ -n "$c" ]; then h=$a; m=$b; s=$c; elif [ -n "$b" ]; then m=$a; s=$b; else m=$a; fi
  fi
  echo $(( (10#$d * 86400 + 10#${h:-0} * 3600 + 10#${m:-0} * 60 + 10#${s:-0}) / 60 ))
}

# Minutes left before the job's time limit (nothing when unknown or unlimited).
mt_job_minutes_left() {
  if [ -n "${SLURM_JOB_END_TIME:-}" ]; then      # newer Slurm: the end time in epoch seconds
    echo $(( (SLURM_JOB_END_TIME - $(date +%s)) / 60 ))
    return 0
  fi
  [ -n "${SLURM_JOB_ID:-}" ] || return 0
  command -v squeue >/dev/null || return 0
  mt_minutes "$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n 1 | tr -d ' ')"
}

# Ranks per node from the allocation (GPU mode): GPUS_PER_NODE, SLURM_GPUS_ON_NODE,
# SLURM_GPUS_PER_NODE ("4" or "h100:4"), then the fallback given as $1.
mt_gpus_per_node() {
  local n=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  if [ -z "$n" ] && [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then n=${SLURM_GPUS_PER_NODE##*:}; fi
  [ -n "$n" ] || n=$1
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || mt_die "cannot tell the GPUs per node ('$n'): set GPUS_PER_NODE"
  echo "$n"
}

# Folders, interpreter, mode, rendezvous, resume. Arg: processes per node (ranks started on each node).
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

  # Outputs: a stable folder per run name (no job id in it), outside the repository by default.
  if [ -z "${RUN_DIR:-}" ]; then
    if [ -z "${OUTPUT_DIR:-}" ]; then
      if [ -n "${SCRATCH:-}" ]; then OUTPUT_DIR=$SCRATCH/mtraining-runs; else OUTPUT_DIR=${HOME:?}/mtraining-runs; fi
      mt_log "OUTPUT_DIR not set: runs go to $OUTPUT_DIR (set OUTPUT_DIR to choose)"
    fi
    RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-mtraining}}
    [[ $RUN_NAME =~ ^[A-Za-z0-9._+-]+$ ]] || mt_die "RUN_NAME='$RUN_NAME': use letters, digits and . _ + - only"
    RUN_DIR=$OUTPUT_DIR/$RUN_NAME
  fi
  LOG_DIR=$RUN_DIR/logs
  CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
  if [ "${DRY_RUN:-0}" = 1 ]; then
    mt_log "nothing is created in a dry run (a run creates $LOG_DIR and $CKPT_DIR)"
  else
    mkdir -p "$LOG_DIR" "$CKPT_DIR" || mt_die "cannot create $LOG_DIR / $CKPT_DIR"
  fi
  RESUME_ITER=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || true)

  # Rendezvous: rank 0 runs on the first node of the allocation.
  if [ -z "${MASTER_ADDR:-}" ]; then
    [ -n "${SLURM_JOB_NODELIST:-}" ] || mt_die "SLURM_JOB_NODELIST is not set: submit with sbatch (or set MASTER_ADDR)"
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
  fi
  # Per job (jobs may share a node), in 15000-29999: below Linux's ephemeral range (32768-60999),
  # where an outgoing connection could already hold the port.
  MASTER_PORT=${MASTER_PORT:-$((15000 + ${SLURM_JOB_ID:-0} % 15000))}
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
  mt_log "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on $NUM_NODES node(s)" \
         "[${SLURM_JOB_NODELIST:-?}] x $GPUS_PER_NODE ranks: world $WORLD = TP $TP x CP $CP x DP $DP," \
         "backend $BACKEND, master $MASTER_ADDR:$MASTER_PORT"
  mt_log "run dir $RUN_DIR (logs $LOG_DIR, checkpoints $CKPT_DIR)"
  if [ -n "$RESUME_ITER" ]; then
    mt_log "resuming: $CKPT_DIR holds a checkpoint (latest_checkpointed_iteration.txt: $RESUME_ITER); --load $CKPT_DIR"
  else
    mt_log "no checkpoint in $CKPT_DIR: starting from scratch"
  fi
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
      # 256 tokens, or the smallest multiple of CP x 64 above it (64-token stripes and zigzag split it)
      : "${SEQ_LENGTH:=$(( (256 + 64 * CP - 1) / (64 * CP) * 64 * CP ))}" ;;
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
        --lr-warmup-iters "$([ "$cpu" = 1 ] && echo 0 || echo $(( TRAIN_ITERS > 20 ? 20 : TRAIN_ITERS - 1 )))" --clip-grad 1.0 --weight-decay 0.1
        --data-path "$DATA_PREFIX" --split 90,10,0 --tokenizer-type SentencePieceTokenizer
        --tokenizer-model "$TOKENIZER_MODEL" --no-create-attention-mask-in-dataloader
        --calculate-per-token-loss
        --save "$CKPT_DIR" --ckpt-format torch_dist --log-interval 1)
  if [ "$cpu" = 1 ]; then
    ARGS+=(--eval-iters 0)
    [ -z "${SAVE_INTERVAL:-}" ] || ARGS+=(--save-interval "$SAVE_INTERVAL")
  else
    ARGS+=(--bf16 --eval-interval 200 --eval-iters 2 --save-interval "${SAVE_INTERVAL:-200}")
  fi
  [ -z "$RESUME_ITER" ] || ARGS+=(--load "$CKPT_DIR")

  # Time limit and signals: stop (and save) before Slurm's SIGTERM/SIGKILL at the time limit, and
  # on EXIT_SIGNAL (Slurm's --signal=USR1@SECONDS, preemption, scancel --signal=USR1).
  local left exit_mins=${EXIT_DURATION_MINS:-}
  if [ -z "$exit_mins" ]; then
    left=$(mt_job_minutes_left)
    if [ -n "$left" ]; then
      exit_mins=$((left - ${EXIT_MARGIN_MINS:-10}))
      [ "$exit_mins" -ge 1 ] || mt_die "the job has $left min left; with EXIT_MARGIN_MINS=${EXIT_MARGIN_MINS:-10}" \
                                       "nothing is left to train (ask for a longer time limit or a smaller margin)"
      mt_log "time limit: $left min left; --exit-duration-in-mins $exit_mins (EXIT_MARGIN_MINS=${EXIT_MARGIN_MINS:-10})"
    else
      exit_mins=0
      mt_log "no time limit known (unlimited, or not in a Slurm job): no --exit-duration-in-mins"
    fi
  fi
  [[ $exit_mins =~ ^[0-9]+$ ]] || mt_die "EXIT_DURATION_MINS='$exit_mins': expected whole minutes"
  [ "$exit_mins" = 0 ] || ARGS+=(--exit-duration-in-mins "$exit_mins")   # Megatron-LM: an int
  EXIT_SIGNAL=${EXIT_SIGNAL:-SIGUSR1}
  case "$EXIT_SIGNAL" in
    SIGTERM|SIGINT|SIGUSR1|SIGUSR2) ;;
    *) mt_die "EXIT_SIGNAL=$EXIT_SIGNAL: expected SIGTERM, SIGINT, SIGUSR1 or SIGUSR2" ;;
  esac
  if mt_has_flag --exit-signal-handler && mt_has_flag "--exit-signal "; then
    ARGS+=(--exit-signal-handler --exit-signal "$EXIT_SIGNAL")
  elif mt_has_flag --exit-signal-handler && [ "$EXIT_SIGNAL" = SIGTERM ]; then
    ARGS+=(--exit-signal-handler)
  else
    EXIT_SIGNAL=""
    mt_log "$PRETRAIN has no --exit-signal-handler/--exit-signal: a signal ends the run without a save"
  fi

  # CP attention config.
  local impl="" cfg_sizes=""
  if [ -n "${MTRAINING_CONFIG:-}" ]; then
    local desc
    # validated (the error names the key), then the implementation and the config's own hierarchical
    # sizes (none: taken from the node layout)
    desc=$("$PYTHON" -c 'import sys
from megatron_mtraining.config import load_mtraining_config
try:
    c = load_mtraining_config(sys.argv[1])
except (OSError, ValueError) as e:
    sys.exit(f"error: {e}")
print(c.implementation, *(c.hierarchical.sizes or ()))' "$MTRAINING_CONFIG") || mt_die "bad MTRAINING_CONFIG=$MTRAINING_CONFIG"
    read -r impl cfg_sizes <<<"$desc"
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

  # Hierarchical CP from the config (implementation: hierarchical), never from the node count: a
  # flat config on many nodes is a flat ring, and the flag would contradict it. Sizes: the config's,
  # else the node layout: inner ring = the ranks of one node's CP slice (GPUS_PER_NODE / TP), outer
  # ring = across nodes (CP / inner). Megatron's level-0 groups are consecutive CP ranks, which lie
  # on one node because torchrun/srun number ranks node by node.
  local want=${HIERARCHICAL_CP:-auto} hier=0
  case "$want" in auto|0|1) ;; *) mt_die "HIERARCHICAL_CP=$want: expected auto, 1 or 0" ;; esac
  if [ "$impl" = hierarchical ]; then
    [ "$want" != 0 ] || mt_die "HIERARCHICAL_CP=0 but $MTRAINING_CONFIG has implementation: hierarchical"
    hier=1
  elif [ -n "$impl" ]; then
    [ "$want" != 1 ] || mt_die "HIERARCHICAL_CP=1 but $MTRAINING_CONFIG has implementation: $impl (a flat ring);" \
                               "use a config with implementation: hierarchical"
  elif [ "$want" = 1 ]; then
    hier=1                          # no config: the dense hierarchical ring
  fi
  if [ "$hier" = 1 ]; then
    if [ -n "$cfg_sizes" ]; then
      read -r HCP_INNER HCP_OUTER <<<"$cfg_sizes"
      [ $((HCP_INNER * HCP_OUTER)) -eq "$CP" ] \
        || mt_die "$MTRAINING_CONFIG: hierarchical inner x outer = $HCP_INNER x $HCP_OUTER != CP=$CP" \
                  "($NUM_NODES node(s) x $GPUS_PER_NODE ranks / TP $TP)"
      [ "$HCP_INNER" -le $((GPUS_PER_NODE / TP)) ] \
        || mt_log "warning: inner ring $HCP_INNER of $MTRAINING_CONFIG spans more than one node" \
                  "($((GPUS_PER_NODE / TP)) CP ranks per node)"
    else
      HCP_INNER=$((GPUS_PER_NODE / TP))
      HCP_OUTER=$((CP / HCP_INNER))
      [ "$HCP_INNER" -ge 2 ] && [ "$HCP_OUTER" -ge 2 ] && [ $((CP % HCP_INNER)) -eq 0 ] \
        || mt_die "hierarchical CP needs inner = GPUS_PER_NODE/TP = $HCP_INNER >= 2 and outer = CP/inner =" \
                  "$HCP_OUTER >= 2 (CP=$CP on $NUM_NODES node(s)); or give hierarchical sizes in the config"
    fi
    mt_has_flag --hierarchical-context-parallel-sizes \
      || mt_die "hierarchical CP but $PRETRAIN has no --hierarchical-context-parallel-sizes"
    ARGS+=(--hierarchical-context-parallel-sizes "$HCP_INNER" "$HCP_OUTER")
    mt_log "hierarchical CP: inner $HCP_INNER (in a node) x outer $HCP_OUTER (across nodes)"
  else
    if [ -n "$impl" ]; then mt_log "flat CP ring ($MTRAINING_CONFIG: implementation $impl)"
    else mt_log "flat CP ring (no MTRAINING_CONFIG)"; fi
  fi
  # shellcheck disable=SC2206
  [ -z "${EXTRA_ARGS:-}" ] || ARGS+=($EXTRA_ARGS)
  # shellcheck disable=SC2206
  SRUN_EXTRA=(${SRUN_EXTRA_ARGS:-})
  mt_log "command: $PYTHON $PRETRAIN ${ARGS[*]}"
}

# DRY_RUN=1: the checks examples/pretrain_gpt.py makes before it starts
# (megatron_mtraining.megatron.args.validate_args, with the launch's world size), so that a dry run
# refuses what the ranks would refuse, e.g. a SEQ_LENGTH the CP layout cannot split. Transformer
# Engine is taken as importable, and outside CPU mode the ranks as on CUDA; on a machine without a GPU,
# with Triton and FlashAttention-4 installed (their dtype, head_dim and length rules checked): the compute
# nodes may have them where the dry run does not. Another
# PRETRAIN (a patched Megatron-LM pretrain_gpt.py) has its own rules: not checked here.
mt_check_args() {
  if ! [ "$PRETRAIN" -ef "$MTRAINING_REPO/examples/pretrain_gpt.py" ]; then
    mt_log "$PRETRAIN is not examples/pretrain_gpt.py: its arguments are not checked in a dry run"
    return 0
  fi
  local err
  err=$("$PYTHON" -c 'import sys
from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args
parser = build_parser()
def refuse(message):
    print(message)
    sys.exit(2)
parser.error = refuse                     # one line (no usage) for the shell to report
args = parser.parse_args(sys.argv[3:])
try:
    validate_args(args, world_size=int(sys.argv[1]), te_importable=True, cuda=sys.argv[2] != "1")
except ArgumentValidationError as e:
    refuse(str(e))' "$WORLD" "$MTRAINING_CPU" "${ARGS[@]}") \
    || mt_die "$(basename "$PRETRAIN") would refuse this command line (dry run): ${err:-its check failed (see above)}"
  mt_log "the arguments pass the checks of $(basename "$PRETRAIN") (world size $WORLD; dry run)"
}

# Runs the launch command "$@" (srun ...) with its output copied to LOG_DIR/train.log, then
# requeues the job when the run stopped cleanly before TRAIN_ITERS (time limit, signal) and made
# progress. Returns at once when the checkpoint is at TRAIN_ITERS already (a finished run, e.g. the
# last job of a chain). DRY_RUN=1: checks the arguments (mt_check_args), prints the command and returns.
mt_launch() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    mt_check_args
    printf 'mtraining sbatch: dry run:'; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  if [[ ${RESUME_ITER:-} =~ ^[0-9]+$ ]] && [ "$RESUME_ITER" -ge "$TRAIN_ITERS" ]; then
    mt_log "done: $RUN_DIR is at iteration $RESUME_ITER of $TRAIN_ITERS already: nothing to train"
    return 0
  fi
  # A signal meant for the ranks may reach this shell too (scancel -b/-f, --signal=B:...): the
  # ranks save and exit, the shell waits for them instead of dying.
  # shellcheck disable=SC2064
  [ -z "${EXIT_SIGNAL:-}" ] || trap "mt_log 'batch shell got ${EXIT_SIGNAL#SIG}; waiting for the ranks'" "${EXIT_SIGNAL#SIG}"
  local rc
  set +e
  "$@" 2>&1 | tee -a "$LOG_DIR/train.log"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || mt_die "training exited with status $rc (see $LOG_DIR/train.log); not requeued"
  local done_iter
  done_iter=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
  if [[ $done_iter =~ ^[0-9]+$ ]] && [ "$done_iter" -lt "$TRAIN_ITERS" ]; then
    if [ "$done_iter" -le "${RESUME_ITER:-0}" ]; then
      mt_log "stopped at iteration $done_iter of $TRAIN_ITERS without progress in this job: not requeued"
    elif [ "${AUTO_REQUEUE:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
      mt_log "stopped at iteration $done_iter of $TRAIN_ITERS: requeueing job $SLURM_JOB_ID (it resumes from $CKPT_DIR)"
      scontrol requeue "$SLURM_JOB_ID" \
        || mt_log "scontrol requeue failed (job not requeueable?): resubmit with the same RUN_NAME to continue"
    else
      mt_log "stopped at iteration $done_iter of $TRAIN_ITERS: submit again with the same RUN_NAME to continue"
    fi
  else
    mt_log "done: $RUN_DIR (iteration $done_iter)"
  fi
}
