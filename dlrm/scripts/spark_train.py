r"""Train on a Spark cluster: dlrm.scripts.main in one Spark task per process (TorchDistributor).

    python -m dlrm.scripts.spark_train --num_processes 2 [--spark_master local[2]] -- \
        --dataset /shared/criteo_fl15 --save_checkpoint_path /shared/ckpt --checkpoint_freq 1000 \
        --log_path /shared/log.json [any other flag of dlrm.scripts.main]

Everything after ``--`` is dlrm.scripts.main's flags, read here by main's own code into the run's
``RunConfig`` before Spark starts (a bad flag: main's one-line error, exit 2); the tasks get that
config (``dlrm.spark.dlrm_training.train``), not the flags. NVIDIA's flags that depend on the
device (``--embedding_type custom_cuda``) are resolved for the tasks' devices: CUDA with
``--use_gpu``, else the CPU (or ``--base_device``). ``--save_checkpoint_path`` and ``--log_path``
are required, absolute, on storage every executor shares; each attempt runs with ``--resume``, so when a task is lost (the barrier stage fails as
a whole) the next attempt resumes from the last checkpoint. An error main exits 2 on in the
tasks (a dataset that is not there) ends the run at once, exit 2: another attempt would fail
the same way. Under spark-submit the session is the cluster's; leave ``--spark_master`` unset.
See docs/spark.md.
"""

from __future__ import annotations

import json
import re

from absl import app, flags

from dlrm.scripts import cli
from dlrm.spark.dlrm_training import prepare, run_prepared
from dlrm.spark.launch import script_session

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", None, "Training processes, one Spark task each (with --use_gpu: GPUs).",
                     lower_bound=1)
flags.DEFINE_string("spark_master", None, "Spark master URL (local[N], spark://host:7077, yarn, k8s://...); "
                    "default: the session spark-submit made, else local[--num_processes].")
flags.DEFINE_multi_string("spark_conf", [], "Extra Spark setting KEY=VALUE, repeatable "
                          "(e.g. spark.task.resource.gpu.amount=1, spark.executor.cores=8).")
flags.DEFINE_boolean("use_gpu", False, "One GPU per process (set spark.task.resource.gpu.amount on the cluster).")
flags.DEFINE_integer("attempts", 2, "Attempts in all; each after the first resumes from the last checkpoint.",
                     lower_bound=1)
flags.mark_flags_as_required(["num_processes"])


def _conf() -> dict[str, str]:
    conf = {}
    for item in FLAGS.spark_conf:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise app.UsageError(f"--spark_conf {item!r}: expected KEY=VALUE")
        conf[key] = value
    return conf


def main(argv: list[str]) -> int:
    training_args = argv[1:]
    if not training_args:
        raise app.UsageError("give dlrm.scripts.main's flags after --, e.g. -- --dataset /shared/data "
                             "--save_checkpoint_path /shared/ckpt --log_path /shared/log.json")
    from dlrm.scripts import dlrm_flags  # here: its flags are not this script's

    values = dlrm_flags.check_args(training_args, device_type="cuda" if FLAGS.use_gpu else "cpu")
    cfg = dlrm_flags.run_config(values)  # what every task runs
    try:
        cfg = prepare(cfg)  # these checks run before a session starts
        spark = script_session(FLAGS.spark_master, f"local[{FLAGS.num_processes}]", _conf())
        summary = run_prepared(cfg, FLAGS.num_processes, spark=spark, use_gpu=FLAGS.use_gpu, attempts=FLAGS.attempts)
    except ValueError as e:
        raise app.UsageError(re.sub(r"`(\w+)`", r"--\1", str(e))) from None  # main's flags, after --
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    cli.run(main)
