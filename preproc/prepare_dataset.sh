#!/usr/bin/env bash
# Preprocess Criteo click logs into a split-binary dataset for `python -m dlrm.scripts.main`.
#
#   preproc/prepare_dataset.sh <local|spark-cpu|spark-gpu> <frequency_threshold>
#   preproc/prepare_dataset.sh <frequency_threshold> <CPU|GPU> [Spark]      (NVIDIA's form)
#
#   local      the single-machine engine (no Java needed)
#   spark-cpu  the Spark engine through run_spark_cpu.sh (local mode unless SPARK_MASTER is set)
#   spark-gpu  the Spark engine with the RAPIDS accelerator through run_spark_gpu.sh
#
# The threshold is NVIDIA's --frequency_limit: "15", or per column such as "14:3,15".
#
# NVIDIA's form runs the Spark engine (CPU: spark-cpu, GPU: spark-gpu; Spark is the default
# third argument, NVTabular is not available here) and makes NVIDIA's dataset: categorical
# values counted over every day (--vocabulary_days all, so test-day values enter the
# vocabulary), numericals rounded as NVIDIA's scripts round them (the default), train and test
# splits. It reads NVIDIA's variables too: download_dir (input, default /data/dlrm/criteo) and
# final_output_dir (output, default /data/dlrm/binary_dataset).
#
# Environment:
#   CRITEO_DIR    input: day_0 .. day_23 (plain or .gz) or the Kaggle train.txt  (default /data/criteo)
#   OUTPUT_DIR    dataset to write                       (default /data/criteo_binary_fl<threshold>)
#   SHUFFLE_SEED  shuffle the training rows with this seed (default: keep the input order)
#   PREPROC_ARGS  more flags for `python -m preproc`, e.g. "--train_days 0-3 --on_error skip"
#                 (they come last, so they win: "--vocabulary_days train" in NVIDIA's form)
#   PYTHON        the interpreter to use                 (default python3)
#
# Rerunning the same command after an interruption resumes it. Both engines write the same bytes.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

fail() {
    echo "prepare_dataset.sh: $1 (see --help)" >&2
    exit 2
}

case "${1:-}" in
    -h|--help)
        usage
        exit 0
        ;;
esac

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
extra_args=()
case "${1:-}" in
    local|spark-cpu|spark-gpu)
        [[ $# -eq 2 ]] || fail "expected <engine> <frequency_threshold>, got $# argument(s)"
        engine=$1
        threshold=$2
        input_dir=${CRITEO_DIR:-/data/criteo}
        output_dir=${OUTPUT_DIR:-/data/criteo_binary_fl${threshold//[:,]/_}}
        ;;
    *)
        if [[ $# -lt 2 || $# -gt 3 ]]; then
            fail "expected <local|spark-cpu|spark-gpu> <frequency_threshold>, or NVIDIA's <frequency_threshold> <CPU|GPU> [Spark]; got $# argument(s)"
        fi
        threshold=$1
        case "${2^^}" in
            CPU) engine=spark-cpu ;;
            GPU) engine=spark-gpu ;;
            *) fail "unknown engine '$1' (use local, spark-cpu or spark-gpu), or device '$2' (NVIDIA's form: CPU or GPU)" ;;
        esac
        case "${3:-Spark}" in
            Spark|spark) ;;
            NVTabular|nvtabular|NVTABULAR)
                fail "NVTabular is not available here; the engines are local, spark-cpu and spark-gpu (NVIDIA's form: '$1 $2 Spark')"
                ;;
            *) fail "unknown framework '$3'; NVIDIA's form takes Spark (NVTabular is not available here)" ;;
        esac
        input_dir=${CRITEO_DIR:-${download_dir:-/data/dlrm/criteo}}
        output_dir=${OUTPUT_DIR:-${final_output_dir:-/data/dlrm/binary_dataset}}
        extra_args=(--vocabulary_days all)
        ;;
esac
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

args=(--input_dir "$input_dir" --output "$output_dir" --frequency_threshold "$threshold" ${extra_args[@]+"${extra_args[@]}"})
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
esac
