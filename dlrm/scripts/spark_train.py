r"""Train on a Spark cluster: dlrm.scripts.main in one Spark task per process (TorchDistributor).

    python -m dlrm.scripts.spark_train --num_processes 2 [--spark_master local[2]] -- \
        --dataset /shared/criteo_fl15 --save_checkpoint_path /shared/ckpt --checkpoint_freq 1000 \
        --log_path /shared/log.json [any other flag of dlrm.scripts.main]

Everything after ``--`` goes to dlrm.scripts.main unchanged, once main's own code has parsed and
checked it here, before Spark starts (a bad flag: main's one-line error, exit 2).
``--save_checkpoint_path`` and ``--log_path`` are required, absolute, on storage every executor
shares; each attempt runs with ``--resume``, so when a task is lost (the barrier stage fails as
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
from dlrm.spark.dlrm_training import claim_outputs
from dlrm.spark.launch import check_flags, flag_args, parse_flag_args, script_session, train

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
    try:
        training_flags = parse_flag_args(argv[1:])
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if not training_flags:
        raise app.UsageError("give dlrm.scripts.main's flags after --, e.g. -- --dataset /shared/data "
                             "--save_checkpoint_path /shared/ckpt --log_path /shared/log.json")
    from dlrm.scripts.dlrm_flags import run_config
    from dlrm.scripts.main import check_args  # here: its flags are not this script's

    try:
        check_flags(training_flags)  # these checks run before a session starts
        claim_outputs(run_config(check_args(flag_args({**training_flags, "resume": True}))))  # what every task runs
        spark = script_session(FLAGS.spark_master, f"local[{FLAGS.num_processes}]", _conf())
        summary = train(training_flags, FLAGS.num_processes, spark=spark, use_gpu=FLAGS.use_gpu,
                        attempts=FLAGS.attempts)
    except ValueError as e:
        raise app.UsageError(re.sub(r"`(\w+)`", r"--\1", str(e))) from None  # main's flags, after --
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    cli.run(main)
