"""One warning line, before training, for a run its data cannot fill: a new user's first run on
their own small file with Criteo-sized settings took one step, reported a meaningless AUC and
exited 0 without a word. Each finding names the setting to change."""

from __future__ import annotations

from collections.abc import Sequence

MIN_STEPS_PER_EPOCH = 100  # fewer, and an epoch is over before the learning-rate warm-up is
ROWS_PER_SAMPLE = 10  # a table this many times the training samples: most of its rows never train


def small_data_warning(steps_per_epoch: int, batch_size: int, train_samples: int | None,
                       table_sizes: Sequence[int], test_samples: int | None, test_batch_size: int) -> str | None:
    """The warning for a run whose data is small for its settings, or None. ``train_samples`` and
    ``test_samples``: the splits' sizes where known (None: not checked)."""
    found = []
    if steps_per_epoch < MIN_STEPS_PER_EPOCH:
        found.append(f"an epoch is {steps_per_epoch} step{'s' * (steps_per_epoch != 1)} of `batch_size` "
                     f"{batch_size} (fewer than {MIN_STEPS_PER_EPOCH}: lower `batch_size`, or raise `epochs`)")
    if train_samples and table_sizes and max(table_sizes) > ROWS_PER_SAMPLE * train_samples:
        largest = max(range(len(table_sizes)), key=table_sizes.__getitem__)
        found.append(f"table {largest} has {table_sizes[largest]:,} rows for {train_samples:,} training samples "
                     "(most rows never train: give the tables this dataset's cardinalities in its feature spec, "
                     "or cap them with `max_table_size`)")
    if test_samples is not None and 0 < test_samples < test_batch_size:
        found.append(f"the test split's {test_samples:,} samples are fewer than one test batch of "
                     f"`test_batch_size` {test_batch_size} (its AUC is that of a few samples: lower `test_batch_size` "
                     "or test on more)")
    if not found:
        return None
    return "Warning: this run's data is small for its settings: " + "; ".join(found)
