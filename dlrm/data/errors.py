"""Exceptions for bad datasets.

Both derive from ValueError so callers that only know "the input was wrong" can catch them,
while the training script can catch DatasetError alone and print its message without a
traceback: every message names the file, the feature and the fix.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """Dataset files or their contents do not match the feature spec."""


class FeatureSpecError(DatasetError):
    """The feature spec itself is malformed or inconsistent."""
