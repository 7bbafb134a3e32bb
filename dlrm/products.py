"""Which product each part of ``dlrm/`` belongs to: one entry per product.

Several products run on one engine (``dlrm/engine/``), and none imports another. This registry
is the one place that says what is whose, so that ``tests/test_layering.py`` can hold that rule
without guessing from file names: a new model is a folder of its own plus one entry here.

Plain data on purpose: importing it loads nothing else of the package (nor torch), so tests,
docs tools and packaging can read it cheaply.
"""

from __future__ import annotations

from typing import NamedTuple


class Product(NamedTuple):
    """``packages``: folders under ``dlrm/`` that are wholly the product's (``dlrm.<name>``);
    ``modules``: its modules outside those folders; ``entry_points``: its modules under
    ``dlrm/scripts/`` and ``dlrm/spark/`` (command lines, flag tables, Spark jobs)."""

    packages: tuple[str, ...]
    modules: tuple[str, ...] = ()
    entry_points: tuple[str, ...] = ()


# One entry per product. Entry points are listed one by one: a module's file name says nothing.
PRODUCTS: dict[str, Product] = {
    "dlrm": Product(("kernels", "data", "nn", "model", "distributed", "training", "inference"), ("dlrm.api",), (
        "dlrm.scripts.main", "dlrm.scripts.dlrm_flags", "dlrm.scripts.nvidia_flags", "dlrm.scripts.serving_flags",
        "dlrm.scripts.convert_checkpoint", "dlrm.scripts.deploy", "dlrm.scripts.export", "dlrm.scripts.gen_csv",
        "dlrm.scripts.prepare_synthetic_dataset", "dlrm.scripts.transcode", "dlrm.scripts.spark_score",
        "dlrm.scripts.spark_train", "dlrm.spark.dlrm_training", "dlrm.spark.dlrm_task", "dlrm.spark.score")),
    "recommender": Product(("recommender",), (), (
        "dlrm.scripts.recommender_common", "dlrm.scripts.recommender_flags", "dlrm.scripts.recommender_train",
        "dlrm.scripts.recommender_predict", "dlrm.scripts.recommender_evaluate", "dlrm.scripts.recommender_generate",
        "dlrm.scripts.spark_recommend", "dlrm.spark.recommend")),
    "wide": Product(("wide",), (), ("dlrm.scripts.wide_train",)),
}

# What every product shares, which imports the engine only (or nothing of dlrm): the package
# root and its plain modules, the command-line runner and flags made from a config's fields, and
# Spark's launcher, worker daemon and the reading and writing every Spark job does.
SHARED: tuple[str, ...] = (
    "dlrm", "dlrm.version", "dlrm.extras", "dlrm.triton_folder", "dlrm.products",
    "dlrm.scripts", "dlrm.scripts.cli", "dlrm.scripts.flag_table", "dlrm.scripts.plot",
    "dlrm.spark", "dlrm.spark.launch", "dlrm.spark.worker_daemon", "dlrm.spark.job_io",
)


def product_of(module: str) -> str | None:
    """The product that dotted ``module`` (a module of ``dlrm``) belongs to, or None for the
    engine and what the products share. A module no entry names belongs to no product."""
    parts = module.split(".")
    for name, product in PRODUCTS.items():
        if module in product.modules or module in product.entry_points:
            return name
        if len(parts) > 1 and parts[1] in product.packages:
            return name
    return None
