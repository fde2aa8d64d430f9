"""Data parallelism on torch.distributed: one replica per rank.

Under `torchrun --nproc-per-node D harts run PLAN ...` every rank runs the
microbatches the plan placed on its replica (`replica == rank`), in slot
order. The objective already divides by the step's global denominators (read
from the plan, identical on every rank), so summing the ranks' gradients with
an all-reduce gives exactly the gradient of one process running the whole
step; losses, MoE statistics and the per-position log-probabilities are summed
the same way, and rank 0 writes the outputs. gloo on CPU, nccl on CUDA.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harts.schema.errors import HartsError


@dataclass(frozen=True, slots=True)
class DataParallel:
    rank: int
    world_size: int

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_data_parallel(plan_dp: int) -> DataParallel:
    """Join the process group torchrun set up; one rank per replica of the plan."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != plan_dp:
        raise HartsError(f"the plan was compiled for --dp {plan_dp} but torchrun started {world_size} processes; "
                         f"fix: run torchrun --nproc-per-node {plan_dp}, or recompile with --dp {world_size}")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size())


def microbatches_of_replica(plan, replica: int) -> list[int]:
    """Indices of the plan's microbatches placed on `replica`, in slot order."""
    mine = [(int(mb["slot"]), i) for i, mb in enumerate(plan.microbatches) if int(mb["replica"]) == replica]
    return [i for _, i in sorted(mine)]


def all_reduce_result(result, model) -> None:
    """Sum gradients, losses, statistics and log-probabilities over ranks, in place."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    result.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    scalars = torch.tensor([result.loss, result.objective, result.moe_aux_loss, result.moe_z_loss,
                            float(result.rows)], dtype=torch.float64)
    dist.all_reduce(scalars)
    result.loss, result.objective, result.moe_aux_loss, result.moe_z_loss = (float(x) for x in scalars[:4])
    result.rows = int(scalars[4])
    for layer in sorted(result.moe_load):
        load = torch.from_numpy(np.ascontiguousarray(result.moe_load[layer], dtype=np.float64))
        dist.all_reduce(load)
        result.moe_load[layer] = load.numpy()
    # Each trajectory lives on exactly one replica: the others hold NaN for it.
    for key in sorted(result.logprobs):
        values = torch.from_numpy(result.logprobs[key].astype(np.float64))
        present = (~torch.isnan(values)).to(torch.float64)
        stacked = torch.stack([torch.nan_to_num(values), present])
        dist.all_reduce(stacked)
        merged = torch.where(stacked[1] > 0, stacked[0], torch.full_like(stacked[0], float("nan")))
        result.logprobs[key] = merged.to(torch.float32).numpy()


def finish_data_parallel() -> None:
    """Wait for every rank, then tear the group down: a rank that exits with gloo's
    threads still alive can abort at interpreter shutdown."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
