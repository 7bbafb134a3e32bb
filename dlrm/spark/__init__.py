"""Spark jobs: training launched as a barrier stage (``launch``), batch scoring with an
exported model (``score``) and the recommender's top-K recommendations (``recommend``). The top
layer with ``dlrm.scripts``: the only part of ``dlrm`` that may import ``preproc`` (raw rows are
scored through preprocessing's own transform)."""
