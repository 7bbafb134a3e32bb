"""Joining the process group that torchrun (or ``torch.distributed.launch --use_env``) set up."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def dist_env() -> DistEnv | None:
    """The launcher's variables, or None when the program was started as a single process."""
    if "WORLD_SIZE" not in os.environ:
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    """NCCL on GPUs, gloo on CPUs. A collective that waits longer than ``timeout_s`` (a peer died
    or hung) raises on every surviving process instead of hanging the job."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )


def join_processes(env: DistEnv | None, device: torch.device, timeout_s: float) -> None:
    """How every product's process starts: under a launcher (``env``), joins the process group;
    on CUDA, selects this process's GPU."""
    if env is not None:
        init_process_group(env, device, timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def leave_processes(env: DistEnv | None) -> None:
    """Under a launcher: waits for every process, then leaves the process group."""
    if env is not None:
        dist.barrier()
        dist.destroy_process_group()


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory one process may use: the GPU's, or an equal share of the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_world_size, 1)
