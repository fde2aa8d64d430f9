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

from harts.executor.runtime import trainable_gradients
from harts.schema.errors import HartsError


@dataclass(frozen=True, slots=True)
class DataParallel:
    rank: int
    world_size: int

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True under torchrun, even with one process (a plan's replicas must then match the processes,
    not silently run in one), and under any launcher that starts several processes.

    torchrun marks its workers with TORCHELASTIC_RUN_ID; a lone process that merely
    inherits RANK=0, WORLD_SIZE=1 from an RL framework runs the whole step itself.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_rank() -> int:
    """This process's rank as its launcher set it (RANK; 0 without one), known before any process group."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def check_world_size(plan_dp: int) -> None:
    """One process per replica of the plan; checked from torchrun's environment, before the model loads."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != plan_dp:
        started = f"{world_size} process" + ("" if world_size == 1 else "es")
        raise HartsError(f"the plan was compiled for --dp {plan_dp} but torchrun started {started}; "
                         f"fix: run torchrun --nproc-per-node {plan_dp}, or recompile with --dp {world_size}")


def init_data_parallel(plan_dp: int, device: torch.device) -> DataParallel:
    """Join the process group torchrun set up; one rank per replica of the plan.

    The backend follows the device the model runs on (nccl for CUDA, gloo for
    CPU), not merely whether a GPU exists: `--device cpu` on a GPU machine
    must reduce CPU tensors, which nccl cannot.
    """
    check_world_size(plan_dp)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size())


def microbatches_of_replica(plan, replica: int) -> list[int]:
    """Indices of the plan's microbatches placed on `replica`, in slot order."""
    mine = [(int(mb["slot"]), i) for i, mb in enumerate(plan.microbatches) if int(mb["replica"]) == replica]
    return [i for _, i in sorted(mine)]


def all_reduce_result(result, model, value_head=None) -> None:
    """Sum gradients, losses, statistics and log-probabilities over ranks, in place.

    Every collective runs on the device of the model's parameters (nccl reduces
    only CUDA tensors). Counts of work are summed, `most_live_producers` and
    `seconds` (the step ends with its slowest rank) are maxima;
    `microbatch_seconds`, `unit_microbatches` and `producer_seconds` stay this rank's. A critic's
    `value_head` given apart from the model (`run_step`'s) has its gradients summed too.
    """
    device = next(model.parameters()).device
    inside = {id(p) for p in model.parameters()}
    extra = [p for p in value_head.parameters() if id(p) not in inside] if isinstance(value_head, torch.nn.Module) \
        else []
    for p in [*model.parameters(), *extra]:
        if not p.requires_grad:   # frozen on every rank alike: nothing to reduce
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    result.grads = trainable_gradients(model)
    sums = torch.tensor([result.loss, result.objective, result.moe_aux_loss, result.moe_z_loss, float(result.rows),
                         float(result.producers_run), float(result.producer_backward_passes)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    result.loss, result.objective, result.moe_aux_loss, result.moe_z_loss = (float(x) for x in sums[:4])
    result.rows, result.producers_run, result.producer_backward_passes = (int(x) for x in sums[4:])
    if result.entropy is not None:   # asked for on every rank alike, and None on all when nothing is trained
        entropy = torch.tensor([result.entropy], dtype=torch.float64, device=device)
        dist.all_reduce(entropy)
        result.entropy = float(entropy[0])
    maxima = torch.tensor([result.seconds, float(result.most_live_producers)], dtype=torch.float64, device=device)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    result.seconds, result.most_live_producers = float(maxima[0]), int(maxima[1])
    for layer in sorted(result.moe_load):
        load = torch.as_tensor(np.ascontiguousarray(result.moe_load[layer], dtype=np.float64), device=device)
        dist.all_reduce(load)
        result.moe_load[layer] = load.cpu().numpy()
    result.logprobs = _merged_positions(result.logprobs, device)
    result.values = _merged_positions(result.values, device)


def _merged_positions(per_trajectory: dict, device) -> dict:
    """str(id) -> float32[n] from every rank: each trajectory lives on exactly one replica and the others
    hold NaN for it. One collective for all of them: the numbers (NaN as 0) and a presence flag."""
    keys = sorted(per_trajectory)
    numbers = np.concatenate([np.asarray(per_trajectory[k], dtype=np.float64) for k in keys]) if keys else np.zeros(0)
    present = ~np.isnan(numbers)
    stacked = torch.as_tensor(np.stack([np.nan_to_num(numbers), present.astype(np.float64)]), device=device)
    dist.all_reduce(stacked)
    stacked = stacked.cpu().numpy()
    merged = np.where(stacked[1] > 0, stacked[0], np.nan).astype(np.float32)
    bounds = np.cumsum([len(per_trajectory[k]) for k in keys])[:-1]
    return dict(zip(keys, np.split(merged, bounds)))


def failure_flags(device: torch.device) -> torch.Tensor:
    """The buffer `raise_if_a_rank_failed` reduces, allocated before the stage it reports on: a rank that
    ran out of memory there must not need new memory to say so."""
    return torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)


def raise_if_a_rank_failed(own: BaseException | None, failed: torch.Tensor, stage: str) -> None:
    """Every rank says whether `stage` failed on it; then the ranks that failed re-raise their own error and the
    others raise one line naming them.

    Collectives need every rank: without this, a rank whose custom objective
    raised (or that ran out of memory) exits while the others wait in the
    all-reduce, which then fails with a transport traceback (gloo) or hangs
    until its timeout (nccl). Call it on every rank, after `stage`, with the
    exception that rank caught (None if it succeeded) and the `failure_flags`
    allocated before the stage.
    """
    failed.zero_()
    failed[dist.get_rank()] = float(own is not None)
    dist.all_reduce(failed)
    ranks = torch.nonzero(failed).flatten().tolist()
    if ranks:   # every rank is here: tear the group down now (gloo's threads abort an exit that skips it)
        dist.destroy_process_group()
    if own is not None:
        raise own
    if ranks:
        names = ", ".join(str(r) for r in ranks)
        which = f"rank {names}" if len(ranks) == 1 else f"ranks {names}"
        raise HartsError(f"stopped: {which} failed {stage}, so no output is written; fix: see {which}'s message")


def finish_data_parallel() -> None:
    """Wait for every rank, then tear the group down: a rank that exits with gloo's
    threads still alive can abort at interpreter shutdown."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
