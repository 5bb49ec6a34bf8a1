"""``parallel.fsdp``: the combinations fully sharded data parallelism serves, checked before
any process group exists.

Refused, each with the reason: Muon (orthogonalises whole matrices; FSDP leaves a rank some
rows of each), LoRA (frozen base weights; FSDP here shards trainable parameters only), fp16
(the sharded masters are fp32 and layers compute in bf16; fp16 would need a loss scale for
the gathered copies), a single process (FSDP shards over a process group), the data-parallel
replica check (no two ranks hold the same parameter values), ``precision.compile`` (compiled
blocks under ``fully_shard`` are not tested yet), ``optimizer.overlap_grad_reduce`` /
``overlap_param_gather`` (options of the DDP buckets and ZeRO-1 gathers FSDP replaces: they
would be ignored) and a negative prefetch.
"""

from __future__ import annotations

__all__ = ["FSDP_MODES", "check_fsdp"]

FSDP_MODES = ("off", "full", "zero2")


def check_fsdp(config, world_size: int, problems: list[str]) -> None:
    """Append a line per problem of the ``parallel.fsdp*`` options for ``world_size`` ranks."""
    p = config.parallel
    if p.fsdp not in FSDP_MODES:
        problems.append(f"parallel.fsdp={p.fsdp!r}: must be one of {list(FSDP_MODES)}")
        return
    if (
        isinstance(p.fsdp_prefetch, bool)
        or not isinstance(p.fsdp_prefetch, int)
        or p.fsdp_prefetch < 0
    ):
        problems.append(f"parallel.fsdp_prefetch={p.fsdp_prefetch!r}: must be an integer >= 0")
    if p.fsdp == "off":
        return
    where = f"parallel.fsdp={p.fsdp!r}"
    if config.optimizer.name != "adamw":
        problems.append(
            f"{where} with optimizer.name={config.optimizer.name!r} is not supported: Muon "
            "orthogonalises whole weight matrices and FSDP leaves each rank some rows of them; "
            "use optimizer.name='adamw', or parallel.fsdp='off' (Muon runs layer-wise)"
        )
    if config.peft.method != "none":
        problems.append(
            f"{where} with peft.method={config.peft.method!r} is not supported: LoRA freezes the "
            "base weights and FSDP here shards trainable parameters only; use parallel.fsdp='off'"
        )
    if config.precision.dtype == "fp16":
        problems.append(
            f"{where} with precision.dtype='fp16' is not supported: use 'bf16' (fp32 sharded "
            "masters, bf16 compute), 'fp32' or 'fp64'"
        )
    if world_size < 2:
        problems.append(
            f"{where} needs torch.distributed with at least 2 ranks (world size {world_size}): "
            "FSDP shards over the data-parallel process group; launch with torchrun "
            "--nproc-per-node >= 2, or use parallel.fsdp='off'"
        )
    if config.precision.compile:
        problems.append(
            f"{where} with precision.compile=true is not supported yet: compiled blocks under "
            "fully_shard are untested here; set precision.compile=false, or parallel.fsdp='off'"
        )
    _check_overlap(config, where, problems)
    if config.reliability.check_dp_params_interval is not None:
        problems.append(
            f"{where} with reliability.check_dp_params_interval="
            f"{config.reliability.check_dp_params_interval}: under FSDP no two data-parallel "
            "ranks hold the same parameter values, so there are no replicas to compare; set it "
            "to none"
        )


def _check_overlap(config, where: str, problems: list[str]) -> None:
    """The DDP/ZeRO-1 overlap switches, which FSDP has no use for: refused, not ignored."""
    for name in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(config.optimizer, name):
            problems.append(
                f"{where} with optimizer.{name}=true is not supported: it overlaps the "
                "DDP/ZeRO-1 communication FSDP replaces (FSDP reduce-scatters during the backward "
                "and prefetches gathers per parallel.fsdp_prefetch), so it would be ignored; set "
                f"optimizer.{name}=false, or parallel.fsdp='off'"
            )
