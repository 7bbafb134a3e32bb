#!/usr/bin/env bash
# A new user's machine: the project's wheel (built here with `pip wheel`) installed into a fresh
# venv with torch as the README installs it, no extras (so no triton, onnx, polars or pyspark);
# the quick start from another folder (so the wheel, not the checkout, is what runs), then the
# README's commands from the repository root (where `python -m` finds the checkout's packages
# first, the same code), each bounded in time and size. The test suite runs in a prepared environment and cannot see what
# this sees (a folder passing for a missing package, an extra that a base command needs).
#
#     bash .ci/bare_install.sh [WORKDIR]
#
# Exits non-zero at the first command that fails, printing its output.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-$(command -v python || command -v python3)}
if [ $# -gt 0 ]; then
    work=$1
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/dlrm-bare.XXXXXX")
    trap 'rm -rf "$work"' EXIT  # a directory of our own: gone however the check ends
fi
mkdir -p "$work"
start=$SECONDS

step() {  # description timeout_s command...: runs one command, shows its output only on failure
    local what=$1 limit=$2
    shift 2
    local t=$SECONDS
    if ! timeout "$limit" "$@" >"$work/step.log" 2>&1; then
        echo "bare install: FAILED: $what" >&2
        echo "  \$ $*" >&2
        tail -n 40 "$work/step.log" >&2
        exit 1
    fi
    echo "bare install: ok   $what ($((SECONDS - t)) s)"
}

refused() {  # description pattern command...: a command that needs an extra must say which, exit 2
    local what=$1 pattern=$2
    shift 2
    local rc=0
    timeout 120 "$@" >"$work/step.log" 2>&1 || rc=$?
    if [ "$rc" != 2 ] || ! grep -q -- "$pattern" "$work/step.log" || [ "$(grep -c . "$work/step.log")" -gt 3 ]; then
        echo "bare install: FAILED: $what: expected exit 2 and a short error naming '$pattern', got exit $rc:" >&2
        tail -n 40 "$work/step.log" >&2
        exit 1
    fi
    echo "bare install: ok   $what (exit 2: $(tail -n 1 "$work/step.log" | cut -c1-100))"
}

# The wheel, then the README's install lines with the wheel in place of the checkout.
step "pip wheel (the project's wheel)" 300 "$python" -m pip wheel -q --no-deps -w "$work/wheel" .
wheel=$(ls "$work"/wheel/dlrm_engine-*.whl)
step "the wheel holds both packages, the LICENSE and no tests" 60 "$python" -c '
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "dlrm/version.py" in names and "preproc/cli.py" in names, names[:20]
assert any(n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for n in names), names
assert not [n for n in names if n.startswith("tests/")], "tests in the wheel"
' "$wheel"
step "python -m venv" 120 "$python" -m venv "$work/venv"
py=$work/venv/bin/python
step "torch (README: the CPU build)" 600 bash .ci/install_torch.sh "$py"
step "pip install the wheel" 600 "$py" -m pip install -q "$wheel"
if "$py" -c 'import triton' 2>/dev/null && "$py" -c 'import triton.language' 2>/dev/null; then
    echo "bare install: the real triton is installed, so this is not a bare install" >&2
    exit 1
fi

# Quick start (README), shortened to 20 steps and a test of 16 batches (the check runs beside the
# test suite, on the same cores).
step "quick start (from another folder: the wheel)" 300 env --chdir "$work" "$py" -m dlrm.scripts.main --amp --batch_size 1024 --lr 1 --warmup_steps 100 \
    --synthetic_dataset_num_entries 524288 --synthetic_dataset_num_test_entries 65536 --test_freq 128 \
    --max_steps 20 --synthetic_dataset_num_test_entries 16384 --log_path "$work/quick.json"


# Usage (README): a dataset on disk, train with checkpoints, resume, test, inference benchmark.
data=$work/synthetic
step "prepare_synthetic_dataset" 120 "$py" -m dlrm.scripts.prepare_synthetic_dataset --synthetic_dataset_dir "$data" \
    --synthetic_dataset_table_sizes 1000,2000,300,40 --synthetic_dataset_num_entries 16384 --num_test_entries 4096 \
    --num_validation_entries 4096
step "train with checkpoints" 300 "$py" -m dlrm.scripts.main --dataset "$data" --amp --batch_size 1024 \
    --save_checkpoint_path "$work/ckpt" --max_steps 10 --log_path "$work/train.json"
step "resume" 300 "$py" -m dlrm.scripts.main --dataset "$data" --amp --batch_size 1024 \
    --resume --save_checkpoint_path "$work/ckpt" --max_steps 14 --log_path "$work/resume.json"
step "test a checkpoint" 120 "$py" -m dlrm.scripts.main --mode test --dataset "$data" --batch_size 1024 \
    --load_checkpoint_path "$work/ckpt" --log_path "$work/test.json"
step "inference benchmark" 120 "$py" -m dlrm.scripts.main --mode inference_benchmark --dataset "$data" \
    --load_checkpoint_path "$work/ckpt" --inference_benchmark_batch_sizes 1,64 --inference_benchmark_steps 20 \
    --log_path "$work/bench.json"
step "plan" 120 "$py" -m dlrm.scripts.main --mode plan --device_memory_gb 80 --synthetic_dataset_table_sizes 1000,2000

# Transcode a small TSV of integer features.
"$py" - "$work/tsv" <<'EOF'
import os, random, sys
os.makedirs(sys.argv[1], exist_ok=True)
for name, rows in (("train", 300), ("test", 100)):
    with open(os.path.join(sys.argv[1], f"{name}.tsv"), "w") as f:
        for _ in range(rows):
            f.write("\t".join([str(random.randint(0, 1))] + [str(random.randint(0, 9)) for _ in range(2 + 3)]) + "\n")
EOF
step "transcode" 120 "$py" -m dlrm.scripts.transcode --train "$work/tsv/train.tsv" --test "$work/tsv/test.tsv" \
    --output "$work/transcoded" --num_numerical 2 --num_categorical 3

# Two processes on the CPU (README: hybrid parallelism on a laptop), shortened.
step "torchrun, 2 CPU processes" 300 "$work/venv/bin/torchrun" --nproc_per_node 2 -m dlrm.scripts.main \
    --base_device cpu --batch_size 1024 --max_steps 5 --synthetic_dataset_num_entries 8192 \
    --synthetic_dataset_num_test_entries 2048 --log_path "$work/torchrun.json"

# The recommender (README), on a small synthetic set.
rec=$work/rec
step "recommender_generate" 120 "$py" -m dlrm.scripts.recommender_generate --synthetic --users 400 --items 300 \
    --interactions 12000 --output "$rec/data" --heldout_fraction 0.2
step "recommender_train" 300 "$py" -m dlrm.scripts.recommender_train --network configs/recommender/mult_dae.json \
    --input "$rec/data/input" --amp --checkpoint_path "$rec/ae" --max_epochs 4
step "recommender_predict" 120 "$py" -m dlrm.scripts.recommender_predict --checkpoint "$rec/ae" \
    --input "$rec/data/input" --k 10 --output "$rec/recs.txt"
step "recommender_evaluate" 300 "$py" -m dlrm.scripts.recommender_evaluate --checkpoint "$rec/ae" \
    --input "$rec/data/input" --heldout "$rec/data/heldout"
# The README's recommender flow: real MovieLens-100k, the default (linear) model, names in predict.
step "recommender_generate --dataset movielens-100k" 300 "$py" -m dlrm.scripts.recommender_generate \
    --dataset movielens-100k --data_cache "$work/cache" --output "$rec/ml100k" --heldout_fraction 0.2
step "recommender_train (default model)" 600 "$py" -m dlrm.scripts.recommender_train --input "$rec/ml100k/input" \
    --save_checkpoint_path "$rec/linear"
step "recommender_predict (default model)" 120 "$py" -m dlrm.scripts.recommender_predict \
    --load_checkpoint_path "$rec/linear" --input "$rec/ml100k/input" --k 10 \
    --features_index "$rec/ml100k/features_index.txt" --samples_index "$rec/ml100k/samples_index.txt" \
    --output "$rec/linear_recs.txt"
step "recommender_evaluate (default model)" 300 "$py" -m dlrm.scripts.recommender_evaluate \
    --load_checkpoint_path "$rec/linear" --input "$rec/ml100k/input" --heldout "$rec/ml100k/heldout"

# Commands that need an extra say which one, in one line, with exit 2.
refused "plot without the notebook extra" "pip install" "$py" -m dlrm.scripts.plot "$work/quick.json" \
    --output "$work/run.png"
refused "export without the export extra" "pip install" "$py" -m dlrm.scripts.export --checkpoint "$work/ckpt" \
    --output "$work/exported"
"$py" - "$work/criteo_raw" <<'EOF'
import os, random, sys
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], "train.txt"), "w") as f:  # Kaggle's layout: label, 13 counts, 26 hex hashes
    for _ in range(100):
        f.write("\t".join([str(random.randint(0, 1))] + [str(random.randint(0, 99)) for _ in range(13)]
                          + [f"{random.getrandbits(32):08x}" for _ in range(26)]) + "\n")
EOF
refused "preprocessing without the preproc extra" "pip install" "$py" -m preproc --input_dir "$work/criteo_raw" \
    --output "$work/criteo"
if [ -e "$work/criteo" ]; then
    echo "bare install: FAILED: the refused preprocessing run left $work/criteo behind" >&2
    exit 1
fi

# Every entry point's --help exits 0.
for module in dlrm.scripts.main dlrm.scripts.prepare_synthetic_dataset dlrm.scripts.transcode dlrm.scripts.gen_csv \
    dlrm.scripts.export dlrm.scripts.deploy dlrm.scripts.spark_train dlrm.scripts.spark_score \
    dlrm.scripts.spark_recommend dlrm.scripts.recommender_generate \
    dlrm.scripts.recommender_train dlrm.scripts.recommender_predict dlrm.scripts.recommender_evaluate preproc; do
    step "$module --help" 60 "$py" -m "$module" --help
done
echo "bare install: every command passed in $((SECONDS - start)) s"
