#!/usr/bin/env bash
# GPU check (issue 13.7): one script, <= 8 minutes on one GPU, one summary line at the end.
#   1. bfloat16 scan of the model (every score finite, no NaN anywhere in head_scores.csv);
#   2. the exact sweep against the TransformerLens hook loop (benchmarks/ablation_sweep.py: ratio,
#      max_loss_diff, spearman, atp_spearman);
#   3. a 1-rank torchrun ablate sweep against the plain one (largest difference in head_ablation.csv);
#   3b. the same sweep on the model split by --device-map auto with a --max-memory that forces part of
#      it off the device (on a GPU: GPU + CPU offload; on the CPU: CPU + disk), against the plain one;
#   4. pruned-model speed (benchmarks/pruned_speed.py: realised share of the FLOPs removed).
# Usage: bash benchmarks/gpu_check.sh [--device cuda|cpu] [--model NAME|DIR] [--quick] [--out DIR]
#   --device cpu runs the same steps on the CPU (the fallback the test suite runs, with --quick and a
#   tiny model); --quick shrinks every workload to seconds. Set PYTHON to the interpreter of the
#   environment (default: .venv/bin/python if present, else python); on a CUDA machine install it
#   with `make setup TORCH_SPEC=torch` first.
# Writes every step's output to OUT/gpu_check.log (default OUT: gpu_check/) and prints the last line:
#   gpu_check device=... model=... scan_bf16_nan=<n> ratio=<x> max_loss_diff=<y> spearman=<z>
#   atp_spearman=<a> torchrun_max_diff=<d> device_map_max_diff=<d> realised_0.25=<r> realised_0.5=<r> failed=<steps> elapsed_s=<t>
set -uo pipefail
DEVICE=cuda MODEL=smollm2-135m QUICK=0 OUT=gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --device, --model, --quick, --out)" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
export TOKENIZERS_PARALLELISM=false PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
START=$(date +%s)
FAILED=()

if [ "$QUICK" = 1 ]; then
  SCAN_ARGS=(--n-natural 2 --seq-len 16 --n-repeated 2 --period 6 --n-random 4 --keep-n-random -k 2)
  SWEEP_ARGS=(--n-seqs 2 --seq-len 16)
  ABLATE_ARGS=(--n-natural 2 --seq-len 16 --n-repeated 2 --period 6 --heads 0.0,0.1,1.0,1.1,1.2,1.3)
  SPEED_ARGS=(--batch 2 --seq-len 32 --repeats 1)
  SPLIT_MEM=200KB  # the tiny model's first block in memory, the rest offloaded
  LIMIT=120
else
  SCAN_ARGS=()
  SWEEP_ARGS=(--all-heads --max-batch 512)
  ABLATE_ARGS=(--heads 18.6,17.3,17.4,17.5,12.0,3.1)
  SPEED_ARGS=()
  SPLIT_MEM=300MiB  # about half of SmolLM2's float32 weights
  LIMIT=240
fi

step() {  # step NAME COMMAND...: run with a time limit, output to the log, record a failure
  local name=$1; shift
  echo "## $name: $*" >> "$LOG"
  timeout "$LIMIT" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "## $name rc=$rc" >> "$LOG"
  [ $rc -eq 0 ] || FAILED+=("$name")
  return $rc
}

table_max_diff() {  # table_max_diff A.csv B.csv: the largest difference of their numbers (same columns and rows)
  $PYTHON - "$1" "$2" <<'EOF' 2>> "$LOG"
import sys
import pandas as pd
a, b = (pd.read_csv(p) for p in sys.argv[1:])
assert list(a.columns) == list(b.columns) and len(a) == len(b), "different tables"
num = a.select_dtypes("number").columns
print(f"{float((a[num] - b[num]).abs().max().max()):.2e}")
EOF
}

value() {  # value KEY: the last KEY=<value> printed in the log
  grep -oE "(^| )$1=[^ ]*" "$LOG" | tail -1 | sed 's/.*=//' 
}

{
  echo "# gpu_check $(date -u +%FT%TZ) device=$DEVICE model=$MODEL quick=$QUICK"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
  $PYTHON -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} >> "$LOG" 2>&1

# 1. bfloat16 scan: every score in head_scores.csv finite, except the columns summary.json says are
#    blank and why (metrics.skipped: e.g. local_256 on sequences of 256 tokens or fewer)
NAN=fail
if step scan_bf16 $PYTHON -m headprobe scan --model "$MODEL" --device "$DEVICE" --dtype bfloat16 \
     --out "$OUT/scan_bf16" --overwrite "${SCAN_ARGS[@]}"; then
  NAN=$($PYTHON -c "import sys, json, pandas as pd; t = pd.read_csv(sys.argv[1] + '/head_scores.csv')
skipped = json.load(open(sys.argv[1] + '/summary.json')).get('metrics', {}).get('skipped', {})
print(int(t.drop(columns=[c for c in skipped if c in t]).isna().sum().sum()))" \
        "$OUT/scan_bf16" 2>> "$LOG") || NAN=fail
fi

# 2. exact sweep vs the TransformerLens loop, and the AtP* estimate
step sweep $PYTHON benchmarks/ablation_sweep.py --model "$MODEL" --device "$DEVICE" "${SWEEP_ARGS[@]}"

# 3. torchrun with one rank writes what one plain process writes
DIFF=fail
if step ablate_plain $PYTHON -m headprobe ablate --model "$MODEL" --device "$DEVICE" --out "$OUT/ablate_plain" \
     --overwrite "${ABLATE_ARGS[@]}" \
   && step ablate_torchrun $PYTHON -m torch.distributed.run --nproc-per-node 1 -m headprobe ablate --model "$MODEL" \
     --device "$DEVICE" --out "$OUT/ablate_torchrun" --overwrite "${ABLATE_ARGS[@]}"; then
  DIFF=$(table_max_diff "$OUT/ablate_plain/head_ablation.csv" "$OUT/ablate_torchrun/head_ablation.csv") || DIFF=fail
fi

# 3b. a model split over devices (--device-map) writes what the whole model writes
if [ "$DEVICE" = cuda ]; then MAXMEM="cuda:0=$SPLIT_MEM,cpu=64GiB"; else MAXMEM="cpu=$SPLIT_MEM"; fi
SPLIT_DIFF=fail
if [ -f "$OUT/ablate_plain/head_ablation.csv" ] \
   && step ablate_device_map $PYTHON -m headprobe ablate --model "$MODEL" --device-map auto --max-memory "$MAXMEM" \
     --out "$OUT/ablate_split" --overwrite "${ABLATE_ARGS[@]}"; then
  SPLIT_DIFF=$(table_max_diff "$OUT/ablate_plain/head_ablation.csv" "$OUT/ablate_split/head_ablation.csv") || SPLIT_DIFF=fail
fi

# 4. pruned-model speed
step pruned_speed $PYTHON benchmarks/pruned_speed.py --model "$MODEL" --device "$DEVICE" "${SPEED_ARGS[@]}"

ELAPSED=$(( $(date +%s) - START ))
FAILS=$(IFS=,; echo "${FAILED[*]:-none}")
LINE="gpu_check device=$DEVICE model=$MODEL scan_bf16_nan=$NAN ratio=$(value ratio) max_loss_diff=$(value max_loss_diff)"
LINE+=" spearman=$(value spearman) atp_spearman=$(value atp_spearman) torchrun_max_diff=$DIFF device_map_max_diff=$SPLIT_DIFF"
LINE+=" realised_0.25=$(value realised_0.25) realised_0.5=$(value realised_0.5) failed=$FAILS elapsed_s=$ELAPSED"
echo "$LINE" | tee -a "$LOG"
[ "$FAILS" = none ]
