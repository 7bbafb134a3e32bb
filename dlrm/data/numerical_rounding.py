"""How a float64 numerical value becomes the float16 a dataset stores: the one implementation.

Two roundings (``ROUNDINGS``), both to nearest with ties to even:

- ``nvidia`` (the default): to float32 first, then to float16. NVIDIA's tools convert this way:
  their preprocessing casts Spark's float64 to float32 (``parquet_to_binary.py``) and then to
  float16 (``split_dataset.py``), and their ``transcode.py`` calls torch's float64 -> float16
  cast, which goes through float32. So this is the rounding that gives NVIDIA's bytes.
- ``direct``: once, float64 to the nearest float16.

They differ only where the float64 value lies within half a float32 step of the midpoint of two
float16 values without being on it: float32 rounds it onto the midpoint, and float16 then rounds
the tie to even, which is the far neighbour for about half of those values. The results are
then one float16 step apart, ``direct`` being the nearer to the value.

Used by the Criteo preprocessing (``preproc.numeric``; it is imported by Spark's Python workers,
so this module needs numpy only) and by the CSV transcoder (``dlrm.data.transcode``).
"""

from __future__ import annotations

import numpy as np

ROUNDINGS = ("nvidia", "direct")
DEFAULT_ROUNDING = "nvidia"


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"numerical rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    return rounding


def to_float16(values, rounding: str = DEFAULT_ROUNDING):
    """float64 value(s) -> float16 by ``rounding``: through float32 (``nvidia``) or at once (``direct``)."""
    if check_rounding(rounding) == "nvidia":
        return np.asarray(values, dtype=np.float64).astype(np.float32).astype(np.float16)
    return np.asarray(values, dtype=np.float64).astype(np.float16)
