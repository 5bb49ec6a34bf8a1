"""On-demand check that all data-parallel replicas hold bit-identical parameters.

Each rank hashes every parameter's bytes (dense parameters compared over the
dp×cp group, expert parameters over the expert-data-parallel group) and the
digests are all-gathered as objects over the gloo twin of that group. Any
difference raises :class:`ReplicaMismatchError` naming the parameters and the
ranks that disagree: replicas drifting apart is a silent correctness bug
(a missed gradient reduction, a non-deterministic kernel, bad memory).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from shardwork.parallel_state import get_param_meta


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different parameter values."""


def _digest(param: torch.Tensor) -> str:
    # Raw bytes, not values: replicas must be bit-identical (-0.0 vs 0.0 and NaN payloads count).
    data = param.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha1(data).hexdigest()


def check_dp_replicas(modules, groups, *, step: int) -> int:
    """Compare parameters across replicas; returns how many parameters were compared."""
    compared = 0
    for expert, name in ((False, "dp_cp"), (True, "edp")):
        # An object collective pickles on the CPU: the gloo twin when there is one (over NCCL the
        # pickles would travel through GPU memory).
        group = groups.gloo_group(name) or groups.group(name)
        if groups.size(name) == 1 or group is None:
            continue
        digests = {}
        for c, module in enumerate(modules):
            for pname, p in module.named_parameters():
                if get_param_meta(p).is_expert == expert:
                    digests[f"chunk{c}.{pname}"] = _digest(p)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digests, group=group)
        ranks = list(groups.members[name])
        bad = sorted(key for key in digests if len({g.get(key) for g in gathered}) > 1)
        if bad:
            raise ReplicaMismatchError(
                f"step {step}: parameters differ across the {name} group (ranks {ranks}): "
                f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}"
            )
        compared += len(digests)
    return compared


def replica_check_due(interval: int | None, step: int) -> bool:
    """Whether ``reliability.check_dp_params_interval`` (``interval``) asks for a replica check
    after ``step`` steps."""
    return interval is not None and step % interval == 0
