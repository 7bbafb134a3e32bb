"""What to preprocess and how: the settings both engines share, and what the output records.

A ``Job`` fixes the output bytes: inputs and their split rules, thresholds, malformed-line
policy, shuffle seed. Memory limits, chunk sizes, Spark settings and the engine only change
how fast and in how much memory the same bytes are produced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dlrm.data.feature_spec import FeatureSpec
from preproc.layout import InputFile, job_splits, split_ranges
from preproc.numeric import DEFAULT_ROUNDING, check_rounding
from preproc.reference import check_vocabulary_days, preprocessing_metadata

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26
DEFAULT_MEMORY_LIMIT = 4 << 30
WORK_DIR_NAME = ".preproc_work"
SHUFFLE_RULE = "train rows sorted by xxhash64(seed, (file_index << 40) | line)"


@dataclass
class Job:
    inputs: list[InputFile]
    output_dir: str
    thresholds: list[int]  # one per categorical column (C1..C26)
    on_error: str = "fail"  # "fail" or "skip"
    shuffle_seed: int | None = None
    work_dir: str | None = None  # default: <output_dir>/.preproc_work
    memory_limit: int = DEFAULT_MEMORY_LIMIT  # bytes the engine aims to stay within (besides the vocabulary)
    keep_work_dir: bool = False
    fresh: bool = False  # discard an unfinished run's work directory instead of resuming it
    extra: dict = field(default_factory=dict)  # engine settings, e.g. chunk size
    vocabulary_days: str = "train"  # whose values are counted: "train" rows, or "all" rows (NVIDIA's)
    numerical_rounding: str = DEFAULT_ROUNDING  # float64 log -> float16: "nvidia" (via float32) or "direct"
    # Splits whose rows are read (checked, and counted for vocabulary_days="all") but not written,
    # e.g. ("validation",): NVIDIA's reader wants a spec with train and test only.
    unwritten_splits: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")
        check_vocabulary_days(self.vocabulary_days)
        check_rounding(self.numerical_rounding)
        self.unwritten_splits = tuple(self.unwritten_splits)
        if "train" in self.unwritten_splits or "test" in self.unwritten_splits:
            raise ValueError(f"unwritten_splits may name 'validation' only, got {list(self.unwritten_splits)}")
        if len(self.thresholds) != NUM_CATEGORICAL:
            raise ValueError(f"need {NUM_CATEGORICAL} thresholds, got {len(self.thresholds)}")
        if not self.inputs:
            raise ValueError("no input files")

    @property
    def work_path(self) -> str:
        return self.work_dir or os.path.join(self.output_dir, WORK_DIR_NAME)

    @property
    def splits(self) -> list[str]:
        """The splits the inputs hold (each is read and checked)."""
        return job_splits(self.inputs)

    @property
    def written_splits(self) -> list[str]:
        """The splits the dataset gets: ``splits`` less ``unwritten_splits``."""
        return [s for s in self.splits if s not in self.unwritten_splits]

    @property
    def counted_splits(self) -> tuple[str, ...]:
        """The splits whose categorical values are counted for the vocabulary."""
        return ("train",) if self.vocabulary_days == "train" else tuple(self.splits)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.inputs]

    def check_inputs(self) -> None:
        missing = [f.path for f in self.inputs if not os.path.isfile(f.path)]
        if missing:
            raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")

    def identity(self, engine: str) -> dict:
        """What a resumed run must share with the interrupted one (file contents are checked per unit)."""
        inputs = [{"path": os.path.abspath(f.path), "rule": f.rule} for f in self.inputs]
        identity = {
            "format": 1,
            "engine": engine,
            "inputs": inputs,
            "thresholds": list(self.thresholds),
            "shuffle_seed": self.shuffle_seed,
            "on_error": self.on_error,
        }
        # Recorded when they differ from what a work directory made before these settings
        # existed used (train counts, one rounding), so such a directory still resumes.
        if self.vocabulary_days != "train":
            identity["vocabulary_days"] = self.vocabulary_days
        if self.numerical_rounding != "direct":
            identity["numerical_rounding"] = self.numerical_rounding
        return identity

    def ranges(self, index: int, lines: int) -> list[tuple[str, int, int]]:
        return split_ranges(self.inputs[index].rule, lines)

    def counted(self, index: int) -> bool:
        """Whether file ``index`` has lines whose values are counted (train lines, or any with
        ``vocabulary_days='all'``)."""
        return any(s in self.counted_splits for s in self.inputs[index].splits())

    def shuffled(self, split: str) -> bool:
        return split == "train" and self.shuffle_seed is not None

    def metadata(self, rows: dict[str, int], skipped: dict) -> dict:
        """The spec's ``metadata``: the reference's keys, plus the shuffle when there is one."""
        pre = preprocessing_metadata(self.thresholds, rows, self.vocabulary_days, self.numerical_rounding)
        if self.shuffle_seed is not None:
            pre["shuffle"] = {"seed": self.shuffle_seed, "order": SHUFFLE_RULE}
        meta: dict = {"preprocessing": pre}
        if skipped:
            meta["skipped_lines"] = skipped
        return meta

    def split_files(self, split: str) -> list[str]:
        return [f.path for f in self.inputs if split in f.splits()]


@dataclass
class Result:
    """What a run produced: the spec, rows per split, skipped lines and per-stage throughput."""

    spec: FeatureSpec
    rows: dict[str, int]
    skipped: dict
    stages: dict[str, dict]
    seconds: float
    resumed: bool
