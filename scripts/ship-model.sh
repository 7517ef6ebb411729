#!/usr/bin/env bash
# Copies a finished fwtrain run into models/pretrained/NAME: the servable files only
# (config.json, model.safetensors, MODEL_CARD.md), with a generated sample appended
# to the card, and the validation history from the run's log when given.
# Usage: scripts/ship-model.sh RUN_DIR NAME [RUN_LOG]
set -euo pipefail
cd "$(dirname "$0")/.."
run=$1
name=$2
log=${3:-}
dest=models/pretrained/$name
mkdir -p "$dest"
cp "$run/config.json" "$run/model.safetensors" "$dest/"
# Training binaries were run from copies under runs/; the command is build/tools/fwtrain.
sed -E 's#^runs/fwtrain[0-9]*\.bin #build/tools/fwtrain #; s#--out runs/[^ ]+#--out runs/'"$name"'#' \
  "$run/MODEL_CARD.md" > "$dest/MODEL_CARD.md"
sed -i "1s/.*/# $name model card/" "$dest/MODEL_CARD.md"
sample_cmd=(build/tools/fwmodel generate "$dest" --prompt "ROMEO:" --max-tokens 500 --temperature 0.8 --seed 1)
{
  echo
  echo "## Sample"
  echo
  echo "\`${sample_cmd[*]}\`"
  echo
  echo '```text'
  "${sample_cmd[@]}" 2>/dev/null
  echo '```'
  echo
  if [[ -n "$log" ]]; then
    echo "## Validation during training"
    echo
    echo '```text'
    grep -a '^step [0-9]*: train' "$log"
    echo '```'
    echo
    echo "Wall time includes sharing the machine's 2 cores with the other training runs of"
    echo "this project (2 to 3 single-threaded runs at once)."
    echo
  fi
  echo "Ship command: \`scripts/ship-model.sh RUN_DIR $name\` (copies the servable files"
  echo "and appends this sample)."
} >> "$dest/MODEL_CARD.md"
ls -la "$dest"
