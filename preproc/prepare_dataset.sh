#!/usr/bin/env bash
# Preprocess Criteo click logs into a split-binary dataset for `python -m dlrm.scripts.main`,
# in the spirit of NVIDIA's prepare_dataset.sh.
#
#   preproc/prepare_dataset.sh <local|spark-cpu|spark-gpu> <frequency_threshold>
#
#   local      the single-machine engine (no Java needed)
#   spark-cpu  the Spark engine through run_spark_cpu.sh (local mode unless SPARK_MASTER is set)
#   spark-gpu  the Spark engine with the RAPIDS accelerator through run_spark_gpu.sh
#
# The threshold is NVIDIA's --frequency_limit: "15", or per column such as "14:3,15".
#
# Environment:
#   CRITEO_DIR    input: day_0 .. day_23 (plain or .gz) or the Kaggle train.txt  (default /data/criteo)
#   OUTPUT_DIR    dataset to write                       (default /data/criteo_binary_fl<threshold>)
#   SHUFFLE_SEED  shuffle the training rows with this seed (default: keep the input order)
#   PREPROC_ARGS  more flags for `python -m preproc`, e.g. "--train_days 0-3 --on_error skip"
#   PYTHON        the interpreter to use                 (default python3)
#
# Rerunning the same command after an interruption resumes it. Both engines write the same bytes.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -eq 2 ]] || usage
engine=$1
threshold=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
input_dir=${CRITEO_DIR:-/data/criteo}
output_dir=${OUTPUT_DIR:-/data/criteo_binary_fl${threshold//[:,]/_}}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

args=(--input_dir "$input_dir" --output "$output_dir" --frequency_threshold "$threshold")
if [[ -n "${SHUFFLE_SEED:-}" ]]; then
    args+=(--shuffle_seed "$SHUFFLE_SEED")
fi
if [[ -n "${PREPROC_ARGS:-}" ]]; then
    read -r -a extra <<< "$PREPROC_ARGS"
    args+=("${extra[@]}")
fi

case "$engine" in
    local)
        exec "${PYTHON:-python3}" -m preproc --engine local "${args[@]}"
        ;;
    spark-cpu)
        exec "$here/run_spark_cpu.sh" "${args[@]}"
        ;;
    spark-gpu)
        exec "$here/run_spark_gpu.sh" "${args[@]}"
        ;;
    *)
        echo "unknown engine '$engine': use local, spark-cpu or spark-gpu" >&2
        usage
        ;;
esac
