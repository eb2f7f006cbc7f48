#!/usr/bin/env bash
# What made the long-rollout student fade (its prompt switches or its window-anchored long rollouts), and do the
# students' too-bright shapes come from DMD's guided real score? One chain on a two-GPU machine, started detached
# (setsid) so that it outlives the device call that starts it and no GPU waits for a call boundary:
#   bash benchmarks/gpu_long_rollout_ablation.sh start OUT      start the chain; returns at once
#   bash benchmarks/gpu_long_rollout_ablation.sh wait OUT SEC   wait up to SEC s for it to end, print its progress and
#                                                               archive logs and reports as $OUT/chain.tgz
# The stages, GPU 0 | GPU 1 (EXTRA: the chain's flags, e.g. "--motion wrap --seed 929292 --train-seed 2"):
#   teacher                                  | padded-text GPU tests (graph-ckpt), the trainer at the padded shape
#   causal ODE init                          | -
#   Self-Forcing, real-score CFG 4           | Self-Forcing, real-score CFG 2 (OUT/lsg, a copy of teacher + ode)
#   LongRollout switch_prob 0.25 (OUT/ls),   | the control (Self-Forcing +STEPS), then LongRollout switch_prob 0 (OUT/ls0)
#     beside it the CFG-2 student's eval     |
#   evaluation of SF, LR 0.25, control       | evaluation of LR 0
# then the trainer at the padded shape again, alone on the machine (when the chain is within QUIET_BY seconds).
# Other lanes, same schedule: SWITCH_A / SWITCH_B (the two LongRollout switch shares, default 0.25 / 0), LANE_B_FLAGS
# (more flags for the second, e.g. "--long-context-steps full"), CFG_B (the second Self-Forcing's real-score CFG,
# default 2; "off": no second Self-Forcing), STEPS (LongRollout's and the control's, default 120) and L_MINUTES (their
# time cap, default 7), P30_START (the padded-text parts before the trainer on GPU 1, default graph-ckpt; "" for none).
# SWITCH_EVAL (e.g. "--switch-renoise 0.5 0.75"): a switch-only evaluation with these flags (report_switch.json) of the
# Self-Forcing student as soon as it is trained (GPU 1), then of each lane's students before its full evaluation.
# The quiet round ends with the optimizer's GPU tests on both GPUs.
# The CFG-2 student's evaluation shares GPU 0 with a training run: its speeds are not comparable. Every evaluation
# adds the prompt switch, with the sinks as trained and without sinks (does a sink frame carry the old colour?).
set -uo pipefail
source "$(dirname "$0")/gpu_chain.sh"
chain_modes "$0" "${1:?usage: gpu_long_rollout_ablation.sh start|wait OUT [SEC]}" \
  "${2:?usage: gpu_long_rollout_ablation.sh start|wait OUT [SEC]}" "${3:-540}"
E=${EXTRA:-"--motion wrap --seed 929292 --train-seed 2 --teacher-minutes 6.5 --ode-minutes 2.5 --student-minutes 2.5"}
L="--student-minutes ${L_MINUTES:-7} --student-steps ${STEPS:-120} --long-init self_forcing"
switch=(--prompt-switch --switch-sink-frames 0)

cfg_b=${CFG_B:-2}
( for part in ${P30_START-graph-ckpt}; do padded 1 "${part//-/_}" "$part"; done
  STEP_S=150 TRAINER_S=150 padded 1 trainer_padded_beside trainer-padded ) &
tests=$!
stage 0 ls teacher --only-stage teacher
stage 0 ls ode --only-stage ode
if [ "$cfg_b" != off ]; then
  mkdir -p "$out/lsg" && cp -r "$out/ls/teacher" "$out/ls/ode" "$out/lsg/"
  wait $tests
  stage 1 lsg self_forcing_cfg_b --only-stage self_forcing --real-guidance "$cfg_b" &
fi
stage 0 ls self_forcing --only-stage self_forcing
mkdir -p "$out/ls0" && cp -r "$out/ls/teacher" "$out/ls/ode" "$out/ls/self_forcing" "$out/ls0/"
[ "$cfg_b" != off ] && wait
( stage 0 ls long_rollout_a $L --switch-prob "${SWITCH_A:-0.25}" --only-stage long_rollout &
  [ "$cfg_b" != off ] && stage 0 lsg eval_lsg --students self_forcing "${switch[@]}"
  wait
  # SWITCH_EVAL: each lane's students, the prompt switch only, before the full evaluations (it is short)
  [ -n "${SWITCH_EVAL:-}" ] && stage 0 ls switch_ls $L --switch-only $SWITCH_EVAL
  stage 0 ls eval_ls $L "${switch[@]}" ) &
lane0=$!
(
  # the Self-Forcing student's switch first: the earliest answer, should the device time end early
  [ -n "${SWITCH_EVAL:-}" ] && stage 1 ls switch_sf $L --switch-only $SWITCH_EVAL --score self_forcing
  stage 1 ls control $L --only-stage self_forcing_more
  cp -r "$out/ls/self_forcing_more" "$out/ls0/"
  stage 1 ls0 long_rollout_b $L --switch-prob "${SWITCH_B:-0}" ${LANE_B_FLAGS:-} --only-stage long_rollout
  [ -n "${SWITCH_EVAL:-}" ] && stage 1 ls0 switch_ls0 $L --switch-only $SWITCH_EVAL --score long_rollout
  stage 1 ls0 eval_ls0 $L "${switch[@]}" --score long_rollout
) &
lane1=$!
wait $lane0
wait $lane1
# the quiet round only while the session's device time allows it (QUIET_BY: seconds into the chain)
[ $(( $(date +%s) - chain_t0 )) -le "${QUIET_BY:-1450}" ] && STEP_S=150 TRAINER_S=150 padded 0 trainer_padded_quiet trainer-padded
wait $tests
optimizer_gpu_tests
note "chain done"
touch "$out/done"
