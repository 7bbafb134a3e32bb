"""The recommendations file (DSSTNE's predict output, ``<user>\t<item>,<score>:...``) as an
output of the output rule (``dlrm.engine.outputs``): what ``recommender_predict`` and
``spark_recommend --output_format text`` may replace. Kept apart from ``predict`` so the
commands check their outputs before torch loads."""

from __future__ import annotations

import re

from dlrm.engine.outputs import OutputKind, head_lines

# One line of ``write_predictions``: sample<TAB>item,score:item,score:... (the list may be empty).
_PREDICTION_LINE = re.compile(r"[^\t\n]*\t(?:[^\t\n,:]+,[^\t\n,:]+(?::[^\t\n,:]+,[^\t\n,:]+)*)?")


def is_predictions(path: str) -> bool:
    """Whether file ``path`` reads as this command writes it (``predict.write_predictions``): its
    first MiB, whole lines; an empty file (0 users) too."""
    lines = head_lines(path)
    if lines is None:
        return False
    try:
        return all(_PREDICTION_LINE.fullmatch(line.decode("utf-8")) for line in lines)
    except UnicodeDecodeError:
        return False


PREDICTIONS = OutputKind("predictions file", directory=False, recognise=is_predictions)
