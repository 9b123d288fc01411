#!/bin/bash
# Issue 88 part 3's measurement: the quick start under WSD, two seeds; whole-split validation loss of the last
# weights, the EMA and the mean of the last 5 checkpoints at the stable phase's end (240) and at the end (300).
cd "$(dirname "$0")/.."
mkdir -p runs
for seed in 0 1; do
  W=runs/ema_s$seed
  common="--config configs/quickstart.py --workdir $W --config.train.seed=$seed --config.optim.schedule=wsd --config.optim.ema_half_life_tokens=81920 --config.checkpoint.every_steps=10 --config.checkpoint.keep=100"
  python scripts/train.py $common > $W.train.log 2>&1
  for step in 240 300; do
    for how in "" "--config.checkpoint.read_ema=true" "--config.checkpoint.average_last=5"; do
      echo "seed $seed step $step [$how]"
      python scripts/eval.py $common --step $step $how 2>&1 | tail -2
    done
  done
done
