"""Synthetic click data with a hidden, learnable model.

Every batch is generated on the target device from a seed derived from (seed, split, index), so
a batch is the same whenever and in whatever order it is asked for, and benchmarks are not
limited by disk. Labels come from a hidden model that depends only on the seed (and the feature
layout) and is shared by all splits, so a model trained on 'train' can be scored on 'test'.

The hidden model (see docs/synthetic_data.md) is

    logit = bias + a * linear(x) + b * id_effects(ids) + c * interactions(ids, x)

where per-id quantities (a random effect, a 4-dim vector) come from an integer hash of
(table, id) computed in torch: no per-id tables are stored, so tables with tens of millions of
rows cost no memory (``dlrm.data.hidden_model`` holds the model and its hashes). With
multi-hot features (``bag_sizes``) every id of a bag contributes: the effects and vectors of a
bag are pooled (sum / sqrt(bag size), or mean) before they enter the same formula, as an
embedding-bag model pools its embeddings.
"""

from __future__ import annotations

import operator
import os
import shutil
from collections.abc import Callable, Sequence

import torch

from dlrm.data.batch import Bags, Batch
from dlrm.data.hidden_model import ZIPF_EXPONENT, HiddenModel, _bag_config, _derive
from dlrm.engine.atomic import check_writable_dir, remove_stale_temporaries, replace_dir, temporary_name
from dlrm.engine.storage import writing

# NVIDIA's preprocessed Criteo 1TB with frequency threshold 15.
FL15_CARDINALITIES: list[int] = [
    7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11,
    2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35,
]  # fmt: skip

# MLPerf Training DLRMv2 (DLRM-DCNv2): ids per sample of each of the 26 Criteo features in its
# synthetic multi-hot dataset, and the table sizes (capped at 40M) it trains with. From
# mlcommons/training, recommendation_v2/torchrec_dlrm/README.MD (`--multi_hot_sizes`,
# `--num_embeddings_per_feature`); see docs/synthetic_data.md.
MLPERF_MULTI_HOT_SIZES: list[int] = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
]  # fmt: skip
MLPERF_DLRMV2_CARDINALITIES: list[int] = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
class SyntheticDataset:
    """A data source: __len__ and read_batch(i) -> Batch, like the on-disk reader.

    Batches are generated on `device` from a generator seeded by (seed, split, index): the same
    batch every time, independent of call order. The hidden model depends only on the seed and
    the feature layout, so 'train', 'test' and 'validation' share it but hold different samples.
    """

    def __init__(
        self,
        num_numerical: int,
        table_sizes: Sequence[int],
        num_samples: int,
        batch_size: int,
        device: torch.device | str = "cpu",
        seed: int = 12345,
        split: str = "train",
        bag_sizes: Sequence[int] | None = None,
        pooling: str | Sequence[str] = "sum",
        zipf_exponent: float = ZIPF_EXPONENT,
    ) -> None:
        """``zipf_exponent``: ids of every table are drawn with P(id) ~ (id + 1) ** -zipf_exponent."""
        if num_samples < 0 or batch_size < 1:
            raise ValueError(f"need num_samples >= 0 and batch_size >= 1, got {num_samples}, {batch_size}")
        self.num_numerical = num_numerical
        self.table_sizes = [int(s) for s in table_sizes]
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seed = seed
        self.split = split
        # Multi-hot: `bag_sizes[t]` ids per sample of table t, pooled by `pooling` (one mode, or
        # one per table); batches then carry Bags. None: one id per table, as before.
        self.bag_sizes, self.poolings = _bag_config(bag_sizes, pooling, len(self.table_sizes))
        self.hidden_model = HiddenModel(num_numerical, self.table_sizes, seed, bag_sizes=self.bag_sizes,
                                        pooling=self.poolings or "sum", zipf_exponent=zipf_exponent)
        self._id_dtype = torch.int32 if max(self.table_sizes, default=1) <= 2**31 else torch.int64

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def read_batch(self, index: int) -> Batch:
        index = operator.index(index)  # numpy integers from a shuffled batch order are fine too
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        rows = min(self.batch_size, self.num_samples - index * self.batch_size)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_derive(self.seed, self.split, index))
        if self.bag_sizes is not None:
            numerical, bags = self.hidden_model.sample_bags(rows, gen, self.device)
            logit = self.hidden_model.logit(numerical, bags)
            label = torch.rand(rows, generator=gen, device=self.device) < torch.sigmoid(logit)
            ids = Bags(bags.values.to(self._id_dtype), bags.offsets, bags.num_features)
            return Batch(numerical=numerical, categorical=ids, label=label)
        numerical, categorical = self.hidden_model.sample_features(rows, gen, self.device)
        logit = self.hidden_model.logit(numerical, categorical)
        u = torch.rand(rows, generator=gen, device=self.device)
        label = u < torch.sigmoid(logit)
        return Batch(numerical=numerical, categorical=categorical.to(self._id_dtype), label=label)

    def logits(self, batch: Batch) -> torch.Tensor:
        """The hidden model's true logits for a batch (what a perfect model would predict)."""
        return self.hidden_model.logit(batch.numerical, batch.categorical)


def write_synthetic_dataset(
    output_dir: str,
    num_numerical: int,
    table_sizes: Sequence[int],
    samples: dict[str, int],
    batch_size: int = 65536,
    seed: int = 12345,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    bag_sizes: Sequence[int] | None = None,
    pooling: str | Sequence[str] = "sum",
    bag_layout: str = "fixed",
    zipf_exponent: float = ZIPF_EXPONENT,
) -> None:
    """Write a split-binary dataset (feature_spec.yaml + one directory per split) of synthetic data.

    Split `s` holds exactly the rows of SyntheticDataset(..., split=s) on the CPU, in order. The
    dataset is built in a temporary directory beside `output_dir` and renamed into place at the
    end, so an interrupted run never leaves half a dataset, and a write the file system refuses
    (read-only, full) is a `StorageError` naming it. An existing `output_dir` is replaced only
    when it holds a dataset of this program and `overwrite` is set; anything else there is an
    `OutputError` (dlrm.engine.outputs). `progress(split, rows_done, rows)` is called after every
    batch.

    With `bag_sizes` every table is multi-hot, stored as fixed-size bags (`bag_layout="fixed"`,
    `bag_size: L` in the spec) or as values plus offsets (`bag_layout="variable"`).
    `zipf_exponent` is the ids' skew (`SyntheticDataset`'s); the spec's metadata records it
    when it is not the default, so a dataset on disk says how skewed its ids are.
    """
    from dlrm.data.feature_spec import FeatureSpec

    sizes, poolings = _bag_config(bag_sizes, pooling, len(table_sizes))
    if bag_layout not in ("fixed", "variable"):
        raise ValueError(f"`bag_layout` must be 'fixed' or 'variable', got {bag_layout!r}")

    def make_spec(staging: str) -> FeatureSpec:
        if sizes is None:
            spec = FeatureSpec.default(num_numerical, list(table_sizes), splits=tuple(samples), base_directory=staging)
        else:
            layout = sizes if bag_layout == "fixed" else ["variable"] * len(sizes)
            spec = FeatureSpec.default(num_numerical, list(table_sizes), splits=tuple(samples), base_directory=staging,
                                       bag_sizes=layout, pooling=poolings)
        spec.metadata = {"synthetic": _synthetic_metadata(seed, batch_size, sizes, zipf_exponent)}
        return spec

    _write_dataset(output_dir, make_spec, samples, num_numerical, table_sizes, sizes, poolings, batch_size, seed,
                   overwrite, progress, zipf_exponent)


def spec_generator_layout(spec) -> tuple[int, list[int], list[int] | None, list[str] | None]:
    """What the generator needs to fill a feature spec: (numerical features, table sizes, ids per
    sample of each table or None for one-hot data, pooling of each table or None), in channel
    order. A ``bag_size: variable`` feature is refused: the generator draws bags of one size."""
    sizes = spec.cardinalities
    bags = [spec.bag_size(j) for j in range(spec.num_categorical)]
    variable = [spec.categorical_names[j] for j, b in enumerate(bags) if b == "variable"]
    if variable:
        raise ValueError(f"categorical feature '{variable[0]}' has `bag_size: variable`; the generator writes "
                         f"bags of a fixed size: give it an integer `bag_size` (ids per sample)")
    if all(b is None for b in bags):
        return spec.num_numerical, sizes, None, None
    return (spec.num_numerical, sizes, [1 if b is None else int(b) for b in bags],
            [p or "sum" for p in spec.poolings])


def write_synthetic_dataset_for_spec(
    output_dir: str,
    feature_spec,
    samples: dict[str, int],
    batch_size: int = 65536,
    seed: int = 12345,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    zipf_exponent: float = ZIPF_EXPONENT,
):
    """``write_synthetic_dataset`` shaped by a feature spec (``FeatureSpec``): its features,
    names, cardinalities, dtypes, bag sizes, file paths and channel order, NVIDIA's
    ``prepare_synthetic_dataset --feature_spec``. ``samples`` gives the rows of each split to
    write (splits of the spec; those left out, or given 0 rows, are dropped from the written
    spec). Every file path of the spec must stay inside the dataset directory. Returns the spec
    written (its metadata is the given one plus a ``synthetic`` entry)."""
    import copy

    from dlrm.data.feature_spec import FeatureSpec

    unknown = [s for s in samples if s not in feature_spec.splits]
    if unknown:
        raise ValueError(f"split(s) {unknown} are not in the feature spec, whose splits are {feature_spec.splits}")
    for split in samples:
        for chunk in feature_spec.source_spec[split]:
            for path in chunk["files"]:
                normal = os.path.normpath(path)
                if os.path.isabs(path) or normal == ".." or normal.startswith(".." + os.sep):
                    raise ValueError(f"feature spec: file '{path}' of split '{split}' (feature "
                                     f"'{chunk['features'][0]}') is not inside the dataset directory; give a path "
                                     f"relative to it, without '..'")
    num_numerical, table_sizes, sizes, poolings = spec_generator_layout(feature_spec)

    def make_spec(staging: str) -> FeatureSpec:
        spec = FeatureSpec(
            feature_spec=copy.deepcopy(feature_spec.feature_spec),
            channel_spec=copy.deepcopy(feature_spec.channel_spec),
            source_spec={s: copy.deepcopy(feature_spec.source_spec[s]) for s in samples},
            metadata={**copy.deepcopy(feature_spec.metadata),
                      "synthetic": _synthetic_metadata(seed, batch_size, sizes, zipf_exponent)},
            base_directory=staging,
        )
        spec.validate()
        return spec

    return _write_dataset(output_dir, make_spec, samples, num_numerical, table_sizes, sizes, poolings, batch_size,
                          seed, overwrite, progress, zipf_exponent)


def _synthetic_metadata(seed: int, batch_size: int, bag_sizes: list[int] | None,
                        zipf_exponent: float = ZIPF_EXPONENT) -> dict:
    meta = {"seed": seed, "batch_size": batch_size, "generator": __name__}
    if bag_sizes is not None:
        meta["bag_sizes"] = list(bag_sizes)
    if zipf_exponent != ZIPF_EXPONENT:  # the default's datasets keep the spec they always had
        meta["zipf_exponent"] = float(zipf_exponent)
    return meta


def _write_dataset(output_dir, make_spec, samples, num_numerical, table_sizes, sizes, poolings, batch_size, seed,
                   overwrite, progress, zipf_exponent=ZIPF_EXPONENT):
    """The writing both entries share: staging beside ``output_dir``, a ``SplitBinaryWriter`` per
    split filled from ``SyntheticDataset``, the spec (``make_spec(staging)``) last, then the rename."""
    # Imported here: the on-disk format is only needed by this writer, not by the generator.
    from dlrm.data.split_binary_writer import SPLIT_BINARY_DATASET, SplitBinaryWriter

    output_dir = check_writable_dir(output_dir, SPLIT_BINARY_DATASET, "output_dir", overwrite, "the dataset")
    with writing(output_dir, "the dataset"):
        os.makedirs(os.path.dirname(output_dir), exist_ok=True)
        remove_stale_temporaries(output_dir)  # staging left by a run that was killed
        staging = temporary_name(output_dir)
        os.mkdir(staging)  # not mkdtemp: the dataset should get the usual permissions, not 0700
    with writing(output_dir, "the dataset", cleanup=lambda: shutil.rmtree(staging, ignore_errors=True)):
        spec = make_spec(staging)
        for split, rows in samples.items():
            source = SyntheticDataset(num_numerical, table_sizes, rows, batch_size, seed=seed, split=split,
                                      bag_sizes=sizes, pooling=poolings or "sum", zipf_exponent=zipf_exponent)
            with SplitBinaryWriter(spec, split) as writer:
                for i in range(len(source)):
                    writer.write(source.read_batch(i))
                    if progress is not None:
                        progress(split, writer.num_rows, rows)
        spec.to_yaml(os.path.join(staging, "feature_spec.yaml"))
        replace_dir(staging, output_dir, SPLIT_BINARY_DATASET, "output_dir", overwrite)
    spec.base_directory = output_dir
    return spec
