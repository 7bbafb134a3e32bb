#!/usr/bin/env bash
# The Spark engine with the RAPIDS accelerator for Apache Spark (GPU SQL). Not runnable on a
# machine without NVIDIA GPUs; see docs/preprocessing.md, "Spark on GPUs".
#
#   preproc/run_spark_gpu.sh <python -m preproc flags: --input_dir ... --output ... ...>
#
# Environment, besides everything run_spark_cpu.sh reads:
#   SPARK_RAPIDS_JAR      path of the rapids-4-spark_<scala>-<version>.jar matching this Spark
#                         (the Dockerfile_spark image built with RAPIDS_VERSION sets it)   [required]
#   GPU_DISCOVERY_SCRIPT  Spark's getGpusResources.sh, for standalone/YARN/k8s executors
#   GPU_PER_TASK          share of a GPU per task: 1 / EXECUTOR_CORES                   [0.125]
#   CONCURRENT_GPU_TASKS  tasks on one GPU at once                                       [2]
#   PINNED_POOL           pinned host memory for transfers                               [4g]
#
# What runs on the GPU: reading and splitting lines, the validity regexes, group-by counts, the
# ranking window and the sort. The per-row transform (mapInArrow) runs in Python on the CPU;
# operators the plugin cannot place fall back to the CPU and are listed in the driver log
# (spark.rapids.sql.explain=NOT_ON_GPU). The output is the same bytes as on CPUs.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${SPARK_RAPIDS_JAR:?set SPARK_RAPIDS_JAR to the RAPIDS accelerator jar (see docs/preprocessing.md)}"
if [[ ! -f "$SPARK_RAPIDS_JAR" ]]; then
    echo "SPARK_RAPIDS_JAR=$SPARK_RAPIDS_JAR does not exist" >&2
    exit 2
fi

extra=(
    "spark.jars=$SPARK_RAPIDS_JAR"
    "spark.plugins=com.nvidia.spark.SQLPlugin"
    "spark.rapids.sql.enabled=true"
    "spark.rapids.sql.explain=NOT_ON_GPU"
    "spark.rapids.sql.concurrentGpuTasks=${CONCURRENT_GPU_TASKS:-2}"
    "spark.rapids.memory.pinnedPool.size=${PINNED_POOL:-4g}"
    "spark.rapids.sql.regexp.enabled=true"
    "spark.executor.resource.gpu.amount=1"
    "spark.task.resource.gpu.amount=${GPU_PER_TASK:-0.125}"
)
if [[ -n "${GPU_DISCOVERY_SCRIPT:-}" ]]; then
    extra+=("spark.executor.resource.gpu.discoveryScript=$GPU_DISCOVERY_SCRIPT")
fi
SPARK_EXTRA_CONF="${extra[*]} ${SPARK_EXTRA_CONF:-}" exec "$here/run_spark_cpu.sh" "$@"
