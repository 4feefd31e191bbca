"""deep_ep.utils.envs: the process-group set-up DeepEP 2.x's test scripts import from its
package (init_dist, dist_print, init_seed).

DeepEP's scripts start one process per local GPU with torch.multiprocessing.spawn and call
init_dist(local_rank, num_local_ranks) in each.  The launcher's environment describes the
nodes, not the processes, as DeepEP reads it: MASTER_ADDR and MASTER_PORT (the rendezvous,
default 127.0.0.1:8361), WORLD_SIZE (the number of nodes, default 1) and RANK (this node's
index, default 0); rank node_rank * num_local_ranks + local_rank of
num_nodes * num_local_ranks.

The process group is DeepEP's: NCCL on CUDA, over a TCP rendezvous, with the device set to
local_rank.  On a torch without CUDA (deepepd's host backend) it is gloo, and no device is
set.  init_dist looks every torch function up when it runs (torch.cuda.set_device,
dist.init_process_group, dist.new_group), so that a launcher that maps them (bench/
deepep_one_gpu.py: every rank on one GPU, NCCL as gloo) maps this init_dist's calls too.
"""
from __future__ import annotations

import inspect
import os
import random
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["dist_print", "get_global_seed", "get_local_seed", "init_dist", "init_seed",
           "launcher_env"]

#: DeepEP's rendezvous when the launcher names none.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 8361

#: This process's local rank, set by init_dist (dist_print's once_in_node reads it).
_local_rank: Optional[int] = None
_global_seed = 0
_local_seed = 0


def _env_int(name: str, default: int, low: int, high: Optional[int] = None) -> int:
    """$name as an integer in [low, high] (high None: no bound), default when unset or empty;
    ValueError naming the variable otherwise."""
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer (DeepEP's init_dist reads it; "
                         f"unset it for the default, {default})") from None
    if value < low or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"${name}={value} must be {span} (DeepEP's init_dist reads it)")
    return value


def launcher_env() -> Tuple[str, int, int, int]:
    """(MASTER_ADDR, MASTER_PORT, number of nodes, this node's index) from the environment,
    as DeepEP's init_dist reads it: WORLD_SIZE and RANK count nodes, not processes."""
    addr = os.environ.get("MASTER_ADDR", "").strip() or DEFAULT_MASTER_ADDR
    port = _env_int("MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535)
    nodes = _env_int("WORLD_SIZE", 1, 1)
    node_rank = _env_int("RANK", 0, 0, nodes - 1)
    return addr, port, nodes, node_rank


def init_seed(global_seed: int) -> None:
    """Seed torch and random with global_seed plus this process's rank (DeepEP's: each rank
    draws its own inputs, reproducibly)."""
    global _global_seed, _local_seed
    _global_seed = global_seed
    _local_seed = global_seed + dist.get_rank()
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_global_seed() -> int:
    """The seed init_seed was given."""
    return _global_seed


def get_local_seed() -> int:
    """The seed init_seed gave this rank (global seed plus rank)."""
    return _local_seed


def init_dist(local_rank: int, num_local_ranks: int,
              seed: int = 0) -> Tuple[int, int, dist.ProcessGroup]:
    """Join the job's process group as DeepEP's test scripts do, and return (rank, number of
    ranks, a group of every rank).  The environment is read as the module says; the default
    dtype becomes bfloat16 and, on CUDA where torch has set_default_device, the default device
    the GPU, as DeepEP's init_dist leaves them (its scripts make tensors relying on both);
    torch and random are seeded with seed + rank (init_seed)."""
    if not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"init_dist: local_rank {local_rank} is not in [0, {num_local_ranks})")
    addr, port, nodes, node_rank = launcher_env()
    global _local_rank
    _local_rank = local_rank
    cuda = torch.cuda.is_available()
    params = {"backend": "nccl" if cuda else "gloo",
              "init_method": f"tcp://{addr}:{port}",
              "world_size": nodes * num_local_ranks,
              "rank": node_rank * num_local_ranks + local_rank}
    if cuda:
        torch.cuda.set_device(local_rank)
        # Newer torch binds NCCL to the device at init (DeepEP passes it where torch takes it).
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            params["device_id"] = torch.device(f"cuda:{local_rank}")
    dist.init_process_group(**params)
    torch.set_default_dtype(torch.bfloat16)
    if cuda and hasattr(torch, "set_default_device"):
        torch.set_default_device("cuda")
    init_seed(seed)
    group = dist.new_group(list(range(nodes * num_local_ranks)))
    return dist.get_rank(), dist.get_world_size(), group


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print s on every rank (once_in_node: on each node's local rank 0 only), then wait for
    every rank (a barrier), so that the ranks' lines come out step by step."""
    if _local_rank is None:
        raise RuntimeError("dist_print: call init_dist first (it knows this rank's node)")
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()
