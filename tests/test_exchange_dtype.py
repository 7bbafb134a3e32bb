"""The all-to-all carries the compute dtype under autocast: checked on real gloo processes by
recording what is handed to ``all_to_all_single`` and comparing with the fp32 exchange."""

import os

import pytest
import torch
import torch.distributed as dist

from dlrm.distributed.exchange import EmbeddingExchange
from test_distributed import free_port
from conftest import spawn

PLAN = [[1, 3], [0], [2, 4]]  # 5 tables on 3 ranks
GLOBAL_BATCH, DIM = 7, 4  # 7 samples: local batches of 3, 2, 2


def _worker(rank, world, port, out_dir, wire):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sent = []
    original = dist.all_to_all_single

    def recording(output, tensor, *args, **kwargs):
        sent.append((tensor.dtype, output.dtype))
        return original(output, tensor, *args, **kwargs)

    dist.all_to_all_single = recording
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(GLOBAL_BATCH, len(PLAN[rank]), DIM, generator=g)
    upstream = torch.randn(3 if rank == 0 else 2, 5, DIM, generator=torch.Generator().manual_seed(10 + rank))
    results = {}
    for name, dtype, autocast in (("fp32", None, False), ("amp", None, True), ("amp_fp32", torch.float32, True)):
        if wire != "all" and name != wire:
            continue
        sent.clear()
        x = local.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = EmbeddingExchange(PLAN, rank, dtype=dtype)(x)
        (out.float() * upstream).sum().backward()
        results[name] = {"out": out.detach(), "grad": x.grad, "wire": [str(d) for pair in sent for d in pair]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_autocast_exchange_sends_bf16_both_ways_and_equals_the_rounded_fp32_exchange(tmp_path):
    spawn(_worker, args=(3, free_port(), str(tmp_path), "all"), nprocs=3)
    for rank in range(3):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        fp32, amp, amp_fp32 = r["fp32"], r["amp"], r["amp_fp32"]
        assert set(fp32["wire"]) == {"torch.float32"} and set(amp_fp32["wire"]) == {"torch.float32"}
        assert set(amp["wire"]) == {"torch.bfloat16"} and len(amp["wire"]) == 4  # forward and backward
        assert amp["out"].dtype == torch.bfloat16
        # The exchange only moves values: the bf16 one delivers the fp32 one rounded, exactly.
        assert torch.equal(amp["out"], fp32["out"].to(torch.bfloat16))
        # Its gradient is the upstream one rounded to bf16 on the way back, in the input's dtype.
        assert amp["grad"].dtype == torch.float32
        assert torch.equal(amp["grad"], fp32["grad"].to(torch.bfloat16).float())
        assert torch.equal(amp_fp32["out"], fp32["out"]) and torch.equal(amp_fp32["grad"], fp32["grad"])


def test_the_exchange_dtype_is_the_compute_dtype():
    exchange = EmbeddingExchange([[0]], 0)
    x = torch.zeros(2, 1, 3)
    assert exchange.wire_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert exchange.wire_dtype(x) == torch.bfloat16
        assert EmbeddingExchange([[0]], 0, dtype=torch.float16).wire_dtype(x) == torch.float16
    assert EmbeddingExchange([[0]], 0, dtype=torch.float16).wire_dtype(x) == torch.float16
