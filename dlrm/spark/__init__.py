"""Spark jobs: training launched as a barrier stage (``launch``) and batch scoring with an
exported model (``score``). The top layer with ``dlrm.scripts``: the only part of ``dlrm`` that
may import ``preproc`` (raw rows are scored through preprocessing's own transform)."""
