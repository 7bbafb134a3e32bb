"""A run's log drawn as curves, for a user without TensorBoard: every scalar TensorBoard would
get (``logger.record_scalars``: the train loss, the tests' AUC, the recommender's validation
NDCG, ...) against the step, one panel per curve. matplotlib (the ``notebook`` extra) is
imported only when drawing."""

from __future__ import annotations

import json
import math
import os

from dlrm.engine.atomic import write_atomically
from dlrm.engine.errors import DatasetError
from dlrm.engine.logger import record_scalars
from dlrm.engine.outputs import OutputKind, is_json_lines_log

Curves = dict[str, list[tuple[int, float]]]
MARK = "dlrm-engine plot"  # in every image's metadata: how a later run tells its own image from a user's
FORMATS = ("png", "svg", "pdf")


def is_plot(path: str) -> bool:
    """Whether file ``path`` is an image this program drew (its metadata holds ``MARK``)."""
    try:
        with open(path, "rb") as f:
            return MARK.encode() in f.read(1 << 24)
    except OSError:
        return False


PLOT = OutputKind("plot", directory=False, recognise=is_plot)


def image_format(path: str) -> str:
    """The format an image is written in: its suffix's, PNG without one."""
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix and suffix not in FORMATS:
        raise ValueError(f"{path}: an image is written as .png, .svg or .pdf, not .{suffix}")
    return suffix or "png"


def log_curves(path: str) -> Curves:
    """``kind/name`` -> [(step, value)] of a JSON-lines run log, in the order logged. A resumed
    run's log holds the earlier steps again after its resume: each curve keeps the last value
    logged for a step."""
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such log file")
    if not is_json_lines_log(path):
        raise DatasetError(f"{path}: not a run log of this program in its JSON-lines form (a DLLogger-form log "
                           "(`log_format` dllogger) is not drawn: log in the json form to plot)")
    curves: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DatasetError(f"{path}:{number}: not a JSON record (a log cut short? remove that line)") from None
            if isinstance(record, dict):
                values = {k: v for k, v in record.items() if k != "type"}
                for tag, value in record_scalars(str(record.get("type")), values).items():
                    curves.setdefault(tag, {})[record["step"]] = value
    return {tag: sorted(points.items()) for tag, points in curves.items()}


def plot_curves(curves: Curves, output: str, title: str = "") -> None:
    """Draws each curve in a panel of its own (two columns) into image ``output`` (``image_format``),
    written atomically, with ``MARK`` in its metadata."""
    if not curves:
        raise DatasetError("the log holds no curve: no record with a step and a number (did the run take a step?)")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    columns = 2 if len(curves) > 1 else 1
    rows = math.ceil(len(curves) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3 * rows), squeeze=False)
    for ax, (tag, points) in zip(axes.flat, sorted(curves.items())):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    kind = image_format(output)
    metadata = {"Software": MARK} if kind == "png" else {"Creator": MARK}
    try:
        write_atomically(output, lambda tmp: figure.savefig(tmp, format=kind, dpi=100, metadata=metadata), "the plot")
    finally:
        plt.close(figure)
