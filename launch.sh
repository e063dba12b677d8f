#!/usr/bin/env bash
# launch.sh: the whole system on one node: executor, reference server, N gen workers, learner.
#
#   ./launch.sh --config configs/cpu_demo.yaml [--workers N] [--run-dir DIR] [--set k=v ...]
#               [--ref-gpu 0] [--worker-gpus 1,2,3] [--learner-gpus 4,5,6,7] [--share-gpus]
#               [--nnodes N --node-rank R --master-addr NODE0 [--master-port P]] [--resume] [--dry-run]
#
# Learner ranks on several nodes: run launch.sh on each learner node with the same config, the
# same --run-dir on a filesystem they all mount at the same path (checkpoints, tokens.env), and
# --nnodes N --node-rank R --master-addr NODE0 (node 0's address, which every node must reach on
# --master-port, default ref_server.port + 1000, and on ref_server.port). Node rank 0 runs the whole
# system and its learner ranks; node rank R > 0 runs only its learner ranks (log
# RUN_DIR/logs/learner_nodeR.log), with node 0's reference server and tokens. The learner ranks of
# every node start under torchrun (--nnodes/--node_rank/--master_addr: no hostfile, no ssh); one
# rank per learner GPU, or one on a CPU. Without --nnodes: deepspeed on GPUs; on a CPU one rank as itself.
#
# GPU placement comes from the config's `launch` section; the flags override it. Once any GPU is
# placed, a process given none runs on the CPU; with none placed, every process keeps the GPUs this
# script was given (none on a CPU machine). --dry-run prints each process's GPUs and command.
# Every process gets its own log in the run directory and its own process group. Ctrl-C, or
# the death of the learner or the reference server, stops everything this script started. The
# executor is restarted if it dies; a dead gen worker is reported and the others carry on.
# At the end: RUN_DIR/summary.json (with a sync check of every worker) and RUN_DIR/curves.png.
#
# Every service gets a per-run bearer token (unless the config sets one), kept in RUN_DIR/tokens.env.
# More gen workers can join at any time, from this node or another, with those tokens:
#   set -a; . RUN_DIR/tokens.env; set +a
#   python gen_worker.py --config CFG --set ref_server.url=http://HEAD:PORT \
#       --set executor.url=http://HEAD:PORT --host 0.0.0.0 --public-url http://THIS_NODE:PORT
set -euo pipefail
CALLER=$PWD  # --config and --run-dir are read from where the command was given; the rest runs from the repo
cd "$(dirname "$0")"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

CONFIG=configs/cpu_demo.yaml
RUN_DIR=""
RESUME=""
DRY_RUN=""
SETS=()
NNODES=1
NODE_RANK=0
MASTER_ADDR_ARG=""
MASTER_PORT_ARG=""
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; [[ $CONFIG = /* ]] || [ ! -e "$CALLER/$CONFIG" ] || CONFIG=$CALLER/$CONFIG; shift 2 ;;
    --run-dir) RUN_DIR=$2; [[ $RUN_DIR = /* ]] || RUN_DIR=$CALLER/$RUN_DIR; shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    --workers) SETS+=(--set "launch.workers=$2"); shift 2 ;;
    --ref-gpu) SETS+=(--set "launch.ref_gpu=${2:-null}"); shift 2 ;;  # "": on the CPU
    --worker-gpus) SETS+=(--set "launch.worker_gpus=$2"); shift 2 ;;
    --learner-gpus) SETS+=(--set "launch.learner_gpus=$2"); shift 2 ;;
    --share-gpus) SETS+=(--set "launch.share_gpus=true"); shift ;;
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --master-addr) MASTER_ADDR_ARG=$2; shift 2 ;;
    --master-port) MASTER_PORT_ARG=$2; shift 2 ;;
    --resume) RESUME=--resume; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;  # the header comment
    *) echo "launch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
fail() { echo "launch.sh: $*" >&2; exit 2; }
[[ $NNODES =~ ^[1-9][0-9]*$ ]] || fail "--nnodes '$NNODES': expected a number of learner nodes, 1 or more"
[[ $NODE_RANK =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ] \
  || fail "--node-rank '$NODE_RANK': expected 0 to $((NNODES - 1)) with --nnodes $NNODES"
if [ -n "$MASTER_PORT_ARG" ] && ! { [[ $MASTER_PORT_ARG =~ ^[1-9][0-9]{0,4}$ ]] && [ "$MASTER_PORT_ARG" -lt 65536 ]; }; then
  fail "--master-port '$MASTER_PORT_ARG': expected a port number"
fi
if [ "$NNODES" -gt 1 ]; then
  [ -n "$MASTER_ADDR_ARG" ] || fail "--nnodes $NNODES needs --master-addr: node 0's address, which every learner node reaches"
  # Every node's ranks write and read the checkpoints there, and node R reads node 0's tokens.env.
  [ -n "$RUN_DIR" ] || fail "--nnodes $NNODES needs --run-dir, the same on every node: a directory they all mount at the same path"
elif [ -n "$MASTER_ADDR_ARG$MASTER_PORT_ARG" ]; then
  fail "--master-addr and --master-port are for learner ranks on several nodes (--nnodes 2 or more)"
fi
RUN_DIR=${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)}
# Before anything starts (the learner checks again): --resume needs a checkpoint, and a fresh run
# must not start over one (its first save would delete the earlier run's checkpoints).
if [ -n "$RESUME" ] && [ ! -f "$RUN_DIR/checkpoints/latest" ]; then
  fail "--resume: $RUN_DIR/checkpoints holds no checkpoint; give the --run-dir of the run to continue"
elif [ -z "$RESUME" ] && [ -f "$RUN_DIR/checkpoints/latest" ]; then
  fail "$RUN_DIR holds a checkpoint of an earlier run: add --resume to continue it, or give another --run-dir"
fi
if [ "$NODE_RANK" -gt 0 ]; then
  # Only the learner runs here: the config's placement of the reference model and the workers is
  # node 0's. Its learner_gpus (or --learner-gpus) are this node's.
  SETS+=(--set "launch.ref_gpu=null" --set "launch.worker_gpus=")
fi

# Validate the whole config (a bad key or placement exits here with one line) and read the
# values this script needs, one per line.
mapfile -t V < <("$PY" config.py --config "$CONFIG" "${SETS[@]}" --get executor.port --get ref_server.port \
  --get rollout.port --get launch.workers --get launch.ref_gpu --get launch.worker_gpus \
  --get launch.learner_gpus --get model.name --get executor.token --get ref_server.token \
  --get rollout.token --get launch.stop_timeout_s --get launch.learner_launcher || echo FAILED)
[ ${#V[@]} = 13 ] || exit 2
STOP_S=$(LC_ALL=C printf '%.0f' "${V[11]}")  # a float as config.py prints it; LC_ALL: "180.0" in any locale
EX_PORT=${V[0]}; REF_PORT=${V[1]}; W_PORT=${V[2]}; WORKERS=${V[3]}
REF_GPU=${V[4]}; WORKER_GPUS=${V[5]}; LEARNER_GPUS=${V[6]}; MODEL=${V[7]}; LEARNER_LAUNCHER=${V[12]}
# Every service takes a bearer token: each one the config (or the environment) leaves unset gets a
# fresh one for this run. They reach the processes in the environment, never on a command line
# (which `ps` shows every user), and are kept in RUN_DIR/tokens.env (mode 0600) for workers that
# join from elsewhere (`set -a; . RUN_DIR/tokens.env; set +a` before starting them).
new_token() { "$PY" -c "import secrets; print(secrets.token_urlsafe(24))"; }
if [ "$NODE_RANK" = 0 ]; then
  export TOOLRL_EXECUTOR_TOKEN=${V[8]:-$(new_token)}
  export TOOLRL_REF_SERVER_TOKEN=${V[9]:-$(new_token)}
  export TOOLRL_ROLLOUT_TOKEN=${V[10]:-$(new_token)}
else  # node 0's tokens: given (config or environment), or read from its RUN_DIR/tokens.env below
  TOKENS_GIVEN=${V[9]}
  export TOOLRL_EXECUTOR_TOKEN=${V[8]} TOOLRL_REF_SERVER_TOKEN=${V[9]} TOOLRL_ROLLOUT_TOKEN=${V[10]}
fi
# GPU ids count within what this node gives us: if CUDA_VISIBLE_DEVICES is already set (a batch
# scheduler's allocation), id i is its i-th entry; every id named must exist.
OUTER=${CUDA_VISIBLE_DEVICES-}; OUTER=${OUTER// /}; OUTER_SET=${CUDA_VISIBLE_DEVICES+1}  # set but empty: no GPU
PLACED=""
if [ -n "$REF_GPU$WORKER_GPUS$LEARNER_GPUS" ]; then
  PLACED=1
  if [ -n "$OUTER_SET" ]; then
    IFS=, read -r -a OUTER_IDS <<< "$OUTER"; NGPUS=${#OUTER_IDS[@]}; HAVE="CUDA_VISIBLE_DEVICES=$OUTER lists"
  elif [ -z "$DRY_RUN" ]; then
    if ! command -v nvidia-smi > /dev/null; then
      echo "launch.sh: GPUs are assigned but nvidia-smi is not found (no NVIDIA driver on this node?)" >&2; exit 2
    fi
    NGPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); HAVE="nvidia-smi -L lists"
  else
    NGPUS=""
  fi
  for g in ${REF_GPU} ${WORKER_GPUS//,/ } ${LEARNER_GPUS//,/ }; do
    if [ -n "$NGPUS" ] && [ "$g" -ge "$NGPUS" ]; then
      echo "launch.sh: GPU $g is assigned but $HAVE $NGPUS GPU(s)" >&2; exit 2
    fi
  done
  if [ -n "$OUTER_SET" ]; then
    physical() { local out=() g; for g in ${1//,/ }; do out+=("${OUTER_IDS[$g]}"); done; (IFS=,; echo "${out[*]}"); }
    REF_GPU=$(physical "$REF_GPU"); WORKER_GPUS=$(physical "$WORKER_GPUS"); LEARNER_GPUS=$(physical "$LEARNER_GPUS")
    if [ -n "$LEARNER_GPUS" ] && [ "$NNODES" = 1 ] && ! [[ $LEARNER_GPUS =~ ^[0-9,]+$ ]]; then  # torchrun: any ids
      echo "launch.sh: deepspeed --include needs GPU indices, but CUDA_VISIBLE_DEVICES=$OUTER names GPUs otherwise" >&2
      exit 2
    fi
  fi
fi
if [ -z "$DRY_RUN" ]; then
  mkdir -p "$RUN_DIR/logs"
  RUN_DIR=$(cd "$RUN_DIR" && pwd)
  if [ "$NODE_RANK" = 0 ]; then  # node R shares this directory: node 0 alone writes these
    "$PY" config.py --config "$CONFIG" "${SETS[@]}" --print > "$RUN_DIR/config.yaml"  # tokens shown as ***
    (umask 077; printf 'TOOLRL_EXECUTOR_TOKEN=%s\nTOOLRL_REF_SERVER_TOKEN=%s\nTOOLRL_ROLLOUT_TOKEN=%s\n' \
      "$TOOLRL_EXECUTOR_TOKEN" "$TOOLRL_REF_SERVER_TOKEN" "$TOOLRL_ROLLOUT_TOKEN" > "$RUN_DIR/tokens.env.tmp" &&
     mv "$RUN_DIR/tokens.env.tmp" "$RUN_DIR/tokens.env")  # whole or absent: other nodes read it as it lands
  fi
fi
HEAD=127.0.0.1  # where this node reaches the executor and the reference server: here, or node 0
[ "$NODE_RANK" = 0 ] || HEAD=$MASTER_ADDR_ARG
SETS+=(--set "executor.url=http://$HEAD:$EX_PORT" --set "ref_server.url=http://$HEAD:$REF_PORT")
COMMON=(--config "$CONFIG" "${SETS[@]}")
MASTER_PORT=${MASTER_PORT_ARG:-$((REF_PORT + 1000))}
# The learner's command: deepspeed on one node; torchrun on several (static rendezvous at node 0's
# --master-addr: every node runs the same command with its own --node_rank, no hostfile, no ssh).
# LEARNER_AT: the learner's GPUs for start() below.
if [ "$NNODES" -gt 1 ]; then  # one rank per learner GPU (it sees only those), or one on a CPU
  IFS=, read -r -a LGPU <<< "$LEARNER_GPUS"
  LEARNER_AT=$LEARNER_GPUS
  LEARNER_CMD=("$(dirname "$PY")/torchrun" --nnodes "$NNODES" --node_rank "$NODE_RANK"
               --nproc_per_node "$(( ${#LGPU[@]} > 0 ? ${#LGPU[@]} : 1 ))" --master_addr "$MASTER_ADDR_ARG"
               --master_port "$MASTER_PORT" --rdzv_conf timeout=1800)  # nodes may start many minutes apart
elif [ -n "$LEARNER_GPUS" ]; then  # deepspeed sets each rank's device itself
  LEARNER_AT=launcher
  LEARNER_CMD=("$(dirname "$PY")/deepspeed" --include "localhost:$LEARNER_GPUS" --master_port "$MASTER_PORT")
elif [ "$LEARNER_LAUNCHER" = deepspeed ]; then  # CPU, as GPU nodes run (launch.learner_launcher)
  LEARNER_AT=""
  LEARNER_CMD=("$(dirname "$PY")/deepspeed" --num_gpus 1 --master_port "$MASTER_PORT")
else  # CPU: one rank on DeepSpeed's CPU accelerator, started as itself (toolrl/learner/dist_env.py):
  # deepspeed's launcher would add two processes that import torch (~370 MB and 4 s of CPU) only to
  # set RANK=0 and WORLD_SIZE=1
  LEARNER_AT=""
  LEARNER_CMD=("$PY" -u)
fi
LEARNER_CMD+=(learner.py "${COMMON[@]}" --run-dir "$RUN_DIR" $RESUME)

declare -A PIDS=()
LEARNER=learner  # its key in PIDS: learner_node$NODE_RANK on the other learner nodes
[ "$NODE_RANK" = 0 ] || LEARNER=learner_node$NODE_RANK
RANKS=""
declare -A REPORTED=()
STARTED_AT=$(date +%s)
is_rank() {  # is_rank PID: it runs learner.py itself (python [-u] learner.py ...), not a launcher
  local args first
  { mapfile -d '' -t args < "/proc/$1/cmdline"; } 2>/dev/null || return 1
  first=${args[1]:-}
  if [ "$first" = -u ]; then first=${args[2]:-}; fi
  [[ $first == *learner.py ]]
}
learner_ranks() {  # RANKS=the learner's ranks: below its launcher (torchrun gives each a session of its own)
  # Sets RANKS rather than printing them: run in this shell, a second Ctrl-C cannot cut the scan short
  local stat pid pp rest grew=1
  local -A parent=() below=(["${PIDS[$LEARNER]}"]=1)
  for stat in /proc/[0-9]*/stat; do
    { read -r rest < "$stat"; } 2>/dev/null || continue
    pid=${stat#/proc/}; pid=${pid%/stat}
    rest=${rest##*) }; read -r -a rest <<< "$rest"  # after the command name: state, ppid, ...
    parent[$pid]=${rest[1]:-0}
  done
  while [ $grew = 1 ]; do
    grew=0
    for pid in "${!parent[@]}"; do
      pp=${parent[$pid]}
      if [ -z "${below[$pid]:-}" ] && [ -n "${below[$pp]:-}" ]; then below[$pid]=1; grew=1; fi
    done
  done
  RANKS=""
  for pid in "${!below[@]}"; do
    if is_rank "$pid"; then RANKS+="$pid "; fi
  done
  return 0
}
learner_alive() {  # its process group, or a rank of it in a session of its own
  local pid
  kill -0 -- "-${PIDS[$LEARNER]}" 2>/dev/null && return 0
  for pid in $RANKS; do is_rank "$pid" && return 0; done  # still there, and still a rank
  return 1
}
stop_all() {
  trap - EXIT
  trap 'FORCE=1' INT TERM  # a second Ctrl-C: no more waiting, but nothing is left running either
  # (a Ctrl-C also kills the `sleep` below, and under `set -e` its failure ended the script here, with
  # every service left running: hence `|| true`)
  FORCE=
  # The learner first, while the reference server still answers: on SIGTERM it saves a checkpoint
  # (after the step it is in) and exits (toolrl/learner/preemption.py). Its ranks alone get it: a
  # launcher that does (deepspeed's, torchrun's) SIGKILLs them 30 s later, and a CPU step can take
  # longer; once they exit, so does their launcher. Its whole process group is waited for.
  local t0=$SECONDS said=0 pid
  RANKS=""
  if [ -n "${PIDS[$LEARNER]:-}" ] && kill -0 -- "-${PIDS[$LEARNER]}" 2>/dev/null; then
    learner_ranks
    if [ -n "$RANKS" ]; then
      kill -TERM $RANKS 2>/dev/null || true
    else
      kill -TERM -- "-${PIDS[$LEARNER]}" 2>/dev/null || true
    fi
    while [ -z "$FORCE" ] && learner_alive && [ $((SECONDS - t0)) -lt "$STOP_S" ]; do
      if [ $((SECONDS - t0)) -ge $((said + 30)) ]; then
        said=$((SECONDS - t0))
        echo "launch.sh: the learner is finishing its step to save it (${said} s of launch.stop_timeout_s $STOP_S s; Ctrl-C again: at once)"
      fi
      sleep 0.25 || true
    done
  fi
  for name in "${!PIDS[@]}"; do kill -TERM -- "-${PIDS[$name]}" 2>/dev/null || true; done
  for _ in $(seq 1 40); do
    alive=0
    for name in "${!PIDS[@]}"; do kill -0 "${PIDS[$name]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] || [ -n "$FORCE" ] && break
    sleep 0.25 || true
  done
  for name in "${!PIDS[@]}"; do kill -KILL -- "-${PIDS[$name]}" 2>/dev/null || true; done
  for pid in $RANKS; do  # ranks in sessions of their own, if still there (and still ranks)
    if is_rank "$pid"; then kill -KILL -- "-$pid" "$pid" 2>/dev/null || true; fi
  done
}
trap 'echo "launch.sh: stopping everything (the learner saves a checkpoint first; Ctrl-C again: at once)"; stop_all
      { grep -h "^stopped by" "$RUN_DIR/logs/learner.log" 2>/dev/null || true; } | tail -1; exit 130' INT TERM
trap 'stop_all' EXIT

start() {  # start NAME GPUS CMD...: its own session (process group), log file and GPUs
  local name=$1 gpus=$2 env; shift 2
  # GPUS: ids for CUDA_VISIBLE_DEVICES; "launcher": deepspeed --include places the ranks itself (on
  # physical ids); "": no GPU. The executor never sees one, nor does a process given none once any
  # GPU is placed (it runs on the CPU); without a placement processes keep what this script got.
  if [ "$gpus" = launcher ]; then env=unset
  elif [ -n "$gpus" ]; then env=$gpus
  elif [ -n "$PLACED" ] || [ "$name" = executor ]; then env=""
  elif [ -n "$OUTER_SET" ]; then env=$OUTER; else env=unset; fi
  if [ -n "$DRY_RUN" ]; then
    if [ "$env" = unset ]; then env="(CUDA_VISIBLE_DEVICES unset)"; else env="CUDA_VISIBLE_DEVICES=${env:-\"\"}"; fi
    local a cmd=""
    for a in "$@"; do [[ $a =~ ^[][A-Za-z0-9_./:=,@+{}-]+$ ]] && cmd+=" $a" || cmd+=" $(printf %q "$a")"; done
    printf '  %-13s %-30s%s\n' "$name" "$env" "$cmd"; return 0
  fi
  if [ "$env" = unset ]; then env=(-u CUDA_VISIBLE_DEVICES); else env=("CUDA_VISIBLE_DEVICES=$env"); fi
  env "${env[@]}" setsid "$@" > "$RUN_DIR/logs/$name.log" 2>&1 < /dev/null &  # env and setsid exec: $! is the process
  PIDS[$name]=$!
}

learner_tail() {  # learner_tail LOG: its last lines, then the ranks' errors (torchrun's report buries them)
  tail -n 30 "$1" >&2
  grep -E '(Error|Exception): ' "$1" | grep -v ChildFailedError | tail -n 3 | sed 's/^/  error: /' >&2 || true
}

wait_health() {  # wait_health NAME URL TIMEOUT_S [TOKEN_ENV_VAR]: the executor's /health takes its token
  [ -n "$DRY_RUN" ] && return 0
  local name=$1 url=$2 deadline=$(( $(date +%s) + $3 )) var=${4:-}
  until "$PY" -c "import httpx, os, sys; t = os.environ.get('$var') if '$var' else None
sys.exit(httpx.get('$url', timeout=2, headers={'Authorization': f'Bearer {t}'} if t else {}).status_code != 200)" 2>/dev/null; do
    if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then
      echo "launch.sh: $name died while starting; last lines of $RUN_DIR/logs/$name.log:" >&2
      tail -n 30 "$RUN_DIR/logs/$name.log" >&2; exit 1
    fi
    # the learner starts while the workers load: a learner that fails at once (another learner
    # node refused, a bad checkpoint) stops the run now, not after the workers' long start
    if [ -n "${PIDS[learner]:-}" ] && ! kill -0 "${PIDS[learner]}" 2>/dev/null; then
      echo "launch.sh: the learner died while $name was starting; last lines of $RUN_DIR/logs/learner.log:" >&2
      learner_tail "$RUN_DIR/logs/learner.log"; exit 1
    fi
    if [ "$(date +%s)" -gt $deadline ]; then echo "launch.sh: $name not healthy at $url after $3 s" >&2; exit 1; fi
    sleep 1
  done
  echo "  $name ready ($url)"
}

wait_head() {  # wait_head URL: node R waits for node 0's reference server to take the run's token
  [ -n "$DRY_RUN" ] && return 0
  local url=$1 deadline=$(( $(date +%s) + 1800 )) tokens=$RUN_DIR/tokens.env
  echo "waiting for node 0's reference server at $url"
  # tokens.env is re-read at every try: one left from an earlier run is replaced when node 0 starts.
  until { [ -n "$TOKENS_GIVEN" ] || { [ -f "$tokens" ] && set -a && . "$tokens" && set +a; }; } &&
      "$PY" -c "import httpx, os, sys; t = os.environ.get('TOOLRL_REF_SERVER_TOKEN')
sys.exit(httpx.get('$url/stats', timeout=5, headers={'Authorization': f'Bearer {t}'} if t else {}).status_code != 200)" 2>/dev/null; do
    if [ "$(date +%s)" -gt $deadline ]; then
      if [ -z "$TOKENS_GIVEN" ] && [ ! -f "$tokens" ]; then
        echo "launch.sh: no $tokens after 1800 s: --run-dir must be node 0's run directory, on a filesystem both nodes mount at the same path" >&2
      else
        echo "launch.sh: node 0's reference server did not answer at $url with the run's token in 1800 s" >&2
      fi
      exit 1
    fi
    sleep 2
  done
  echo "  node 0's reference server ready ($url)"
}

ON_NODE=""
[ "$NNODES" -gt 1 ] && ON_NODE=" on learner node $NODE_RANK of $NNODES"
if [ -n "$DRY_RUN" ]; then
  echo "dry run: where each process would run$ON_NODE (nothing is started; run directory $RUN_DIR)"
else
  echo "run directory: $RUN_DIR$ON_NODE"
  MODEL_LOG=$RUN_DIR/logs/model.log
  [ "$NODE_RANK" = 0 ] || MODEL_LOG=$RUN_DIR/logs/model_node$NODE_RANK.log
  "$PY" -m toolrl.models --model "$MODEL" --path-only > "$MODEL_LOG" 2>&1 \
    || { echo "launch.sh: model preparation failed:" >&2; tail -n 20 "$MODEL_LOG" >&2; exit 1; }
fi
if [ "$NODE_RANK" -gt 0 ]; then  # learner node R: its learner ranks only; node 0 runs the rest and reports
  NAME=$LEARNER
  wait_head "http://$HEAD:$REF_PORT"
  start "$NAME" "$LEARNER_AT" "${LEARNER_CMD[@]}"
  [ -n "$DRY_RUN" ] && exit 0
  echo "learner ranks of node $NODE_RANK started: $RUN_DIR/logs/$NAME.log (progress: node 0's learner.log)"
  set +e
  wait "${PIDS[$NAME]}"; RC=$?
  set -e
  [ "$RC" = 0 ] || { echo "launch.sh: learner ranks of node $NODE_RANK failed (exit $RC); last lines:" >&2
                     learner_tail "$RUN_DIR/logs/$NAME.log"; exit 1; }
  echo "learner ranks of node $NODE_RANK done"
  exit 0
fi
start executor "" "$PY" executor_service.py "${COMMON[@]}" --port "$EX_PORT"
REF_HOST=()
[ "$NNODES" -gt 1 ] && REF_HOST=(--host 0.0.0.0)  # the other learner nodes pull their batches from it
start ref_server "$REF_GPU" "$PY" ref_server.py "${COMMON[@]}" "${REF_HOST[@]}" --port "$REF_PORT"
# The workers start beside them: their engines take longest to start, and each waits
# (rollout.register_timeout_s) for the reference server to take its registration.
IFS=, read -r -a WGPU <<< "$WORKER_GPUS"
NCPU=$(nproc)
for i in $(seq 0 $((WORKERS - 1))); do
  gpu=""; bind=()
  if [ ${#WGPU[@]} -gt 0 ]; then gpu=${WGPU[$(( i % ${#WGPU[@]} ))]}
  elif [ "$WORKERS" -gt 1 ]; then bind=(--set "rollout.cpu_threads_bind=$(( i % NCPU ))"); fi  # one core each
  start "gen_worker_$i" "$gpu" "$PY" gen_worker.py "${COMMON[@]}" "${bind[@]}" --port $((W_PORT + i)) \
    --worker-id "worker-$i"
done
wait_health executor "http://127.0.0.1:$EX_PORT/health" 120 TOOLRL_EXECUTOR_TOKEN
wait_health ref_server "http://127.0.0.1:$REF_PORT/health" 600
# /health takes no token: a reference server left from an earlier run on this port would pass it
# while ours died of "address in use". Ours takes this run's token.
if [ -z "$DRY_RUN" ] && ! "$PY" -c "import httpx, os, sys; t = os.environ.get('TOOLRL_REF_SERVER_TOKEN')
sys.exit(httpx.get('http://127.0.0.1:$REF_PORT/stats', timeout=5, headers={'Authorization': f'Bearer {t}'} if t else {}).status_code != 200)" 2>/dev/null; then
  echo "launch.sh: the server on port $REF_PORT refuses this run's token: another run's reference server holds the port; last lines of $RUN_DIR/logs/ref_server.log:" >&2
  tail -n 5 "$RUN_DIR/logs/ref_server.log" >&2; exit 1
fi
# The learner starts while the workers load their engines (its imports and DeepSpeed set-up take
# minutes on a small CPU); it waits for a registered worker before its first evaluation or batch.
start learner "$LEARNER_AT" "${LEARNER_CMD[@]}"
[ -n "$DRY_RUN" ] && exit 0
for i in $(seq 0 $((WORKERS - 1))); do wait_health "gen_worker_$i" "http://127.0.0.1:$((W_PORT + i))/health" 900; done

cat <<EOF
all components up. Watch:
  progress     tail -f $RUN_DIR/logs/learner.log
  logs         $RUN_DIR/logs/{executor,ref_server,gen_worker_*,learner}.log
  TensorBoard  tensorboard --logdir $RUN_DIR/logs/tensorboard
  WandB        $RUN_DIR/logs/wandb   (offline: wandb sync $RUN_DIR/logs/wandb/offline-run-*)
EOF

SHOWN=0
progress() {  # the learner's step and eval lines not shown yet
  local lines
  lines=$(grep -E '^(step [0-9]+/|eval )' "$RUN_DIR/logs/learner.log" 2>/dev/null | tail -n +$((SHOWN + 1)) || true)
  [ -z "$lines" ] && return 0
  sed 's/^/  /' <<< "$lines"
  SHOWN=$((SHOWN + $(wc -l <<< "$lines")))
}
EX_RESTARTS=0
# With no gen worker of its own (launch.workers 0: they all join from other nodes), the run only
# stops for want of workers once one has registered.
# The registry is asked only while no local worker lives; an answer that fails (slow, refused) is no
# answer, and the run stops after 5 empty ones in a row (a lapse of heartbeats is not a departure).
SEEN=$(( WORKERS > 0 )); EMPTY=0
[ "$SEEN" = 1 ] || echo "no gen worker on this node: waiting for workers to join (ref_server.host must be reachable)"
registered() {  # exit 0: workers registered; 1: none; 2: no answer
  "$PY" -c "import os, sys; from toolrl.refserver.client import RefServerClient as C
try: n = len(C('http://127.0.0.1:$REF_PORT', token=os.environ['TOOLRL_REF_SERVER_TOKEN'], timeout_s=5).workers())
except Exception: sys.exit(2)
sys.exit(0 if n else 1)" 2>/dev/null
}
while kill -0 "${PIDS[learner]}" 2>/dev/null; do
  progress
  if ! kill -0 "${PIDS[ref_server]}" 2>/dev/null; then echo "launch.sh: ref_server died; stopping" >&2; exit 1; fi
  if ! kill -0 "${PIDS[executor]}" 2>/dev/null; then
    EX_RESTARTS=$((EX_RESTARTS + 1))
    [ $EX_RESTARTS -gt 5 ] && { echo "launch.sh: executor keeps dying; stopping" >&2; exit 1; }
    echo "launch.sh: executor died; restarting it (tool calls fail meanwhile)" >&2
    mv "$RUN_DIR/logs/executor.log" "$RUN_DIR/logs/executor.$EX_RESTARTS.log"
    start executor "" "$PY" executor_service.py "${COMMON[@]}" --port "$EX_PORT"
  fi
  alive=0
  for i in $(seq 0 $((WORKERS - 1))); do
    if kill -0 "${PIDS[gen_worker_$i]}" 2>/dev/null; then alive=$((alive + 1))
    elif [ -z "${REPORTED[$i]:-}" ]; then
      echo "launch.sh: gen_worker_$i died (see its log); the others carry on" >&2; REPORTED[$i]=1
    fi
  done
  # Workers that joined from elsewhere also count: only give up when the registry is empty too.
  if [ $alive = 0 ]; then
    rc=0; registered || rc=$?
    if [ $rc = 0 ]; then SEEN=1; EMPTY=0
    elif [ $rc = 1 ] && [ "$SEEN" = 1 ]; then
      EMPTY=$((EMPTY + 1))
      [ $EMPTY -ge 5 ] && { echo "launch.sh: no gen worker left; stopping" >&2; exit 1; }
    fi
  fi
  sleep 2
done
set +e
wait "${PIDS[learner]}"; RC=$?
set -e
progress
if [ "$RC" != 0 ]; then
  # A learner that lost its reference server fails too: name the cause, not the symptom.
  if ! kill -0 "${PIDS[ref_server]}" 2>/dev/null; then echo "launch.sh: ref_server died; stopping" >&2; exit 1; fi
  echo "launch.sh: learner failed (exit $RC); last lines:" >&2; learner_tail "$RUN_DIR/logs/learner.log"; exit 1
fi
echo "training done; checking every worker against the final policy and writing the report"
"$PY" -m toolrl.learner.report "$RUN_DIR" "${COMMON[@]}" --wall-s $(( $(date +%s) - STARTED_AT )) | tee "$RUN_DIR/logs/summary.log"
echo "summary: $RUN_DIR/summary.json   curves: $RUN_DIR/curves.png"
