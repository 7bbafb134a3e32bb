r"""Top-K recommendations of a trained sparse autoencoder (DSSTNE's predict).

    python -m dlrm.scripts.recommender_predict --load_checkpoint_path ckpt/ --input /data/ml20m/input \
        --features_index /data/ml20m/features_index.txt --samples_index /data/ml20m/samples_index.txt \
        --k 10 --output recs.txt
    torchrun --nproc_per_node 4 -m dlrm.scripts.recommender_predict --load_checkpoint_path ckpt/ ...

Writes DSSTNE's output, one line per user of --input, best first:

    <user>\t<item>,<score>:<item>,<score>:...

Scores are the Output layer's activations, with 6 significant digits (--score_format %.6g), so
that a user's top K rarely tie on paper; --score_format %4.3f writes them as DSSTNE did (its
-p 4.3f). The run ends with its speed on stdout: "predicted N users in S s (U users/s)".

Items of the user's own history (--input) are never recommended (--noexclude_inputs keeps
them), nor those of the --filter datasets (the same users in the same order, e.g. items already
bought). Names come from the index files of
recommender_generate; without them users and items are shown as their row and column numbers.
Under torchrun each process scores its own item range and the lists are merged exactly; the
first process writes the file. --scores_path also writes every score before exclusion, a float32
.npy of [users, items] (one process only: it is as large as users x items x 4 bytes).

An existing --output or --scores_path is replaced only with --overwrite, and only when it holds
what this command writes (a file of anything else is refused, whatever the flags say).

--load_checkpoint_path and --base_device are dlrm.scripts.main's names; --checkpoint and
--device are kept as aliases.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from dlrm.engine.outputs import OutputKind
from dlrm.recommender.prediction_file import PREDICTIONS
from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

FLAGS = flags.FLAGS
common.define_checkpoint_to_load("Checkpoint directory of recommender_train (its --save_checkpoint_path).")
flags.DEFINE_string("input", None, "CSR dataset of the users' histories to recommend for (e.g. DIR/input).")
flags.DEFINE_integer("k", 10, "Recommendations per user.", lower_bound=1)
flags.DEFINE_string("output", None, "Text file of the recommendations (DSSTNE's format), written atomically.")
flags.DEFINE_string("features_index", None, "Features (items) index for item names; default: the features_index.txt "
                    "recommender_generate wrote beside --input (DIR/ of DIR/input), else column numbers; "
                    "--features_index= for column numbers.")
flags.DEFINE_string("samples_index", None, "Samples (users) index for user names; default: the samples_index.txt "
                    "beside --input, else row numbers; --samples_index= for row numbers.")
flags.DEFINE_list("filter", [], "CSR datasets (comma-separated) of further items not to recommend, row r for "
                  "user r of --input.")
flags.DEFINE_boolean("exclude_inputs", True, "Never recommend the items of a user's own history "
                     "(--noexclude_inputs: allow them).")
flags.DEFINE_string("score_format", "%.6g", "printf format of the scores (one float conversion; the % may be left "
                    "out): %.6g, 6 significant digits, so that a user's top K rarely tie; %4.3f is DSSTNE's (its "
                    "-p 4.3f), which ties scores that differ after the 3rd decimal.")
flags.DEFINE_integer("batch_size", 1024, "Users scored at once.", lower_bound=1)
flags.DEFINE_string("scores_path", None, "Also write every raw score, before exclusion, as a float32 .npy "
                    "[users, items] (one process only).")
flags.DEFINE_boolean("overwrite", False, "Replace the --output (and --scores_path) an earlier run wrote; a file "
                     "of anything else is never replaced.")
common.define_device("Automatic mixed precision (torch.autocast, see --amp_dtype).", ["auto", "bf16", "fp16"],
                     common.AMP_DTYPE_HELP)
flags.mark_flags_as_required(["load_checkpoint_path", "input", "output"])



def _names(flag: str, count: int, exact: bool) -> list[str]:
    """``count`` names from the index file of ``flag``: the one given, else recommender_generate's
    beside --input; row/column numbers without one, said in a line."""
    from dlrm.recommender.dsstne_text import NameIndex

    name = f"{flag}.txt"
    if FLAGS[flag].present and not FLAGS[flag].value:  # --features_index= : numbers, as asked
        return [str(i) for i in range(count)]
    path, found = common.index_beside(FLAGS[flag].value, FLAGS.input, name)
    what = "users of --input" if flag == "samples_index" else "items of the checkpoint's network"
    numbers = "row numbers for users" if flag == "samples_index" else "column numbers for items"
    if not path:
        print(f"note: writing {numbers}: no --{flag}, and no {name} beside --input", flush=True)
        return [str(i) for i in range(count)]
    if not os.path.isfile(path):
        raise app.UsageError(f"--{flag} {path}: no such file")
    index = NameIndex.load(path)
    if index.size < count or (exact and index.size != count):
        if found:
            print(f"note: writing {numbers}: {path} beside --input names {index.size:,} entries, not the "
                  f"{count:,} {what}; give --{flag}", flush=True)
            return [str(i) for i in range(count)]
        raise app.UsageError(f"--{flag} {path} names {index.size:,} entries for the {count:,} {what}; give the index "
                             f"written with that dataset")
    if found:
        print(f"names of the {what.split(' of ')[0]} from {path} (beside --input)", flush=True)
    return index.labels(count)




def is_scores(path: str) -> bool:
    """Whether file ``path`` is a float32 .npy of [samples, items], as --scores_path is written."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
    except (OSError, ValueError):
        return False
    return dtype == np.float32 and len(shape) == 2


SCORES = OutputKind("scores file", directory=False, recognise=is_scores)


def _claim_outputs() -> None:
    """Before any work (dlrm.engine.outputs): each output file is new, or this program's own of
    its kind and --overwrite given; none is an input of the run or the other output."""
    from dlrm.engine.outputs import claim_output

    inputs = {"load_checkpoint_path": FLAGS.load_checkpoint_path, "input": FLAGS.input, "filter": FLAGS.filter,
              "features_index": FLAGS.features_index, "samples_index": FLAGS.samples_index}
    output = claim_output(FLAGS.output, PREDICTIONS, "output", inputs=inputs, replace=FLAGS.overwrite)
    if FLAGS.scores_path:
        scores = claim_output(FLAGS.scores_path, SCORES, "scores_path", inputs=inputs, replace=FLAGS.overwrite)
        if os.path.realpath(scores) == os.path.realpath(output):
            raise app.UsageError(f"--scores_path {FLAGS.scores_path} and --output {FLAGS.output} name the same "
                                 f"file; give each its own")


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.scores_path and env is not None and env.world_size > 1:
        raise app.UsageError("--scores_path writes one file from one process; run without torchrun to dump the "
                             "scores, or drop --scores_path")
    for flag, path in [("input", FLAGS.input)] + [("filter", p) for p in FLAGS.filter]:
        common.check_dataset_dir(flag, path)  # before torch loads: a mistyped path fails at once
    _claim_outputs()
    from dlrm.engine.atomic import check_can_create, check_free_space, write_atomically

    if env is None or env.rank == 0:  # the first process writes: a read-only or missing file system fails now
        check_can_create(FLAGS.output, "the predictions")
        if FLAGS.scores_path:
            check_can_create(FLAGS.scores_path, "the scores")
    import numpy as np

    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.predict import recommend, write_predictions

    score_format = common.score_format(FLAGS.score_format)

    device = common.device(FLAGS.base_device, env)
    amp_dtype = common.amp_dtype(FLAGS.amp, FLAGS.amp_dtype, device)
    path = checkpoint.model_path(FLAGS.load_checkpoint_path, FLAGS.best)
    n_input, n_output = checkpoint.sizes_of(path)
    inputs = common.dataset("input", FLAGS.input)
    if inputs.n_features != n_input:
        raise app.UsageError(f"--input {FLAGS.input} has {inputs.n_features:,} items, the checkpoint's model "
                             f"{n_input:,} inputs; give the dataset (and features index) it was trained on")
    filters = [common.dataset("filter", p) for p in FLAGS.filter]
    for f in filters:
        if len(f) != len(inputs):
            raise app.UsageError(f"--filter {f.path} has {len(f):,} users, --input {len(inputs):,}: they must hold the "
                                 f"same users in the same order")
    item_names = _names("features_index", n_output, exact=False)
    user_names = _names("samples_index", len(inputs), exact=True)

    common.start_processes(env, device, FLAGS.dist_timeout)
    parallel = ItemParallel.from_process_group()
    score, item_start = checkpoint.load_scorer(path, parallel, device, amp_dtype)
    if parallel.rank == 0:
        print(f"model: {checkpoint.describe(path)}", flush=True)
    first = parallel.rank == 0

    def batches(scores=None):
        done = 0

        def scored(csr):
            nonlocal done
            values = score(csr)
            if scores is not None:  # before recommend() writes -inf over the excluded items
                scores[done:done + values.shape[0]] = values.float().cpu().numpy()
                done += values.shape[0]
            return values

        return recommend(scored, inputs, FLAGS.k, FLAGS.batch_size, item_start=item_start,
                         exclude=filters, exclude_inputs=FLAGS.exclude_inputs, parallel=parallel)

    started = time.perf_counter()
    lines = 0
    if not first:
        for _ in batches():  # the collectives of the merge, in step with the first process
            pass
    elif FLAGS.scores_path:
        check_free_space(FLAGS.scores_path, len(inputs) * n_output * 4, "the scores")

        def write_scores(tmp: str) -> None:
            nonlocal lines
            scores = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                               shape=(len(inputs), n_output))
            with open(tmp, "rb+") as f:  # claim the blocks: a full disk is an error now, not a SIGBUS in the memmap
                os.posix_fallocate(f.fileno(), 0, os.path.getsize(tmp))
            lines = write_predictions(FLAGS.output, batches(scores), user_names, item_names, score_format)
            scores.flush()
            del scores

        write_atomically(FLAGS.scores_path, write_scores, "the scores")
    else:
        lines = write_predictions(FLAGS.output, batches(), user_names, item_names, score_format)
    seconds = time.perf_counter() - started
    if first:
        print(f"wrote {FLAGS.output}: {lines:,} users, top {FLAGS.k} items each from {n_output:,} "
              f"(inputs {'excluded' if FLAGS.exclude_inputs else 'allowed'}"
              f"{', ' + str(len(filters)) + ' filter(s)' if filters else ''}), {parallel.world_size} "
              f"process{'es' if parallel.world_size > 1 else ''}")
        if FLAGS.scores_path:
            print(f"wrote {FLAGS.scores_path}: float32 [{len(inputs):,}, {n_output:,}] scores")
        # Scoring, exclusion, top K and writing; loading the model and the data is not counted.
        print(f"predicted {lines:,} users in {seconds:.2f} s ({lines / max(seconds, 1e-9):,.0f} users/s)")
    common.end_processes(env)
    return 0


if __name__ == "__main__":
    cli.run(main, prefix=cli.rank_prefix)
