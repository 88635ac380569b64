"""Sharded runs on ``torch.distributed``, started by ``torchrun`` (one process per rank).

``torchrun --nproc-per-node N -m headprobe ablate ...`` starts N copies of the command with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment
(torch's ``env://`` rendezvous, https://pytorch.org/docs/stable/elastic/run.html). :func:`init_from_env`
joins the process group (gloo on CPU, NCCL on CUDA, one GPU per local rank); afterwards

* :func:`shard_of` gives each rank its deterministic slice of a job list (the exact sweep's heads),
  and :func:`map_sharded` runs a batched job function on each rank's slice and gathers the results
  back into job order (scan's verification head sets, prune's one-head-per-layer sets);
* :func:`batch_slice` gives each rank its contiguous slice of a batch (gradient importance), and
  :func:`all_reduce_sum` adds the ranks' partial sums;
* :func:`all_gather_objects` / :func:`broadcast_object` move small Python objects (results, a
  resumed state) between ranks;
* only rank 0 (:func:`is_main`) prints and writes the final files.

A single process (no ``WORLD_SIZE``, or ``WORLD_SIZE=1``) never imports or touches
``torch.distributed``: every helper then answers as rank 0 of 1 and does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def active() -> bool:
    """True inside a process group of more than one rank (after :func:`init_from_env`)."""
    if _env_world_size() <= 1:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 in a single process)."""
    if not active():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Number of ranks (1 in a single process)."""
    if not active():
        return 1
    import torch.distributed as dist

    return dist.get_world_size()


def is_main() -> bool:
    """True on the rank that prints and writes (rank 0; always in a single process)."""
    return rank() == 0


def init_from_env(device: str = "auto") -> bool:
    """Join the process group torchrun describes in the environment, if ``WORLD_SIZE > 1``.

    Backend: NCCL when the run is on CUDA (``device`` ``cuda``, or ``auto`` with a GPU present),
    with ``torch.cuda.set_device(LOCAL_RANK)`` so that each rank uses its own GPU; gloo on CPU.
    Idempotent. Returns whether a multi-rank group is active.

    Raises:
        HeadprobeError: ``WORLD_SIZE > 1`` without the rest of torchrun's variables, or more ranks
            on a node than it has GPUs for a CUDA run.
    """
    if _env_world_size() <= 1:
        return False
    import torch
    import torch.distributed as dist

    from headprobe.probe.core.errors import HeadprobeError

    if dist.is_initialized():
        return True
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise HeadprobeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} unset: "
            "start sharded runs with torchrun --nproc-per-node N -m headprobe ..."
        )
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        local, n_gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= n_gpus:  # NCCL needs a GPU of its own per rank
            raise HeadprobeError(
                f"torchrun started more processes on this node than its {n_gpus} GPU(s) "
                f"(local rank {local}): use --nproc-per-node {n_gpus} or less, or --device cpu"
            )
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return True


def shutdown() -> None:
    """Leave the process group (no-op in a single process)."""
    if active():
        import torch.distributed as dist

        dist.destroy_process_group()


def shard_of(jobs: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[T]:
    """Rank ``rank_``'s deterministic slice of ``jobs``: every ``world``-th job from its rank
    (round-robin, so ranks get near-equal counts and a mix of early and late layers). The slices
    of ranks ``0..world-1`` partition ``jobs``. Defaults: this process's rank and world size."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    return list(jobs[rank_::world])


def map_sharded(fn: Callable[[list[T]], Any], jobs: Sequence[T]):
    """``fn(jobs)``, computed in shards: each rank calls ``fn`` on its slice of ``jobs``
    (:func:`shard_of`), and the results -- tensors whose first axis runs over the jobs ``fn`` was
    given, ``[n_jobs_of_rank, ...]`` -- are gathered (:func:`all_gather_objects`, on the CPU) and
    put back in job order, so every rank returns ``[len(jobs), ...]`` as one process would. A rank
    with no job calls ``fn([])``, which must return an empty tensor of the same trailing shape.
    Every rank must call this with the same ``jobs``. In a single process: ``fn(list(jobs))``.
    """
    if not active():
        return fn(list(jobs))
    r, world = rank(), world_size()
    parts = all_gather_objects(fn(shard_of(jobs, r, world)).cpu())
    out = parts[0].new_empty((len(jobs), *parts[0].shape[1:]))
    for rank_, part in enumerate(parts):
        out[rank_::world] = part
    return out


def batch_slice(n: int, rank_: int | None = None, world: int | None = None) -> slice:
    """Rank ``rank_``'s contiguous slice of ``n`` batch rows (:func:`torch.tensor_split`'s sizes:
    the first ``n % world`` ranks get one more; a rank may get none when ``n < world``)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    base, extra = divmod(n, world)
    start = rank_ * base + min(rank_, extra)
    return slice(start, start + base + (1 if rank_ < extra else 0))


def all_reduce_sum(tensor):
    """Sum ``tensor`` over the ranks, in place, and return it (unchanged in a single process).
    It is moved to the group's device (CUDA for NCCL) for the reduction and back."""
    if not active():
        return tensor
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    work = tensor.to(device)
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    tensor.copy_(work.to(tensor.device))
    return tensor


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (``[obj]`` in a single process)."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``obj`` itself in a single process)."""
    if not active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if active():
        import torch.distributed as dist

        dist.barrier()
