"""Checkpoint and resume through shardwork.dist_checkpoint's CheckpointManager.

A checkpoint holds (all in global coordinates, so it loads at any layout):

- ``model``: every chunk's ``sharded_state_dict()`` (keys are global layer names);
- ``optimizer``: the distributed optimizer's ``sharded_state_dict()``;
- ``trainer``: step, consumed samples, seed and the layout it was saved at
  (the LR / weight-decay / batch-size schedules are pure functions of the
  step, so the step *is* their state; an fp16 loss scale lives with the optimizer);
- ``rng``: one object per rank (torch generators and the model's dropout
  tracker), indexed by global rank.

On resume at the same layout everything is restored. At a different layout
the RNG grid does not fit: every rank re-derives its RNG from (seed, step,
rank role) and the run says so.
"""

from __future__ import annotations

from pathlib import Path

from shardwork.trainer.run.rng import (
    capture_rng,
    derived_seed,
    rank_role,
    restore_rng,
    seed_everything,
)


def _layout(runtime) -> dict:
    c = runtime.groups.config
    return {
        "tp": c.tp,
        "pp": c.pp,
        "vpp": c.vpp,
        "cp": c.cp,
        "ep": c.ep,
        "etp": c.etp,
        "dp": c.dp,
        "order": c.order,
        "world_size": runtime.world_size,
    }


class Checkpointer:
    """Saves and restores the run's state (see module docstring)."""

    def __init__(self, config, runtime, assembly) -> None:
        self.config = config
        self.runtime = runtime
        self.assembly = assembly
        self.directory = Path(config.checkpoint.dir)
        self._manager = None

    def manager(self):
        if self._manager is None:
            from shardwork.dist_checkpoint import CheckpointManager

            c = self.config.checkpoint
            self._manager = CheckpointManager(
                self.directory,
                keep_last=c.keep_last,
                keep_every=c.keep_every,
                async_save=c.async_save,
            )
        return self._manager

    # ---- state -------------------------------------------------------------------------------
    def _model_state(self) -> dict:
        state: dict = {}
        for module in self.assembly.modules:
            state.update(module.sharded_state_dict())
        return state

    def _rng_state(self):
        from shardwork.dist_checkpoint import ShardedObject

        value = capture_rng(self.runtime.device)
        value["trackers"] = [
            m.rng_tracker.get_states() for m in self.assembly.modules if hasattr(m, "rng_tracker")
        ]
        return ShardedObject(
            "rng",
            value,
            global_shape=(self.runtime.world_size,),
            global_offset=(self.runtime.rank,),
        )

    def state(self, step: int, *, include_optimizer: bool = True, include_rng: bool = True) -> dict:
        from shardwork.trainer.schedules import consumed_samples

        s = self.config.schedule
        state = {
            "model": self._model_state(),
            "trainer": {
                "step": step,
                "consumed_samples": consumed_samples(
                    step, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
                ),
                "seed": self.config.seed,
                "layout": _layout(self.runtime),
            },
        }
        if include_optimizer:
            state["optimizer"] = self.assembly.optimizer.sharded_state_dict()
        if include_rng:
            state["rng"] = self._rng_state()
        return state

    # ---- save / load -------------------------------------------------------------------------
    def save(self, step: int, *, final: bool = False) -> str:
        """Save at ``step``; returns the checkpoint's path (async saves finish in ``close``)."""
        return str(self.manager().save(self.state(step), step=step, layout=_layout(self.runtime)))

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()

    def maybe_resume(self, *, say) -> int:
        """Resume per ``checkpoint.resume``; returns the step to start from (0 for a fresh run)."""
        c = self.config.checkpoint
        if c.resume == "none":
            return 0
        if c.resume == "auto":
            if not self.directory.exists():
                return 0
            path = self.manager().latest()
            if path is None:
                return 0
        else:
            path = Path(c.resume)
        info = self.manager().read_metadata(path)
        saved_layout = info.get("layout")
        same_layout = saved_layout == _layout(self.runtime)
        load_rng = c.load_rng and same_layout
        template = self.state(0, include_optimizer=c.load_optimizer, include_rng=load_rng)
        loaded = self.manager().load(template, path)
        step = int(loaded["trainer"]["step"])
        if c.load_optimizer:
            self.assembly.optimizer.load_sharded_state_dict(loaded["optimizer"])
        if load_rng:
            value = loaded["rng"]
            restore_rng(value, self.runtime.device)
            for module, states in zip(self.assembly.modules, value.get("trackers", [])):
                module.rng_tracker.set_states(states)
        else:
            seed_everything(
                derived_seed(self.config.seed, step, rank_role(self.runtime.groups)),
                self.runtime.device,
            )
            if c.load_rng:
                say(
                    f"notice: checkpoint saved at layout {saved_layout}, resuming at "
                    f"{_layout(self.runtime)}: RNG state cannot be resharded, so each rank's RNG "
                    f"is re-derived from (seed={self.config.seed}, step={step}, rank role)"
                )
        say(f"resumed from {path} at step {step}")
        return step
