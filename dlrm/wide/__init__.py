"""A wide logistic model trained hybrid-parallel through the engine: the small third model that
docs/adding_a_model.md builds, kept here as its working proof.

``logit = bias + sum over fields of weight[id]``: one weight per id of every field, the id space
split by rows across processes (``dlrm.engine.partition``), the bias replicated. It uses the
engine's seams and nothing of the other products: the model contract, the all-to-all, the run
loop, the checkpoint store, random streams keyed by row block.
"""
