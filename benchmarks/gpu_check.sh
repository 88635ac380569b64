#!/usr/bin/env bash
# GPU check of the ablation and pruning engine (issue 4): the ablation-sweep benchmark on all 270
# heads of smollm2-135m (TransformerLens hook loop vs the engine) and a pruning run with a saved
# pruned model, both on CUDA. Meant to finish in under 5 minutes on one GPU.
# Usage: bash benchmarks/gpu_check.sh [RESULTS_FILE]   (default: gpu_check_results.txt)
# Writes every line of output to RESULTS_FILE (also printed), and the pruning outputs to
# $(dirname RESULTS_FILE)/gpu_prune/.
set -uo pipefail
RESULTS=${1:-gpu_check_results.txt}
OUTDIR=$(dirname "$RESULTS")/gpu_prune
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-.}
export TOKENIZERS_PARALLELISM=false
{
  echo "# gpu_check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi not found"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "## benchmark, all heads, float32"
  timeout 240 $PY benchmarks/ablation_sweep.py --device cuda --all-heads --max-batch 512 2>&1 | grep -v "it/s\]" ; echo "rc=$?"
  echo "## prune, float32, --save-pruned"
  timeout 150 $PY -m headprobe.cli prune --model smollm2-135m --device cuda --out "$OUTDIR" --overwrite \
      --save-pruned --save-fraction 0.3 2>&1 | grep -v "it/s\]" ; echo "rc=$?"
} 2>&1 | tee "$RESULTS"
