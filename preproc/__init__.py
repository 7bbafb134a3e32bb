"""Criteo preprocessing: raw click logs (TSV, hex hashes) -> split-binary datasets.

``python -m preproc`` (``cli``) runs one of two engines that write byte-identical datasets:
``local_engine`` (one machine, bounded memory, no Java) and ``spark_engine`` (pyspark, local mode
or a cluster). ``reference`` is the plain-Python transform that defines the output and that both
engines are tested against; ``generate`` writes synthetic logs in the Criteo format.

The shared pieces: ``layout`` (which files and lines feed which split), ``job`` (the settings
that fix the output), ``parse`` (vectorised line parsing), ``numeric`` (the float16 log table),
``vocab`` and ``counting`` (ids by descending frequency), ``order`` (row positions and the
seeded shuffle), ``fragments`` and ``assemble`` (the final write), ``workdir`` (resume state),
``report`` (malformed lines) and ``progress``. See docs/preprocessing.md.
"""

import dlrm  # noqa: F401,E402  (first: hides the repository's triton/ folder from torch, see dlrm/triton_folder.py)

