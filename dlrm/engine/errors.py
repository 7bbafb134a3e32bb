"""Exceptions for bad inputs: datasets, their feature specs, and checkpoints.

All derive from ValueError so callers that only know "the input was wrong" can catch them,
while the command lines catch each alone and print its message without a traceback: every
message names the file, the feature or tensor, and the fix.
"""

from __future__ import annotations

import math


class DatasetError(ValueError):
    """Dataset files or their contents do not match the feature spec."""


class FeatureSpecError(DatasetError):
    """The feature spec itself is malformed or inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged, or of another model. Here, not in the
    checkpoint store, so that the checks on what a checkpoint holds (``tensor_checks``) and the
    store can both raise it without importing each other."""


def finite_number(text: str) -> float | None:
    """``text`` as a float, or None when it is not a finite number (nan, inf or not a number):
    readers of text data refuse those with a message naming the field."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
