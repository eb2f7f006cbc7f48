#!/usr/bin/env bash
# Two Self-Forcing students from one teacher and one causal init, side by side on two GPUs, in one detached chain
# (gpu_chain.sh): an ablation of one training setting with everything else shared (teacher, init, seeds, prompts).
# GPU 0 trains the student with $EXTRA, GPU 1 with $EXTRA $PAIR; each is then evaluated on its GPU against the same
# teacher on the same seeds (report OUT/a/report.json and OUT/b/report.json, with the resampled criteria).
#   bash benchmarks/gpu_student_pair.sh start OUT        start the chain; returns at once
#   bash benchmarks/gpu_student_pair.sh wait OUT SEC     wait up to SEC s, print progress, results in $OUT/chain.tgz
# EXTRA: every run's flags (seeds, minutes, --teacher-gate, --validation-every N --student-checkpoint best,
# --num-prompts); PAIR: the second student's own flags, e.g. PAIR="--adam-beta1 0"; EVAL_SWITCH=1 adds the prompt
# switch to both evaluations, EVAL_RENOISE="1.0" its re-rendered variant (a criteria line each); PAIR_GPUS="0 0" puts
# both lanes on one GPU (default "0 1"; the teacher and the causal init train on the first).
set -uo pipefail
if [ "${1:-}" = start ]; then  # checked here: the detached chain could only log it, and wait would sit out its SEC
  : "${EXTRA:?set EXTRA: the flags of every run}" "${PAIR:?set PAIR: the flags of the second student}"
fi
source "$(dirname "$0")/gpu_chain.sh"
chain_modes "$0" "${1:?usage: gpu_student_pair.sh start|wait OUT [SEC]}" \
  "${2:?usage: gpu_student_pair.sh start|wait OUT [SEC]}" "${3:-540}"
E=${EXTRA:?set EXTRA: the flags of every run}
read -r -a pair <<< "${PAIR:?set PAIR: the flags of the second student}"
switch=()
if [ "${EVAL_SWITCH:-0}" = 1 ]; then
  switch=(--prompt-switch --switch-sink-frames 0)
  [ -n "${EVAL_RENOISE:-}" ] && switch+=(--switch-renoise $EVAL_RENOISE)
fi

lone_nccl_check
read -r gpu_a gpu_b <<< "${PAIR_GPUS:-0 1}"
stage "$gpu_a" a teacher --only-stage teacher
stage "$gpu_a" a ode --only-stage ode
mkdir -p "$out/b" && cp -r "$out/a/teacher" "$out/a/ode" "$out/b/"  # the second lane reuses both
lane() {  # GPU DIR NAME FLAGS...: train the student, then evaluate it (the teacher sampled again, same seeds)
  local gpu=$1 dir=$2 name=$3
  shift 3
  stage "$gpu" "$dir" "self_forcing_$name" --only-stage self_forcing "$@"
  stage "$gpu" "$dir" "eval_$name" --students self_forcing "${switch[@]}" "$@"
}
lane "$gpu_a" a plain &
lane "$gpu_b" b pair "${pair[@]}" &
wait
note "chain done"
touch "$out/done"
