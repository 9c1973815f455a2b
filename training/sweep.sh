#!/usr/bin/env bash
# The GPU-host run that produced demo_model/: three schedule lengths trained side by side on one
# GPU (same seed, data and model; only --max-steps differs), the one with the best validation
# perplexity is kept. Each run alone is reproducible: python -m training.train --max-steps N.
# Usage (repo root, corpus in training/data): bash training/sweep.sh OUT_DIR [PYTHON] [STEPS...]
# (env: MAX_TIME_S, a per-run time guard; TRAIN_ARGS, extra training.train flags)
set -euo pipefail
out=${1:?usage: sweep.sh OUT_DIR [PYTHON] [STEPS...]}
py=${2:-python}
shift $(( $# >= 2 ? 2 : 1 ))
steps=("${@:-1000 2000 4000}")
read -r -a steps <<<"${steps[*]}"
export PYTHONUNBUFFERED=1
"$py" -c "import torch, transformers; print(torch.__version__, transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
mkdir -p "$out"
pids=()
for n in "${steps[@]}"; do
  "$py" -m training.train --max-steps "$n" --out-dir "/tmp/demo_run_$n" \
    --summary-json "/tmp/demo_run_$n.json" --max-time-s "${MAX_TIME_S:-300}" ${TRAIN_ARGS:-} \
    >"$out/train_$n.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || echo "a run failed (pid $pid)"; done
best=$("$py" - "${steps[@]}" <<'PY'
import json, sys
from pathlib import Path
runs = [json.loads(Path(f"/tmp/demo_run_{n}.json").read_text()) | {"n": n}
        for n in sys.argv[1:] if Path(f"/tmp/demo_run_{n}.json").exists()]
done = [r for r in runs if not r["stopped_early"]] or runs
for r in runs:
    print(r["n"], r["stopped_early"], r["val_ppl_saved_bf16"], r["heldout_ppl_saved_bf16"],
          file=sys.stderr)
print(min(done, key=lambda r: r["val_ppl_saved_bf16"])["n"])
PY
)
echo "kept: --max-steps $best"
cp "/tmp/demo_run_$best.json" "$out/summary.json"
tar cf - -C "/tmp/demo_run_$best" . | split -b 15m - "$out/demo_model.tar."
ls -la "$out"
