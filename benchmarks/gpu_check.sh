#!/usr/bin/env bash
# GPU check: every headprobe command once on the device, <= 8 minutes on one GPU with the embedded
# model, one line per step and one summary line at the end.
#   Each headprobe command (the COMMANDS registry, headprobe --help): scan in float32, bfloat16 (every
#   score finite, no NaN in head_scores.csv) and with --correction holm; budget; ablate; prune with
#   --save-pruned and an ablate of the saved pruned model (reloaded from its directory); patch at
#   every --site (z, q, k, v, resid); circuit (EAP-IG, its top edges verified by path patching);
#   kv (--method measured); robustness; diff (the model against its int8 requantization); atlas of
#   two models (the model and its pruned copy); show; view (scan + ablate + circuit in one page);
#   export of the scan (all formats) and import of its Parquet table (a round trip: the top-k heads of
#   the column both default to); train;
#   a tiny study (study heads). Besides:
#   - the exact sweep against the TransformerLens hook loop (benchmarks/ablation_sweep.py: ratio,
#     max_loss_diff, spearman, atp_spearman);
#   - a 1-rank torchrun ablate against the plain one (largest difference in head_ablation.csv);
#   - the same ablate on the model split by --device-map auto with a --max-memory that forces part
#     of it off the device (on a GPU: GPU + CPU offload; on the CPU: CPU + disk), against the plain one;
#   - pruned-model speed (benchmarks/pruned_speed.py: realised share of the FLOPs removed).
# Usage: bash benchmarks/gpu_check.sh [--device cuda|cpu] [--model NAME|DIR] [--quick] [--out DIR]
#   --device cpu runs the same steps on the CPU (the fallback the test suite runs, with --quick and a
#   tiny model; yours: --model figures/train-default, the committed headprobe checkpoint, 27 steps in
#   about 2.5 minutes); --quick shrinks every workload to seconds, but without --model it still loads
#   SmolLM2-135M, many minutes on a CPU. Set PYTHON to the interpreter of the
#   environment (default: .venv/bin/python if present, else python); on a CUDA machine install it
#   with `make setup TORCH_SPEC=torch` first. Every command runs as `python -m headprobe ...` with
#   PYTHONPATH=. (default), through benchmarks/run_peak.py: it imports torch, transformers and
#   headprobe once and runs each step in a forked child (GPU_CHECK_FORK=0: a fresh interpreter each).
# Writes every step's output to OUT/gpu_check.log (default OUT: gpu_check/) and prints one line per step
#   gpu_check_step name=<step> command=<headprobe command, - for a benchmark script> rc=<exit code>
#     wall_s=<s> cpu_s=<s> peak_gpu_mib=<torch.cuda.max_memory_allocated, MiB; n/a without CUDA> peak_rss_mib=<MiB>
# then the last line:
#   gpu_check device=... model=... scan_bf16_nan=<n> ratio=<x> max_loss_diff=<y> spearman=<z>
#   atp_spearman=<a> torchrun_max_diff=<d> device_map_max_diff=<d> realised_0.25=<r> realised_0.5=<r>
#   scan_f32_nan=<n> commands=<checked>/<registered> missing=<commands without a passing step>
#   steps=<n> peak_gpu_mib=<largest> failed=<steps> elapsed_s=<t>
# Exit code 0 when every step passed and every registered command had a passing step.
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
LOG=$OUT/gpu_check.log PLAN=$OUT/plan.txt STEPS=$OUT/steps.txt
: > "$LOG"; : > "$PLAN"
START=$(date +%s)
HP=(-m headprobe)

if [ "$QUICK" = 1 ]; then
  DATA=(--n-natural 2 --seq-len 16 --n-repeated 2 --period 6)
  SCAN_ARGS=("${DATA[@]}" --n-random 4 --keep-n-random -k 2)
  SWEEP_ARGS=(--n-seqs 2 --seq-len 16)
  ABLATE_ARGS=("${DATA[@]}" --heads 0.0,0.1,1.0,1.1,1.2,1.3)
  RELOAD_ARGS=("${DATA[@]}")
  SPEED_ARGS=(--batch 2 --seq-len 32 --repeats 1)
  PRUNE_ARGS=("${DATA[@]}" --step-fraction 0.25 --l0-steps 12 --l0-lambdas 10,100 --n-seeds 2)
  PATCH_ARGS=()  # prompts: below
  CIRCUIT_ARGS=(--n-seqs 2 --period 6 --steps 2 --verify 4 --top 5)
  KV_ARGS=(--seq-len 64 --n-random 1 --budgets 0.5)
  ROBUST_ARGS=("${DATA[@]}" -k 2 --n-random 3 --n-boot 20 --control-seeds 1 --types induction)
  DIFF_ARGS=("${DATA[@]}" -k 2 --n-perm 50)
  ATLAS_ARGS=("${DATA[@]}" -k 2 --n-random 3 --pattern-len 0 --no-model-figures --types induction)
  IMPORT_ARGS=("${DATA[@]}" -k 2 --n-random 3 --keep-n-random)
  TRAIN_ARGS=(--steps 20 --eval-every 10 --d-model 16 --n-heads 2 --n-words 16 --seq-len 33 --max-period 12
              --eval-period 8 --n-eval 8)
  STUDY_ARGS=(--steps 2 --eval-every 2 --seeds 0 --d-model 16 --n-heads-list 1,2)
  SHOW_HEAD=1.1
  SPLIT_MEM=200KB  # the tiny model's first block in memory, the rest offloaded
  LIMIT=120
else
  # Sized for the embedded SmolLM2-135M on one H200 within 8 minutes (about 25 model loads of a few
  # seconds each; a control set of scan's verdicts takes ~0.04 s there): scan, ablate, prune, patch,
  # robustness, diff and import at their defaults (the demo's settings); kv on 512 tokens (default
  # 1024) with 2 random policies per budget; atlas with 19 control sets (default 50) and no
  # per-model figures; train 300 steps (default 1000); study heads 150 steps, one seed, 1/2/4 heads.
  SCAN_ARGS=()
  SWEEP_ARGS=(--all-heads --max-batch 512)
  ABLATE_ARGS=(--heads 18.6,17.3,17.4,17.5,12.0,3.1)
  RELOAD_ARGS=()
  SPEED_ARGS=()
  PRUNE_ARGS=()
  PATCH_ARGS=()  # the built-in IOI task, 24 prompt pairs
  CIRCUIT_ARGS=(--verify 10)
  KV_ARGS=(--seq-len 512 --n-random 2)
  ROBUST_ARGS=()
  DIFF_ARGS=()
  ATLAS_ARGS=(--n-random 19 --no-model-figures)
  IMPORT_ARGS=()
  TRAIN_ARGS=(--steps 300)
  STUDY_ARGS=(--steps 150 --eval-every 50 --seeds 0 --n-heads-list 1,2,4)
  SHOW_HEAD=18.6
  SPLIT_MEM=300MiB  # about half of SmolLM2's float32 weights
  LIMIT=240
fi
if [ "$DEVICE" = cuda ]; then MAXMEM="cuda:0=$SPLIT_MEM,cpu=64GiB"; else MAXMEM="cpu=$SPLIT_MEM"; fi
ON=(--model "$MODEL" --device "$DEVICE")
PRUNED=$OUT/prune/pruned_model

{
  echo "# gpu_check $(date -u +%FT%TZ) device=$DEVICE model=$MODEL quick=$QUICK"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
} >> "$LOG" 2>&1

# patch: the IOI task needs first names that are one token each; a local model directory (the test
# suite's tiny word-level model) gets prompt pairs made of words of its own vocabulary instead
if [ -f "$MODEL/tokenizer.json" ]; then
  $PYTHON - "$MODEL/tokenizer.json" "$OUT/prompts.jsonl" <<'PY' >> "$LOG" 2>&1 && PATCH_ARGS=(--prompts "$OUT/prompts.jsonl")
import json, random, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
words = sorted(w for w in tok.get_vocab() if w.isalnum() and len(tok.encode(" " + w, add_special_tokens=False).ids) == 1)
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(4):
        clean, corrupted = (" ".join(rng.choices(words, k=8)) for _ in range(2))
        correct, wrong = rng.sample(words, 2)
        f.write(json.dumps({"clean": clean, "corrupted": corrupted, "correct": " " + correct, "wrong": " " + wrong}) + "\n")
PY
fi

plan() {  # plan NAME COMMAND ARGV...: add a step (COMMAND: the headprobe command it checks, - for none)
  printf '%q ' "$@" >> "$PLAN"; echo >> "$PLAN"
}

plan scan_f32 scan "${HP[@]}" scan "${ON[@]}" --out "$OUT/scan_f32" --overwrite "${SCAN_ARGS[@]}"
plan scan_bf16 scan "${HP[@]}" scan "${ON[@]}" --dtype bfloat16 --out "$OUT/scan_bf16" --overwrite "${SCAN_ARGS[@]}"
plan scan_holm scan "${HP[@]}" scan "${ON[@]}" --correction holm --out "$OUT/scan_holm" --overwrite "${SCAN_ARGS[@]}"
plan budget budget "${HP[@]}" budget --model "$MODEL" --seq-len 4096
plan sweep - benchmarks/ablation_sweep.py "${ON[@]}" "${SWEEP_ARGS[@]}"
plan ablate_plain ablate "${HP[@]}" ablate "${ON[@]}" --out "$OUT/ablate_plain" --overwrite "${ABLATE_ARGS[@]}"
plan ablate_torchrun ablate -m torch.distributed.run --nproc-per-node 1 benchmarks/run_peak.py "${HP[@]}" ablate \
  "${ON[@]}" --out "$OUT/ablate_torchrun" --overwrite "${ABLATE_ARGS[@]}"
plan ablate_device_map ablate "${HP[@]}" ablate --model "$MODEL" --device-map auto --max-memory "$MAXMEM" \
  --out "$OUT/ablate_split" --overwrite "${ABLATE_ARGS[@]}"
plan pruned_speed - benchmarks/pruned_speed.py "${ON[@]}" "${SPEED_ARGS[@]}"
plan prune prune "${HP[@]}" prune "${ON[@]}" --save-pruned --out "$OUT/prune" --overwrite "${PRUNE_ARGS[@]}"
plan prune_reload ablate "${HP[@]}" ablate --model "$PRUNED" --device "$DEVICE" --out "$OUT/prune_reload" --overwrite \
  "${RELOAD_ARGS[@]}"
for site in z q k v resid; do
  extra=(); [ $site = resid ] && extra=(--positions 0,-1)
  plan "patch_$site" patch "${HP[@]}" patch "${ON[@]}" --site $site "${extra[@]}" --out "$OUT/patch_$site" --overwrite \
    "${PATCH_ARGS[@]}"
done
plan circuit circuit "${HP[@]}" circuit "${ON[@]}" --method eap-ig --out "$OUT/circuit" --overwrite "${CIRCUIT_ARGS[@]}"
plan kv kv "${HP[@]}" kv "${ON[@]}" --method measured --out "$OUT/kv" --overwrite "${KV_ARGS[@]}"
plan robustness robustness "${HP[@]}" robustness "${ON[@]}" --out "$OUT/robustness" --overwrite "${ROBUST_ARGS[@]}"
plan diff diff "${HP[@]}" diff "$MODEL" "$MODEL" --requantize-b int8 --device "$DEVICE" --out "$OUT/diff" --overwrite \
  "${DIFF_ARGS[@]}"
plan atlas atlas "${HP[@]}" atlas --models "$MODEL" "$PRUNED" --device "$DEVICE" --out "$OUT/atlas" --overwrite \
  "${ATLAS_ARGS[@]}"
plan show show "${HP[@]}" show "${ON[@]}" --head $SHOW_HEAD --prompt "the cat sat on the mat and the cat sat on the mat" \
  --out "$OUT/show" --overwrite
plan view view "${HP[@]}" view "$OUT/scan_f32" --ablation "$OUT/ablate_plain" --circuit "$OUT/circuit"
plan export export "${HP[@]}" export --from "$OUT/scan_f32" --out "$OUT/export" --format all --overwrite
plan import import "${HP[@]}" import "${ON[@]}" --heads-file "$OUT/export/heads.parquet" "${IMPORT_ARGS[@]}"
plan train train "${HP[@]}" train --device "$DEVICE" --out "$OUT/train" --overwrite "${TRAIN_ARGS[@]}"
plan study study "${HP[@]}" study heads --device "$DEVICE" --out "$OUT/study" --overwrite "${STUDY_ARGS[@]}"

$PYTHON benchmarks/run_peak.py --plan "$PLAN" --log "$LOG" --timeout "$LIMIT" | tee "$STEPS"

rc_of() {  # rc_of STEP: its exit code (empty where it did not run)
  grep -oE "^gpu_check_step name=$1 .* rc=-?[0-9]+" "$STEPS" | sed 's/.* rc=//'
}

value() {  # value KEY: the last KEY=<value> printed in the log
  grep -oE "(^| )$1=[^ ]*" "$LOG" | tail -1 | sed 's/.*=//'
}

# The checks on the steps' files, in one process: NaNs in the scans' head_scores.csv (except the
# columns summary.json says are blank and why: metrics.skipped, e.g. local_256 on sequences of 256
# tokens or fewer); the largest difference of the torchrun and --device-map ablate tables from the
# plain one (same columns and rows); the registered commands.
NAN=fail NAN32=fail DIFF=fail SPLIT_DIFF=fail REGISTERED=
eval "$($PYTHON - "$OUT" "$STEPS" <<'PY' 2>> "$LOG"
import json, re, sys
import pandas as pd
from headprobe.commands import COMMANDS
out, steps = sys.argv[1:]
ok = set(re.findall(r"^gpu_check_step name=(\S+) .*? rc=0 ", open(steps).read(), re.M))
def nans(d):
    t = pd.read_csv(f"{out}/{d}/head_scores.csv")
    skipped = json.load(open(f"{out}/{d}/summary.json")).get("metrics", {}).get("skipped", {})
    return int(t.drop(columns=[c for c in skipped if c in t]).isna().sum().sum())
def max_diff(d):
    a, b = (pd.read_csv(f"{out}/{x}/head_ablation.csv") for x in ("ablate_plain", d))
    assert list(a.columns) == list(b.columns) and len(a) == len(b), "different tables"
    num = a.select_dtypes("number").columns
    return f"{float((a[num] - b[num]).abs().max().max()):.2e}"
for var, needs, f in [("NAN", ["scan_bf16"], lambda: nans("scan_bf16")), ("NAN32", ["scan_f32"], lambda: nans("scan_f32")),
                      ("DIFF", ["ablate_plain", "ablate_torchrun"], lambda: max_diff("ablate_torchrun")),
                      ("SPLIT_DIFF", ["ablate_plain", "ablate_device_map"], lambda: max_diff("ablate_split"))]:
    try:
        print(f"{var}={f() if ok.issuperset(needs) else 'fail'}")
    except Exception as e:  # noqa: BLE001 - reported in the log, the value reads fail
        print(f"{var}: {e!r}", file=sys.stderr)
        print(f"{var}=fail")
print(f"REGISTERED='{' '.join(COMMANDS.names())}'")
PY
)"
FAILED=()
while read -r name; do
  [ "$(rc_of "$name")" = 0 ] || FAILED+=("$name")
done < <(awk '{print $1}' "$PLAN")
for v in "$NAN" "$NAN32"; do [ "$v" = 0 ] || FAILED+=(nan_check); done
# every registered command has a step that passed
CHECKED=$(awk '$4 == "rc=0" {sub("command=", "", $3); if ($3 != "-") print $3}' "$STEPS" | sort -u)
MISSING=()
for c in $REGISTERED; do grep -qx -- "$c" <<< "$CHECKED" || MISSING+=("$c"); done
[ ${#MISSING[@]} -eq 0 ] && [ -n "$REGISTERED" ] || FAILED+=(coverage)
N_REG=$(wc -w <<< "$REGISTERED")
PEAK=$(awk '{sub("peak_gpu_mib=", "", $7); if ($7 != "n/a" && $7 + 0 > m) m = $7 + 0; if ($7 != "n/a") seen = 1}
  END {print seen ? m : "n/a"}' "$STEPS")

ELAPSED=$(( $(date +%s) - START ))
FAILS=$(IFS=,; echo "${FAILED[*]:-none}")
LINE="gpu_check device=$DEVICE model=$MODEL scan_bf16_nan=$NAN ratio=$(value ratio) max_loss_diff=$(value max_loss_diff)"
LINE+=" spearman=$(value spearman) atp_spearman=$(value atp_spearman) torchrun_max_diff=$DIFF device_map_max_diff=$SPLIT_DIFF"
LINE+=" realised_0.25=$(value realised_0.25) realised_0.5=$(value realised_0.5) scan_f32_nan=$NAN32"
LINE+=" commands=$(( N_REG - ${#MISSING[@]} ))/$N_REG missing=$(IFS=,; echo "${MISSING[*]:-none}")"
LINE+=" steps=$(wc -l < "$STEPS") peak_gpu_mib=$PEAK failed=$FAILS elapsed_s=$ELAPSED"
echo "$LINE" | tee -a "$LOG"
[ "$FAILS" = none ]
