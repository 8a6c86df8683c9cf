#!/usr/bin/env bash
# Nano v4 for ordinary pages, rebuilt from the shipped nano v1 (weights/nano) on any machine, in stages:
#
#   joint    v1 grown (nano.grown_nano: more SAM blocks, a fourth decoder layer, the Latin-1 tokenizer), trained on
#            the text and the dense per-token and per-patch losses at curriculum level 0 (40-56 px ordinary pages);
#            then continued at a lower learning rate (nano v3.1)
#   encoder  its SAM and CLIP made twice as wide (nano.widened_nano, same function), the towers alone on the dense
#            losses with the targets that read best (by line, by what a token's convs see, slots by line, two-line
#            tokens weighted)
#   decoder  the decoder alone on cached features of those frozen towers
#   encoder, continued; decoder again
#            the towers' 700 steps leave the reader at about twice the error of the towers trained for thousands
#            (docs/training.md): the towers and their heads go on for 2,000 steps more, and a decoder reads them
#   quantizer
#            the decoder so far exported, and its quantizer trained with it frozen: what would ship as the default
#   encoder and decoder on closer lines
#            the tokens holding two lines are where reading fails, and level 0 has few: both go on with the lines of
#            level 0 set closer (pages.closer_lines: the same glyphs, over twice the lines sharing a token row)
#
# Every stage resumes where it stopped, so the same command continues the chain after a stop or on a new session:
#   RUNS=/work/runs bash training/nano4.sh          # runs/ (git-ignored) by default
# A finished stage is a no-op on rerun. Figures, and the longer path this condenses, are in docs/training.md
# ("Nano v4", "Rebuilt in one chain").
#
#   BF16=        train in fp32: on a CPU without native bf16 (AVX2, no AVX512-BF16 or AMX) bf16 autocast is about
#                ten times slower than fp32, and fp32 there is about 1.5 times slower than bf16 where it is native
#   SHIP=joint   stop after the joint stage, banked (below) with a quantizer started from v1's: what a session too
#                short for the whole chain can ship; Q_PAGES and Q_STEPS size its quantizer run, Q_TEST_PAGES its test
#                (reading a held-out level-0 page takes this CPU about 6 s, uncompressed and again through the codes)
#   SHIP=joint2  the same, then the joint stage continued for J_STEPS and banked again (with the first bank's
#                quantizer as its quantizer's start)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs}
PY=${PY:-.venv/bin/python}
bf16=${BF16-"--bf16"}
# torch's CPU allocator takes transparent huge pages for its large buffers: a page fault per 2 MB, not per 4 KB
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE-1}
v1=$RUNS/nano-v1  # the chain grows from nano v1, read from the commit that shipped it (training/nano.py)
$PY -m ocr_latent.training.nano --v1-to "$v1" > /dev/null
targets=(--aux-weight 1 --order-weight 1 --order-slots 16 --head-hidden 512 --patch-weight 1
         --field-targets --line-targets --slot-lines 2 --two-line-weight 4)

# bank RUN DIR PAGES STEPS [quantizer options]: RUN as a default would ship, in DIR (named nano, so that its records
# in DIR/../manifest.json are nano/base and nano/quantizer, as `train.py ship` takes them): exported in bf16 (half
# the bytes; the quantizer is trained on the weights as stored, since the base's fingerprint includes them), its
# export tested on 64 ordinary pages of the issue's kind uncompressed; then its cross-token quantizer, trained with
# the base frozen on PAGES fresh level-0 pages encoded once (30 % of them v1's small pages), tested on 256 held-out
# level-0 pages and on v1's small pages. Each step is skipped once done (the quantizer file is written only when its
# run ends).
bank() {
  local run=$1 dir=$2 pages=$3 steps=$4; shift 4
  local manifest; manifest="$(dirname "$dir")/manifest.json"
  [ -f "$dir/.exported" ] || { $PY train.py export --run "$run" --to "$dir" --dtype bf16 --test-pages 64 --threads 2 \
    --manifest "$manifest" && touch "$dir/.exported"; }
  [ -f "$dir/quantizer.safetensors" ] || $PY train.py quantizer --base "$dir" --pages level0 --more-text \
    --cache-dir "$dir.cache" --cache-pages "$pages" --kind cross_token --width 192 --depth 2 --heads 4 --mlp-ratio 2 \
    --steps "$steps" --batch 16 --lr 1e-3 --warmup 100 --decay --weight-decay 0.01 --distill 1 --recon-weight 0.5 \
    --val-pages 32 --eval-every 250 --save-every 50 --eval-pages 256 --max-tokens 1024 --threads 2 --manifest "$manifest" "$@"
}

$PY train.py base --stage joint --grow-from "$v1" --pages level0 --more-text --out "$RUNS/v4r-joint" \
  --steps 500 --decay-from 350 --batch 8 $bf16 --threads 2 --eval-every 100 --val-pages 8 --max-tokens 1024 \
  --save-every 25 "${targets[@]}" --lr 5e-4 --warmup 50 --token-dropout 0.1 --seed 31

# the joint stage is most of the reading (validation CER 0.266 at its end, 0.165-0.23 after the widened towers and
# their decoder): a session too short for the rest ships it, its quantizer started from v1's (the same geometry; the
# grown model began as v1, so v1's codes are a start, not noise)
if [ "${SHIP:-}" = joint ] || [ "${SHIP:-}" = joint2 ]; then
  bank "$RUNS/v4r-joint" "$RUNS/joint-bank/nano" "${Q_PAGES:-2048}" "${Q_STEPS:-1000}" --init "$v1/quantizer.safetensors" \
    --eval-pages "${Q_TEST_PAGES:-256}"
  [ "$SHIP" = joint2 ] || exit 0
fi

# the joint stage goes on (v3 as shipped, its heads too) at a lower learning rate: the fp32 curve was still falling,
# and jumping, at step 500. SHIP=joint2 banks it with v3's quantizer (the bank above) as the start (nano v3.1, what a
# second short session could ship)
$PY train.py base --stage joint --init "$RUNS/v4r-joint" --heads-from "$RUNS/v4r-joint" --pages level0 --more-text \
  --out "$RUNS/v4r-joint2" --steps "${J_STEPS:-450}" --decay-from 200 --batch 8 $bf16 --threads 2 --eval-every 150 \
  --val-pages 8 --max-tokens 1024 --save-every 25 "${targets[@]}" --lr 3e-4 --warmup 30 --token-dropout 0.1 --seed 38
if [ "${SHIP:-}" = joint2 ]; then
  bank "$RUNS/v4r-joint2" "$RUNS/joint2-bank/nano" "${Q_PAGES:-2048}" "${Q_STEPS:-1000}" \
    --init "$RUNS/joint-bank/nano/quantizer.safetensors" --eval-pages "${Q_TEST_PAGES:-256}"
  exit 0
fi

$PY train.py base --stage encoder --widen-from "$RUNS/v4r-joint2" --widen sam,clip --pages level0 --out "$RUNS/v4r-enc" \
  --steps 700 --decay-from 450 --batch 8 $bf16 --threads 2 --eval-every 100 --val-pages 8 \
  --save-every 25 "${targets[@]}" --lr 7e-4 --warmup 30 --seed 32

$PY train.py base --stage decoder --init "$RUNS/v4r-enc" --pages level0 --more-text --out "$RUNS/v4r-dec" \
  --cache-pages 4096 --steps 1500 --decay-from 1000 --batch 16 $bf16 --threads 2 --eval-every 250 --val-pages 12 \
  --max-tokens 1024 --save-every 50 --lr 5e-4 --warmup 30 --token-dropout 0.1 --length-groups 8 --keep-best --seed 33

$PY train.py base --stage encoder --init "$RUNS/v4r-enc" --heads-from "$RUNS/v4r-enc" --pages level0 --out "$RUNS/v4r-enc2" \
  --steps 2000 --decay-from 1400 --batch 8 $bf16 --threads 2 --eval-every 100 --val-pages 8 \
  --save-every 25 "${targets[@]}" --lr 5e-4 --warmup 30 --seed 34

$PY train.py base --stage decoder --init "$RUNS/v4r-enc2" --decoder-from "$RUNS/v4r-dec" --pages level0 --more-text \
  --out "$RUNS/v4r-dec2" --cache-pages 4096 --steps 1500 --decay-from 1000 --batch 16 $bf16 --threads 2 \
  --eval-every 250 --val-pages 12 --max-tokens 1024 --save-every 50 --lr 5e-4 --warmup 30 --token-dropout 0.1 \
  --length-groups 8 --keep-best --seed 35

bank "$RUNS/v4r-dec2" "$RUNS/v4r-bank2/nano" 8192 2000

$PY train.py base --stage encoder --init "$RUNS/v4r-enc2" --heads-from "$RUNS/v4r-enc2" --pages level0-close \
  --out "$RUNS/v4r-enc3" --steps 1500 --decay-from 1000 --batch 8 $bf16 --threads 2 --eval-every 100 --val-pages 8 \
  --save-every 25 "${targets[@]}" --lr 5e-4 --warmup 30 --seed 36

$PY train.py base --stage decoder --init "$RUNS/v4r-enc3" --decoder-from "$RUNS/v4r-dec2" --pages level0-close --more-text \
  --out "$RUNS/v4r-dec3" --cache-pages 4096 --steps 1500 --decay-from 1000 --batch 16 $bf16 --threads 2 \
  --eval-every 250 --val-pages 12 --max-tokens 1024 --save-every 50 --lr 5e-4 --warmup 30 --token-dropout 0.1 \
  --length-groups 8 --keep-best --seed 37
