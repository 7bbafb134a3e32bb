r"""Draw a run's log as curves, without TensorBoard: the loss, the tests' AUC, the throughput
(DLRM), the validation metrics (the recommender), each against the step.

    python -m dlrm.scripts.plot log.json --output run.png
    python -m dlrm.scripts.plot log.json --output run.svg --tags train/loss,eval/auc

Reads the JSON-lines log that --log_path writes (the default form); needs matplotlib
(pip install -e ".[notebook]"). --output must not exist unless --overwrite.
"""

from __future__ import annotations

import os

from absl import app, flags

from dlrm.engine.log_plot import log_curves, plot_curves
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("output", "run.png", "The image to write; its suffix gives the format (.png, .svg, .pdf).")
flags.DEFINE_list("tags", [], "Curves to draw, as kind/name (e.g. train/loss,eval/auc); default: every curve.")
flags.DEFINE_boolean("overwrite", False, "Replace --output if it exists.")

_FORMATS = (".png", ".svg", ".pdf")


def main(argv: list[str]) -> int:
    logs = argv[1:]
    if len(logs) != 1:
        raise app.UsageError("give one log file: python -m dlrm.scripts.plot LOG --output run.png")
    output = FLAGS.output
    if os.path.splitext(output)[1].lower() not in _FORMATS:
        raise app.UsageError(f"--output {output}: name a .png, .svg or .pdf file")
    if os.path.exists(output) and not FLAGS.overwrite:
        raise app.UsageError(f"--output {output} exists: pass --overwrite to replace it, or name another file")
    if os.path.isdir(output):
        raise app.UsageError(f"--output {output} is a folder: name an image file")
    curves = log_curves(logs[0])
    if FLAGS.tags:
        unknown = [t for t in FLAGS.tags if t not in curves]
        if unknown:
            raise app.UsageError(f"--tags {','.join(unknown)}: not in {logs[0]}, which has {', '.join(sorted(curves))}")
        curves = {t: curves[t] for t in FLAGS.tags}
    plot_curves(curves, output, title=os.path.basename(logs[0]))
    print(f"Wrote {len(curves)} curve{'s' * (len(curves) != 1)} of {logs[0]} to {output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
