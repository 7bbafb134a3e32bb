r"""Draw a run's log as curves, without TensorBoard: the loss, the tests' AUC, the throughput
(DLRM), the validation metrics (the recommender), each against the step.

    python -m dlrm.scripts.plot log.json --output run.png
    python -m dlrm.scripts.plot log.json --output run.svg --tags train/loss,eval/auc

Reads the JSON-lines log that --log_path writes (the default form); needs matplotlib
(pip install -e ".[notebook]"). --output is a new file, or with --overwrite an image this
command drew before (never a file of anyone else's).
"""

from __future__ import annotations

import os

from absl import app, flags

from dlrm.engine.log_plot import PLOT, image_format, log_curves, plot_curves
from dlrm.engine.outputs import claim_output
from dlrm.engine.storage import check_can_create
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("output", "run.png", "The image to write; its suffix gives the format (.png, .svg, .pdf; "
                    "none: PNG).")
flags.DEFINE_list("tags", [], "Curves to draw, as kind/name (e.g. train/loss,eval/auc); default: every curve.")
flags.DEFINE_boolean("overwrite", False, "Replace --output when it is an image this command drew before.")


def main(argv: list[str]) -> int:
    logs = argv[1:]
    if len(logs) != 1:
        raise app.UsageError("give one log file: python -m dlrm.scripts.plot LOG --output run.png")
    try:
        image_format(FLAGS.output)
    except ValueError as e:
        raise app.UsageError(f"--output {e}") from None
    # Before any work (dlrm.engine.outputs): a new file, or this command's own image with --overwrite.
    output = claim_output(FLAGS.output, PLOT, "output", inputs={"log": logs[0]}, replace=FLAGS.overwrite)
    check_can_create(output, "the plot")
    curves = log_curves(logs[0])
    if FLAGS.tags:
        unknown = [t for t in FLAGS.tags if t not in curves]
        if unknown:
            raise app.UsageError(f"--tags {','.join(unknown)}: not in {logs[0]}, which has {', '.join(sorted(curves))}")
        curves = {t: curves[t] for t in FLAGS.tags}
    plot_curves(curves, output, title=os.path.basename(logs[0]))
    print(f"Wrote {len(curves)} curve{'s' * (len(curves) != 1)} of {logs[0]} to {FLAGS.output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
