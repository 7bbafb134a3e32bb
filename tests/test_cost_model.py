"""The step cost model against a count by hand for a tiny config (numbers worked out on paper
from the rules in dlrm/model/cost_model.py's docstring)."""

import pytest

from dlrm.model.cost_model import H100_SXM, step_cost
from dlrm.model.dlrm import DLRMConfig

TINY = DLRMConfig(2, [10, 20], 4, [4], [3, 1])  # dot interaction: n = 3, 4 + 3 = 7 -> 8 outputs


def test_one_hot_training_step_matches_a_hand_count():
    cost = step_cost(TINY, 8, compute_bytes=4)
    # 16 lookups of 4 fp32 values, [8, 2, 4] written; update: gradient read, 16 rows read + written
    assert cost.hbm_bytes["embedding gather"] == 16 * 16 + 8 * 2 * 16
    assert cost.hbm_bytes["embedding update"] == 8 * 2 * 16 + 16 * 32
    assert cost.flops["embedding gather"] == 0
    assert cost.flops["embedding update"] == 16 * 4 + 16 * 4 * 2
    assert cost.flops["interaction"] == 2 * 8 * 3 * 3 * 4 * 3
    assert cost.hbm_bytes["interaction"] == 8 * (12 + 8) * 4 * 2
    # bottom 2 -> 4; top 8 -> 3 -> 1: 2*B*in*out FLOPs forward, x3 with the backward
    assert cost.flops["bottom MLP"] == 2 * 8 * 2 * 4 * 3
    assert cost.flops["top MLP"] == 2 * 8 * (8 * 3 + 3 * 1) * 3
    assert cost.hbm_bytes["bottom MLP"] == 5 * 48 + 8 * 6 * 4 + 8 * 8 * 4
    assert cost.hbm_bytes["top MLP"] == (5 * 108 + 8 * 11 * 4 + 8 * 19 * 4) + (5 * 16 + 8 * 4 * 4 + 8 * 7 * 4)
    assert cost.pcie_bytes == 0 and cost.network_bytes == 0
    assert cost.total_flops == 192 + 1728 + 384 + 1296


def test_inference_bags_dcn_cache_and_all_to_all_match_a_hand_count():
    dcn = DLRMConfig(2, [10, 20], 4, [4], [3, 1], interaction_op="dcn", dcn_num_layers=2, dcn_low_rank_dim=2)
    cost = step_cost(dcn, 8, training=False, bag_sizes=[3, 1], compute_bytes=2)
    assert "embedding update" not in cost.hbm_bytes
    assert cost.hbm_bytes["embedding gather"] == 32 * 16 + 8 * 2 * 4 * 2
    assert cost.flops["embedding gather"] == (32 - 16) * 4
    k = 4 + 2 * 4  # bottom output and two embeddings
    assert cost.flops["interaction"] == 2 * (4 * 8 * k * 2 + 3 * 8 * k)
    assert cost.flops["top MLP"] == 2 * 8 * (k * 3 + 3)
    cached = step_cost(TINY, 8, optimizer="rowwise_adagrad", unique_rows=10, miss_rate=0.5, world_size=2)
    assert cached.pcie_bytes == 2 * 0.5 * 10 * (16 + 4)  # fetched and written back, with the accumulator
    assert cached.hbm_bytes["embedding update"] == 8 * 2 * 4 * 2 + 10 * (32 + 8)
    assert cached.network_bytes == 2 * 8 * 2 * 4 * 2 * 0.5
    assert cached.flops["bottom MLP"] == 2 * 4 * 2 * 4 * 3  # each rank's half of the batch


def test_floor_is_the_slowest_resource():
    cost = step_cost(TINY, 8)
    assert cost.floor_seconds(1e12, 1e9) == pytest.approx(cost.total_bytes / 1e9)
    assert cost.floor_seconds(1.0, 1e30) == pytest.approx(cost.total_flops)
    assert H100_SXM["hbm_bytes_per_s"] == 3.35e12
    with pytest.raises(ValueError, match="`optimizer` must be 'sgd' or 'rowwise_adagrad'"):
        step_cost(TINY, 8, optimizer="adam")
