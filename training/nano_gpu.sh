#!/usr/bin/env bash
# The shipped nano trained further toward ordinary pages on a lent GPU machine, in one device call of at most
# 10 minutes (docs/training.md, "On a GPU"): its joint stage goes on with the curriculum gated by reading (each level
# of smaller text once the level below reads under ADVANCE_AT, pages.toward_ordinary), stopped saved after TRAIN_S;
# then banked as training/nano4.sh banks a stage (bf16 export tested on ordinary pages, and its quantizer trained with
# the base frozen, started from the shipped one). What comes back is one tarball under $OUT:
#
#   device run: bash training/nano_gpu.sh      (carry .whl and .carry, timeout_s 600)
#   here:       cat nano-gpu.tgz.* | tar xz -C /work/runs/gpu && .venv/bin/python train.py ship /work/runs/gpu/bank/nano
#
# The run resumes: the same call on a machine that kept WORK goes on where it stopped.
#   TRAIN_S   seconds of training (default 240)          HEADS    a run directory whose dense-loss heads start the
#   WORKERS   processes rendering pages (CPUs less two)           stage's (the shipped model has none of its own)
#   DEVICE    cuda (cpu: a check of this script on a CPU, with the small sizes below)
#   BATCH, STEPS, EVAL_EVERY, VAL_PAGES, LEVEL_VAL_PAGES, MAX_TOKENS, Q_PAGES, Q_STEPS, TEST_PAGES: sizes (defaults
#             for one GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=${PYTHON:-.venv/bin/python}
# the lent machine's python3 has torch but not every dependency: wheels carried in .whl (docs/gpu.md says which)
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# a copy that is not installed: the package is this directory, imported as ocr_latent
if ! $py -c "import ocr_latent" 2>/dev/null; then
  link=$(mktemp -d)
  ln -s "$PWD" "$link/ocr_latent"
  export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"
fi
# the page renderer's fonts, where the machine has none (training/pages.py)
[ -d .carry/fonts ] && export OCR_LATENT_FONT_DIR="$PWD/.carry/fonts"
$py -c "import ocr_latent.train, rapidfuzz" || { echo "nano_gpu.sh: a dependency is missing (above); carry its wheel in .whl" >&2; exit 1; }
export PYTHONUNBUFFERED=1

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu-out}
WORK=${WORK:-/tmp/nano-gpu}
WORKERS=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
bf16=(--bf16)
[ "$DEVICE" = cpu ] && bf16=()  # a CPU without native bf16 runs autocast ten times slower
mkdir -p "$OUT" "$WORK/bank"
$py - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
EOF

# a step's log lines, not tqdm's redraws; a failing command shows the end of its log
export TQDM_MININTERVAL=30
logged() {
  local log=$1; shift
  "$@" > "$log" 2>&1 && status=0 || status=$?
  tr '\r' '\n' < "$log" | grep -a "^step \|stopped at\|^resuming\|test\|cer" | tail -40 || true
  [ $status = 0 ] || { tr '\r' '\n' < "$log" | tail -20; echo "nano_gpu.sh: status $status: $*" >&2; }
  return $status
}
# what comes back, whatever stage the call reached (the bank without the quantizer's run, the logs, the curve), in
# parts under 16 MiB (the most a file may have to come back from a lent machine); here: cat nano-gpu.tgz.* | tar xz
bring_back() {
  local have=()
  for f in bank joint.log export.log quantizer.log joint/train_meta.json; do [ -e "$WORK/$f" ] && have+=("$f"); done
  rm -f "$OUT"/nano-gpu.tgz.*
  tar czf - -C "$WORK" --exclude "*.run" --exclude nano.cache "${have[@]}" | split -b 15M - "$OUT/nano-gpu.tgz."
  ls -l "$OUT"
}
trap bring_back EXIT

logged "$WORK/joint.log" $py train.py base --stage joint --init weights/nano ${HEADS:+--heads-from "$HEADS"} \
  --pages nano2 --advance-at "${ADVANCE_AT:-0.2}" --level-val-pages "${LEVEL_VAL_PAGES:-8}" --more-text --out "$WORK/joint" \
  --steps "${STEPS:-1500}" --decay-from "$(( ${STEPS:-1500} * 2 / 3 ))" --batch "${BATCH:-32}" "${bf16[@]}" \
  --device "$DEVICE" --workers "$WORKERS" --threads 2 --eval-every "${EVAL_EVERY:-100}" --val-pages "${VAL_PAGES:-16}" \
  --max-tokens "${MAX_TOKENS:-2048}" --save-every 100 --aux-weight 1 --order-weight 1 --order-slots 16 --head-hidden 512 \
  --patch-weight 1 --field-targets --line-targets --slot-lines 2 --two-line-weight 4 --lr 3e-4 --warmup 50 \
  --token-dropout 0.1 --seed 39 --stop-after-s "${TRAIN_S:-240}"

# banked (training/nano4.sh's bank): bf16 export tested on ordinary pages, then its quantizer with the base frozen
[ -f "$WORK/bank/nano/.exported" ] || { logged "$WORK/export.log" $py train.py export --run "$WORK/joint" \
  --to "$WORK/bank/nano" --dtype bf16 --test-pages "${TEST_PAGES:-64}" --threads 8 --manifest "$WORK/bank/manifest.json" \
  && touch "$WORK/bank/nano/.exported"; }
# within the call's time (BUDGET_S, less a margin for the tarball); unfinished, it is trained here (nano4.sh's bank)
left=$(( ${BUDGET_S:-570} - SECONDS - 20 ))
logged "$WORK/quantizer.log" timeout $(( left > 60 ? left : 60 )) $py train.py quantizer --base "$WORK/bank/nano" --init weights/nano/quantizer.safetensors \
  --pages nano2 --more-text --cache-dir "$WORK/nano.cache" --cache-pages "${Q_PAGES:-2048}" --workers "$WORKERS" \
  --kind cross_token --width 192 --depth 2 --heads 4 --mlp-ratio 2 --steps "${Q_STEPS:-400}" --batch 16 --lr 1e-3 \
  --warmup 50 --decay --weight-decay 0.01 --distill 1 --recon-weight 0.5 --val-pages "${VAL_PAGES:-16}" \
  --eval-every 250 --save-every 50 --eval-pages "${TEST_PAGES:-64}" --max-tokens "${MAX_TOKENS:-2048}" --device "$DEVICE" --threads 2 \
  --manifest "$WORK/bank/manifest.json"
