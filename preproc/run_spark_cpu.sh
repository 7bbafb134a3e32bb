#!/usr/bin/env bash
# The Spark engine on CPUs: `python -m preproc --engine spark` with the settings below.
#
#   preproc/run_spark_cpu.sh <python -m preproc flags: --input_dir ... --output ... ...>
#
# Environment (defaults in brackets):
#   SPARK_MASTER        local[*] | spark://host:7077 | yarn | k8s://https://...   [local[*]]
#   DRIVER_MEMORY       JVM heap of the driver (all of Spark in local mode)        [16g]
#   EXECUTOR_MEMORY     heap per executor (cluster masters)                        [16g]
#   EXECUTOR_CORES      cores per executor (cluster masters)                       [8]
#   SHUFFLE_PARTITIONS  spark.sql.shuffle.partitions                              [400]
#   SPARK_LOCAL_DIRS    scratch space for shuffles and spills; needs about the size of the
#                       uncompressed input (Spark's own variable)    [the system temp directory]
#   SPARK_EXTRA_CONF    more "key=value" settings, space separated
#   PYTHON              the interpreter to use                                     [python3]
#
# On a cluster the input, the output directory and its work directory must be on storage that
# the driver and every executor see under the same path (NFS, Lustre, ...), and every node needs
# this project installed (the Dockerfile_spark image has it).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

conf=(
    --spark_conf "spark.driver.memory=${DRIVER_MEMORY:-16g}"
    --spark_conf "spark.executor.memory=${EXECUTOR_MEMORY:-16g}"
    --spark_conf "spark.executor.cores=${EXECUTOR_CORES:-8}"
    --spark_conf "spark.sql.shuffle.partitions=${SHUFFLE_PARTITIONS:-400}"
    --spark_conf "spark.driver.maxResultSize=4g"
)
for kv in ${SPARK_EXTRA_CONF:-}; do
    conf+=(--spark_conf "$kv")
done

exec "${PYTHON:-python3}" -m preproc --engine spark --spark_master "${SPARK_MASTER:-local[*]}" "${conf[@]}" "$@"
