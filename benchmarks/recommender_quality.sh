#!/usr/bin/env bash
# The recommender's documented flow end to end, as a user runs it: generate a held-out split,
# train the default (the linear model, settings chosen on validation) and each network given
# with the documented command (no --epochs: validation chooses them), then evaluate every model
# and the baselines on the held-out items. EASE's lambda is the one the default's validation
# chose for EASE (never the test split).
#
#     bash benchmarks/recommender_quality.sh WORKDIR [NETWORK.json ...]
#
# DATASET=movielens-100k takes real MovieLens-100k (fetched once, checksummed); otherwise the
# generator's MovieLens-20M-size histories, with USERS, ITEMS, INTERACTIONS to change the size.
# BASELINES (default popularity,ease,mf,itemknn), DEVICE (default: cuda if available), AMP
# (default 1) change the run. Every figure it prints is measured in this run; a rerun into the
# same WORKDIR replaces the earlier run's data, checkpoints and metrics (--overwrite; the .jsonl
# logs append).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=${1:?usage: recommender_quality.sh WORKDIR [NETWORK.json ...]}
shift
networks=("$@")
python=${PYTHON:-python3}
source_args=(--synthetic)
[ -n "${DATASET:-}" ] && source_args=(--dataset "$DATASET")
[ -n "${USERS:-}" ] && source_args+=(--users "$USERS")
[ -n "${ITEMS:-}" ] && source_args+=(--items "$ITEMS")
[ -n "${INTERACTIONS:-}" ] && source_args+=(--interactions "$INTERACTIONS")
device=()
[ -n "${DEVICE:-}" ] && device=(--device "$DEVICE")
amp=()
[ "${AMP:-1}" = 1 ] && amp=(--amp)
mkdir -p "$work"

start=$SECONDS
"$python" -m dlrm.scripts.recommender_generate "${source_args[@]}" --output "$work/data" \
    --heldout_fraction 0.2 --overwrite
echo "generate: $((SECONDS - start)) s"
t=$SECONDS
"$python" -m dlrm.scripts.recommender_train --input "$work/data/input" "${device[@]}" \
    --save_checkpoint_path "$work/default" --overwrite --log_path "$work/default.jsonl"
echo "train default: $((SECONDS - t)) s"
# EASE's best lambda on the default's validation (its trials without dropout), for the baseline.
ease_lambda=$("$python" - "$work/default.jsonl" <<'PY'
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
last = max(i for i, r in enumerate(runs) if r["type"] == "flags")
trials = [r for r in runs[last:] if r["type"] == "validation" and r["dropout"] == 0]
print(max(trials, key=lambda r: r["ndcg"])["regularization"])
PY
)
echo "EASE's lambda, chosen on the default's validation: $ease_lambda"
# The baselines fit on the CPU beside the training (on a GPU machine they overlap it entirely).
(
    t=$SECONDS
    "$python" -m dlrm.scripts.recommender_evaluate --input "$work/data/input" --heldout "$work/data/heldout" \
        --k 10,20 --baselines "${BASELINES:-popularity,ease,mf,itemknn}" --ease_lambda "$ease_lambda" \
        --output "$work/baselines.metrics.json" --overwrite >"$work/baselines.txt" 2>&1
    echo "baselines: $((SECONDS - t)) s" >>"$work/baselines.txt"
) &
baselines=$!
models=(default)
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
