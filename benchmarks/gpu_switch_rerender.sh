#!/usr/bin/env bash
# One GPU (two with SCALING=1), one detached chain (gpu_chain.sh): does re-rendering the kept window under the new
# prompt make a streaming student switch colour, and what does it cost at the boundary? First, alone on the machine,
# the trainer at the padded shape against its bare step and the optimizer's GPU tests.
#   bash benchmarks/gpu_switch_rerender.sh start OUT        start the chain; returns at once
#   bash benchmarks/gpu_switch_rerender.sh wait OUT SEC     wait up to SEC s, print progress, results in $OUT/chain.tgz
# Stages: the trainer against its bare step (gpu_padded_text.sh trainer-vs-bare, quiet) and the optimizer GPU tests
# (P30=0 skips them) -> with SCALING=1 (two GPUs), ZeRO-2 1 vs 2 GPUs at the padded-text shape -> teacher ->
# causal ODE init -> Self-Forcing -> its prompt switch only: re-cached, old KV kept, 0 sinks, re-rendered from each of
# RENOISE (default "0.5 0.75 1.0") -> its full evaluation with the switch -> with LONG=1, LongRollout (STEPS, default
# 160, switch_prob L_SWITCH_PROB, default 0, critic windows per rollout L_CRITIC_WINDOWS, default 1, a student
# update every L_UPDATE_EVERY iterations, default 5; the share of windows drawn as the clip's first
# L_FIRST_WINDOW_SHARE, default 0) from that student with the exit-step context (OUT/ls) and the
# fully denoised context (OUT/lsf), each evaluated.
# EXTRA: the runs' flags (seeds, minutes; --validation-every N adds the students' per-window curve). TRAINER=0
# skips the trainer timing (the GPU tests still run, with the two-GPU NCCL EMA test where two GPUs are visible);
# SWITCH=0 skips the Self-Forcing switch sweep (its evaluation then comes with the LONG=1 exit-context one, or
# alone without LONG, with the switch as EVAL_SWITCH says); LONG_GPUS="0 1" runs the two LongRollout lanes side by
# side; SECOND=control makes the second lane the control (Self-Forcing trained on) instead of the fully denoised
# context: it trains at the same time as LongRollout, on one GPU too, and one evaluation scores both and Self-Forcing;
# SECOND=none leaves the second lane out; EVAL_SWITCH=0 leaves the prompt switch out of the evaluations,
# EVAL_SWITCH=criterion keeps only its judged runs (no old-keys/values or 0-sink comparison);
# EVAL_RENOISE="1.0" adds the re-rendered switch to them (a criteria line per time, beside the re-cache's);
# CHAIN_GPU=1 runs the chain's one-GPU stages on GPU 1 (default 0), so two chains with their own OUT and seeds can
# share a two-GPU machine.
set -uo pipefail
case ${SECOND:-full} in  # checked before the chain detaches: it could only log it, and a wait would sit out its SEC
  full | control | none) ;;
  *) echo "SECOND=$SECOND: choose full, control or none" >&2; exit 2 ;;
esac
case ${EVAL_SWITCH:-1} in
  0 | 1 | criterion) ;;
  *) echo "EVAL_SWITCH=$EVAL_SWITCH: choose 1, 0 or criterion" >&2; exit 2 ;;
esac
if [ "${LONG:-0}" = 1 ] && [ "${SECOND:-full}" = full ] && [ "${L_CRITIC_WINDOWS:-1}" != 1 ]; then
  echo "L_CRITIC_WINDOWS=$L_CRITIC_WINDOWS needs the exit-step context: set SECOND=control or none" >&2; exit 2
fi
source "$(dirname "$0")/gpu_chain.sh"
chain_modes "$0" "${1:?usage: gpu_switch_rerender.sh start|wait OUT [SEC]}" \
  "${2:?usage: gpu_switch_rerender.sh start|wait OUT [SEC]}" "${3:-540}"
g=${CHAIN_GPU:-0}  # the GPU of every one-GPU stage: two chains (fresh seeds each) can run at once on GPUs 0 and 1
E=${EXTRA:-"--motion wrap --seed 949494 --train-seed 4 --teacher-minutes 6.5 --ode-minutes 2.5 --student-minutes 2.5"}
L="--student-minutes ${L_MINUTES:-9} --student-steps ${STEPS:-160} --long-init self_forcing --switch-prob ${L_SWITCH_PROB:-0}${L_CRITIC_WINDOWS:+ --long-critic-windows $L_CRITIC_WINDOWS}"
L+="${L_UPDATE_EVERY:+ --long-update-every $L_UPDATE_EVERY}"
L+="${L_FIRST_WINDOW_SHARE:+ --long-first-window-share $L_FIRST_WINDOW_SHARE}"
case ${EVAL_SWITCH:-1} in
  1) switch=(--prompt-switch --switch-sink-frames 0) ;;
  # only the switch runs a criterion judges (the re-cache, each re-render): about half the switch's time, for a call
  # that scores three students
  criterion) switch=(--prompt-switch --switch-criterion-only) ;;
  0) switch=() ;;  # the evaluations without the prompt switch (a large --num-prompts)
esac
# and re-rendered, each its own criterion
[ ${#switch[@]} -gt 0 ] && [ -n "${EVAL_RENOISE:-}" ] && switch+=(--switch-renoise $EVAL_RENOISE)

lone_nccl_check
if [ "${P30:-1}" != 0 ]; then
  [ "${TRAINER:-1}" != 0 ] && TRAINER_S=200 padded "$g" trainer_vs_bare_quiet trainer-vs-bare
  optimizer_gpu_tests
fi
if [ "${SCALING:-0}" = 1 ]; then  # both GPUs: ZeRO-2 1 vs 2 GPUs at the real configuration, 2 interleaved rounds
  note "start scaling"
  timeout 420 bash benchmarks/train_scaling.sh --repeats 2 --plugins zero2 --gpus "1 2" --steps 20 --skip 6 \
    --config configs/diffusion/train/mmdit_1b_padded_text_shape.py --out "$out/p30/scaling" > "$out/log/scaling.txt" 2>&1
  note "end scaling: $(grep "efficiency median" "$out/log/scaling.txt" | tail -n 1)"
fi
stage "$g" ls teacher --only-stage teacher
stage "$g" ls ode --only-stage ode
stage "$g" ls self_forcing --only-stage self_forcing
if [ "${SWITCH:-1}" != 0 ]; then
  stage "$g" ls switch_sf --students self_forcing --switch-only --switch-renoise ${RENOISE:-0.5 0.75 1.0} \
    --switch-sink-frames 0
  stage "$g" ls eval_sf --students self_forcing "${switch[@]}"
elif [ "${LONG:-0}" != 1 ]; then  # no switch sweep, no LongRollout: Self-Forcing's own evaluation (EVAL_SWITCH's)
  stage "$g" ls eval_sf --students self_forcing "${switch[@]}"
fi
if [ "${LONG:-0}" = 1 ]; then
  # exit-step context in ls, fully denoised context in lsf; with SWITCH=0 the exit lane's evaluation also scores
  # the Self-Forcing student it started from (same seeds). SECOND=none: the exit lane alone.
  # SECOND=control: the control (Self-Forcing trained on for the same minutes / steps) trains in OUT/lsc at the
  # same time as LongRollout, also when both lanes share one GPU (they then share it for the same minutes; each
  # lane's step count is in its log), and one evaluation, alone on the GPU, scores LongRollout, Self-Forcing and the
  # control on the same clips (the teacher once; the streaming speeds untouched by the other lane).
  # An evaluation scores named students whose training finished: one that failed is left out and said so, never
  # trained by the evaluation (alone on the GPU, for minutes the call does not have).
  read -r gpu_exit gpu_full <<< "${LONG_GPUS:-$g $g}"
  second=${SECOND:-full}
  exit_scores=(long_rollout)
  [ "${SWITCH:-1}" = 0 ] || [ "$second" = control ] && exit_scores+=(self_forcing)
  lane2=lsf && [ "$second" = control ] && lane2=lsc
  [ "$second" != none ] && mkdir -p "$out/$lane2" && cp -r "$out/ls/teacher" "$out/ls/ode" "$out/ls/self_forcing" \
    "$out/$lane2/"
  finished() { [ -e "$out/$1/stage_finished" ] || { note "$1 did not finish: left out of the evaluation"; false; }; }
  evaluate() {  # evaluate GPU DIR NAME FLAGS... -- STUDENTS...: the finished ones, if any
    local gpu=$1 dir=$2 name=$3 flags=() names=()
    shift 3
    while [ "$1" != -- ]; do flags+=("$1"); shift; done
    shift
    for student in "$@"; do finished "$dir/$student" && names+=("$student"); done
    [ ${#names[@]} -gt 0 ] && stage "$gpu" "$dir" "$name" "${flags[@]}" --score "${names[@]}" "${switch[@]}"
  }
  train_exit() { stage "$gpu_exit" ls long_rollout_exit $L --long-context-steps exit --only-stage long_rollout; }
  eval_exit() { evaluate "$gpu_exit" ls eval_exit $L --long-context-steps exit -- "${exit_scores[@]}"; }
  if [ "$second" = control ]; then
    train_exit & stage "$gpu_full" lsc control $L --only-stage self_forcing_more & wait
    # the control's run beside LongRollout's (a fresh copy: a re-run must not nest it in an old one); the evaluation
    # reuses its finished stage and best checkpoint
    if finished lsc/self_forcing_more; then
      rm -rf "$out/ls/self_forcing_more" && cp -r "$out/lsc/self_forcing_more" "$out/ls/" \
        && exit_scores+=(self_forcing_more)
    fi
    eval_exit
  else
    full_lane() {
      [ "$second" = none ] && return
      stage "$gpu_full" lsf long_rollout_full $L --long-context-steps full --only-stage long_rollout
      evaluate "$gpu_full" lsf eval_full $L --long-context-steps full -- long_rollout
    }
    if [ "$gpu_exit" != "$gpu_full" ]; then
      (train_exit; eval_exit) & full_lane & wait
    else
      train_exit; eval_exit; full_lane
    fi
  fi
fi
note "chain done"
touch "$out/done"
