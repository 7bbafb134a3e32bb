"""The roofline of the GPU figures in docs/benchmarks.md: for each, the bytes and FLOPs of one
step (dlrm/model/cost_model.py), the floor on one H100 SXM (max of bytes / HBM bandwidth and
FLOPs / tensor-core peak) and the share of it a measured figure reaches.

    python benchmarks/roofline.py              # FL15 and MLPerf DLRMv2 shapes, batch 65536

The distinct rows a step updates are counted on one synthetic batch (the generator's power law),
on the CPU; the measured rates are the ones recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import torch

from dlrm.data.synthetic import (FL15_CARDINALITIES, MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES,
                                 SyntheticDataset)
from dlrm.model.cost_model import H100_SXM, step_cost
from dlrm.model.dlrm import DLRMConfig

H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet (HBM3e); same tensor-core peaks as H100 SXM


def unique_rows(tables: list[int], batch: int, bag_sizes: list[int] | None) -> int:
    data = SyntheticDataset(1, tables, batch, batch, seed=1, bag_sizes=bag_sizes)
    ids = data.read_batch(0).categorical
    if bag_sizes is None:
        return sum(int(torch.unique(ids[:, t]).numel()) for t in range(len(tables)))
    bounds = ids.offsets[::batch].tolist()
    return sum(int(torch.unique(ids.values[bounds[t]:bounds[t + 1]]).numel()) for t in range(len(tables)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=65536)
    args = parser.parse_args()
    b = args.batch_size
    fl15 = DLRMConfig(13, list(FL15_CARDINALITIES), embedding_type="joint_fused", interaction_op="cuda_dot")
    capped = [min(n, 10_000_000) for n in MLPERF_DLRMV2_CARDINALITIES]
    v2 = DLRMConfig(13, capped, bottom_mlp_sizes=[512, 256, 128], top_mlp_sizes=[1024, 1024, 512, 256, 1],
                    interaction_op="dcn", embedding_type="joint_fused")
    full = DLRMConfig(13, list(MLPERF_DLRMV2_CARDINALITIES), bottom_mlp_sizes=[512, 256, 128],
                      top_mlp_sizes=[1024, 1024, 512, 256, 1], interaction_op="dcn", embedding_type="joint_fused")
    u_fl15 = unique_rows(list(FL15_CARDINALITIES), b, None)
    u_v2 = unique_rows(capped, b, list(MLPERF_MULTI_HOT_SIZES))
    u_full = unique_rows(list(MLPERF_DLRMV2_CARDINALITIES), b, list(MLPERF_MULTI_HOT_SIZES))
    print(f"distinct rows a step: FL15 {u_fl15:,} of {b * 26:,} lookups; DLRMv2 {u_v2:,} of "
          f"{b * sum(MLPERF_MULTI_HOT_SIZES):,} (10M cap), {u_full:,} (40M cap)")
    # (figure, config, training, bag sizes, compute bytes, optimizer, peak, measured samples/s, HBM bytes/s)
    rows = [
        ("FL15 train, bf16, kernels + graphs (H100, 1st run)", fl15, True, None, 2, "sgd", "bf16_flops", 12_212_919),
        ("FL15 train, bf16, kernels + graphs (H100, 2nd run)", fl15, True, None, 2, "sgd", "bf16_flops", 12_550_524),
        ("FL15 train, fp16, kernels + graphs (H100, 2nd run)", fl15, True, None, 2, "sgd", "fp16_flops", 10_193_915),
        ("FL15 train, fp32 (TF32), kernels + graphs (H100, 2nd run)", fl15, True, None, 4, "sgd", "tf32_flops",
         7_364_976),
        ("FL15 train through the CLI, bf16 (H100, 2nd run)", fl15, True, None, 2, "sgd", "bf16_flops", 11_681_163),
        ("MLPerf DLRMv2 shape, 10M cap, bf16, joint_fused (H100)", v2, True, list(MLPERF_MULTI_HOT_SIZES), 2,
         "rowwise_adagrad", "bf16_flops", 1_245_542),
        ("FL15 inference, fp16 CUDA graphs, batch 32768 (H200)", fl15, False, None, 2, "sgd", "fp16_flops",
         49_526_231),
        ("FL15 inference, fp16 CUDA graphs, batch 4096 (H200)", fl15, False, None, 2, "sgd", "fp16_flops",
         23_126_487),
    ]
    # Goals not yet measured: the floor they are held to, and the share of it the goal would be.
    goals = [
        ("MLPerf DLRMv2 at full size (40M cap, bf16 tables), goal 2.5 M samples/s (H100)", full,
         list(MLPERF_MULTI_HOT_SIZES), 2_500_000),
    ]
    for name, config, bags, goal in goals:
        cost = step_cost(config, b, True, bags, compute_bytes=2, table_bytes=2, optimizer="rowwise_adagrad",
                         unique_rows=u_full)
        memory, compute = cost.total_bytes / H100_SXM["hbm_bytes_per_s"], cost.total_flops / H100_SXM["bf16_flops"]
        floor, step = max(memory, compute), b / goal
        print(f"{name}: {cost.total_bytes / 1e9:.2f} GB and {cost.total_flops / 1e9:.0f} GFLOP a step, floor "
              f"{floor * 1e3:.3f} ms (memory {memory * 1e3:.3f} / compute {compute * 1e3:.3f}); the goal's "
              f"{step * 1e3:.3f} ms a step is {floor / step:.0%} of the roofline")
    print("| figure | GB a step | GFLOP a step | floor ms (memory / compute) | measured ms | of roofline |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, config, training, bags, cb, optimizer, peak, measured in rows:
        batch = b if training else int(name.rsplit("batch ", 1)[1].split(" ")[0])
        unique = (u_v2 if bags else u_fl15) * (batch / b if not training else 1)
        cost = step_cost(config, batch, training, bags, compute_bytes=cb, optimizer=optimizer, unique_rows=unique)
        hbm = H200_HBM_BYTES_PER_S if "H200" in name else H100_SXM["hbm_bytes_per_s"]
        memory, compute = cost.total_bytes / hbm, cost.total_flops / H100_SXM[peak]
        floor, step = max(memory, compute), batch / measured
        print(f"| {name} | {cost.total_bytes / 1e9:.2f} | {cost.total_flops / 1e9:.0f} | {floor * 1e3:.3f} "
              f"({memory * 1e3:.3f} / {compute * 1e3:.3f}) | {step * 1e3:.3f} | {floor / step:.0%} |")


if __name__ == "__main__":
    main()
