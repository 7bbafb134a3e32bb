#!/usr/bin/env bash
# Every GPU check and measurement docs/benchmarks.md lists, in one command, each stage
# time-boxed so that one hang does not cost the others:
#
#     bash benchmarks/gpu_suite.sh LOGDIR [STAGE...]
#
# Stages (all by default, in this order): env, tests, kernels, steps, cli, dlrmv2, inference,
# recommender, recommender_fit, host_cache. All of them take longer than one short loan of a device; the figures
# the open GPU goals ask for come first with (the code not yet run on a GPU checked first)
#
#     GPU_TESTS="tests/test_kernel_linear_relu.py tests/test_multi_hot_graphs.py tests/test_cli_multi_hot.py
#         tests/test_cached_embedding.py" \
#         bash benchmarks/gpu_suite.sh LOGDIR env tests cli dlrmv2 host_cache
#
# Each writes LOGDIR/<stage>.log; a summary of exit codes goes to the end of stdout.
# TESTS_LIMIT, KERNELS_LIMIT, STEPS_LIMIT, CLI_LIMIT, DLRMV2_LIMIT, INFERENCE_LIMIT, RECOMMENDER_LIMIT,
# RECOMMENDER_FIT_LIMIT, HOST_CACHE_LIMIT override a stage's time box (seconds); GPU_TESTS names the test files of the
# tests stage (default: every file with a `gpu` test).
# Runs from a checkout without installing it (PYTHONPATH), on a machine whose python already
# has a CUDA build of torch and triton.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
logdir=${1:?usage: gpu_suite.sh LOGDIR [STAGE...]}
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests kernels steps cli dlrmv2 inference recommender recommender_fit host_cache)
mkdir -p "$logdir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
summary=()

run_stage() {  # name timeout_s command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $*" | tee "$logdir/$name.log"
    timeout "$limit" "$@" >>"$logdir/$name.log" 2>&1
    local rc=$?
    summary+=("$name rc=$rc $((SECONDS - start))s")
    tail -n 25 "$logdir/$name.log"
}

gpu_tests=${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/*.py)}  # GPU_TESTS: some files first
fl15=$("$python" -c 'from dlrm.data.synthetic import FL15_CARDINALITIES as f; print(",".join(map(str, f)))')

# Inference on FL15 shapes at the batch sizes NVIDIA publishes, one process per backend (fastest
# first, the TorchScript export of the 16.7 GB model last, since it is the slowest to set up).
inference_runs() {
    local common=(--dataset_type synthetic --synthetic_dataset_table_sizes "$fl15"
        --synthetic_dataset_num_entries 262144 --synthetic_dataset_num_test_entries 262144
        --mode inference_benchmark --inference_benchmark_batch_sizes 1,64,4096,32768
        --inference_benchmark_steps 200 --log_path /dev/null)
    "$python" -m dlrm.scripts.main "${common[@]}" --amp --embedding_type joint_fused --interaction_op cuda_dot --cuda_graphs
    "$python" -m dlrm.scripts.main "${common[@]}" --amp --embedding_type joint_fused --interaction_op cuda_dot
    # row-wise quantized tables (the Triton dequantize-gather kernel), int8 and int4
    "$python" -m dlrm.scripts.main "${common[@]}" --amp --interaction_op cuda_dot --cuda_graphs --quantize_tables int8
    "$python" -m dlrm.scripts.main "${common[@]}" --amp --interaction_op cuda_dot --cuda_graphs --quantize_tables int4
    "$python" -m dlrm.scripts.main "${common[@]}"
    "$python" -m dlrm.scripts.main "${common[@]}" --inference_benchmark_backend torchscript
}
# MLPerf DLRMv2 at full size: MLPerf's 40M-capped cardinalities (204M rows, 48.7 GiB stored
# bf16), 214 ids a sample in 26 multi-hot bags, DCNv2, row-wise Adagrad, batch 65536, bf16 AMP;
# the whole step as a CUDA graph (padded bags), then the same eagerly. The run prints samples/s;
# benchmarks/roofline.py gives the floor it is held to.
dlrmv2_runs() {
    local common=(--preset mlperf_dlrmv2 --embedding_type joint_fused --embedding_dtype bf16
        --batch_size 65536 --amp --amp_dtype bfloat16 --synthetic_dataset_num_entries $((65536 * 130))
        --synthetic_dataset_num_test_entries 65536 --max_steps 130 --benchmark_warmup_steps 30
        --log_path /dev/null)
    "$python" -m dlrm.scripts.main "${common[@]}" --cuda_graphs
    "$python" -m dlrm.scripts.main "${common[@]}"
}
export -f inference_runs dlrmv2_runs
export fl15 python

for stage in "${stages[@]}"; do
    case $stage in
    env)
        run_stage env 60 bash -c "nvidia-smi; git log -1 --format='commit %H %cd' 2>/dev/null;
            $python -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__,
            torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, \"SMs\")'" ;;
    tests)
        # shellcheck disable=SC2086
        run_stage tests "${TESTS_LIMIT:-420}" "$python" -m pytest -m gpu -q -p no:cacheprovider $gpu_tests ;;
    kernels)
        run_stage kernels "${KERNELS_LIMIT:-240}" "$python" benchmarks/kernels.py --device cuda ;;
    steps)
        # FL15 steps per precision and variant; then what the fused MLP layers give (bf16, graphed
        # with and without them); then the MLPerf DLRMv2 shape (10M cap) graphed against eager,
        # with full bags (one graph) and with 30% of the ids dropped (padded into buckets)
        run_stage steps "${STEPS_LIMIT:-420}" bash -c "$python benchmarks/train_step.py --device cuda &&
            $python benchmarks/train_step.py --device cuda --precisions bf16 --variants plain_mlp,graphs &&
            $python benchmarks/train_step.py --device cuda --multi_hot --max_table_size 10000000 \
                --precisions bf16 --variants kernels,graphs &&
            $python benchmarks/train_step.py --device cuda --multi_hot --max_table_size 10000000 \
                --precisions bf16 --variants kernels,graphs --ragged 0.3" ;;
    cli)
        run_stage cli "${CLI_LIMIT:-300}" "$python" -m dlrm.scripts.main --dataset_type synthetic \
            --synthetic_dataset_table_sizes "$fl15" --synthetic_dataset_num_entries $((65536 * 600)) \
            --synthetic_dataset_num_test_entries $((65536 * 4)) --batch_size 65536 --amp \
            --embedding_type joint_fused --interaction_op cuda_dot --cuda_graphs \
            --benchmark_warmup_steps 50 --max_steps 500 --log_path "$logdir/cli_log.json" ;;
    dlrmv2)
        run_stage dlrmv2 "${DLRMV2_LIMIT:-420}" bash -c dlrmv2_runs ;;
    inference)
        run_stage inference "${INFERENCE_LIMIT:-420}" bash -c inference_runs ;;
    recommender)
        # MovieLens-20M-size synthetic histories: quality after 2 epochs and training/predict users/s
        run_stage recommender "${RECOMMENDER_LIMIT:-300}" "$python" benchmarks/recommender.py --device cuda \
            --baselines "" ;;
    recommender_fit)
        # The linear default's whole fit (search and refit) beside one plain EASE solve, on the GPU,
        # on MovieLens-20M-size synthetic histories (docs/benchmarks.md's CPU table, same script)
        run_stage recommender_fit "${RECOMMENDER_FIT_LIMIT:-420}" bash -c "$python -m dlrm.scripts.recommender_generate \
            --synthetic --output '$logdir/ml20m' --heldout_fraction 0.2 --overwrite &&
            $python benchmarks/recommender_fit_time.py '$logdir/ml20m/input' --device cuda" ;;
    host_cache)
        # Tables larger than device memory (issue 28, item 4): the cached run is held to 16 GiB of
        # HBM and trains 32 GiB of FL15-shaped fp32 tables (twice its HBM) kept in pinned host
        # memory behind a cache of a quarter of their rows; the same model at half size (16 GiB)
        # trains all in HBM; then the hit rate against cache size for the same ids; then auto
        # sizing, prefetch and dirty tracking side by side, and the victims' selection
        run_stage host_cache "${HOST_CACHE_LIMIT:-420}" bash -c "$python benchmarks/host_cache.py train --device cuda \
            --table_gib 32 --hbm_gib 16 --cache_fraction 0.25 --batch_size 65536 --steps 30 &&
            $python benchmarks/host_cache.py hit_rate --table_gib 32 --batch_size 65536 --steps 100 &&
            $python benchmarks/host_cache.py features --device cuda --table_gib 8 --cache_fraction 0.05 \
                --batch_size 65536 --steps 30 &&
            $python benchmarks/host_cache.py victims --device cuda --slots 10000000 --misses 1000,50000,500000" ;;
    *)
        echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
printf '%s\n' "${summary[@]}"
