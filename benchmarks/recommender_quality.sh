#!/usr/bin/env bash
# The recommender's documented flow end to end, as a user runs it, on MovieLens-20M-size synthetic
# histories: generate a held-out split, train each network with the documented command (no
# --epochs: validation chooses them), then evaluate every model and the baselines on the
# held-out items.
#
#     bash benchmarks/recommender_quality.sh WORKDIR [NETWORK.json ...]
#
# USERS, ITEMS, INTERACTIONS (default: the generator's MovieLens-20M size), BASELINES
# (default popularity,ease,mf,itemknn), DEVICE (default: cuda if available), AMP (default 1)
# change the run. Every figure it prints is measured in this run; a rerun into the same WORKDIR
# replaces the earlier run's data, checkpoints and metrics (--overwrite; the .jsonl logs append).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=${1:?usage: recommender_quality.sh WORKDIR [NETWORK.json ...]}
shift
networks=("$@")
[ ${#networks[@]} -eq 0 ] && networks=(configs/recommender/movielens_tuned.json)
python=${PYTHON:-python3}
size=()
[ -n "${USERS:-}" ] && size+=(--users "$USERS")
[ -n "${ITEMS:-}" ] && size+=(--items "$ITEMS")
[ -n "${INTERACTIONS:-}" ] && size+=(--interactions "$INTERACTIONS")
device=()
[ -n "${DEVICE:-}" ] && device=(--device "$DEVICE")
amp=()
[ "${AMP:-1}" = 1 ] && amp=(--amp)
mkdir -p "$work"

start=$SECONDS
"$python" -m dlrm.scripts.recommender_generate --synthetic "${size[@]}" --output "$work/data" \
    --heldout_fraction 0.2 --overwrite
echo "generate: $((SECONDS - start)) s"
# The baselines fit on the CPU beside the training (on a GPU machine they overlap it entirely).
(
    t=$SECONDS
    "$python" -m dlrm.scripts.recommender_evaluate --input "$work/data/input" --heldout "$work/data/heldout" \
        --k 10,20 --baselines "${BASELINES:-popularity,ease,mf,itemknn}" --output "$work/baselines.metrics.json" \
        --overwrite >"$work/baselines.txt" 2>&1
    echo "baselines: $((SECONDS - t)) s" >>"$work/baselines.txt"
) &
baselines=$!
models=()
for network in "${networks[@]}"; do
    name=$(basename "$network" .json)
    t=$SECONDS
    "$python" -m dlrm.scripts.recommender_train --network "$network" --input "$work/data/input" "${amp[@]}" \
        "${device[@]}" --checkpoint_path "$work/$name" --overwrite --log_path "$work/$name.jsonl" --log_every_steps 0
    echo "train $name: $((SECONDS - t)) s"
    models+=("$name")
done
for name in "${models[@]}"; do
    "$python" -m dlrm.scripts.recommender_evaluate --checkpoint "$work/$name" --input "$work/data/input" \
        --heldout "$work/data/heldout" --k 10,20 --baselines "" "${amp[@]}" "${device[@]}" \
        --output "$work/$name.metrics.json" --overwrite | sed "s/^model /$name /"
done
wait "$baselines"
cat "$work/baselines.txt"
echo "all: $((SECONDS - start)) s"
