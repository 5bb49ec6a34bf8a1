"""Checkpoint and resume through shardwork.dist_checkpoint's CheckpointManager.

A checkpoint (``CHECKPOINT_DIR/step_<step>/``) holds, in global coordinates so
that it loads at any layout:

- ``model``: every chunk's ``sharded_state_dict()`` (keys are global layer names); a LoRA
  run (``[peft]``) saves the adapters only, and records its LoRAConfig under ``"lora"``;
- ``optimizer``: the distributed optimizer's ``sharded_state_dict()`` (fp32
  masters and moments, and the fp16 loss scale when there is one), keyed by
  global parameter keys (:mod:`shardwork.trainer.run.optimizer_keys`);
- ``trainer``: step, consumed samples, seed and the layout it was saved at.
  The LR, weight-decay and batch-size schedules are pure functions of the
  step, so the step *is* their state. The data position is the consumed
  samples: a run resumed with other batch sizes than the checkpoint's reads
  on from there (``data_offset``), and as the training set's order does not
  depend on its size, a longer ``train_steps`` continues the same order;
- ``rng``: one object per rank (torch generators and the model chunks'
  dropout trackers), on a grid indexed by global rank.

Its metadata holds the resolved config as TOML and, for a run started from a Hugging Face
folder, that folder's config.json (the architecture), so the checkpoint alone rebuilds the model.

At the same layout everything is restored and the run continues bit for bit.
At a different layout the RNG grid does not fit: ``rng`` is left out of the
load and each rank re-derives its RNG from (seed, step, rank role), with a
notice. Saves may be asynchronous; retention (keep last N, every K-th) and
atomic commits are the manager's.

Resume verifies what it loads (dist_checkpoint's ``load`` checks every file it reads against
its recorded CRC-32; all ranks agree). With ``checkpoint.resume = "auto"`` and
``checkpoint.fallback`` on, a corrupt newest checkpoint is reported and the next older one
is tried, until one loads. The failed load may have written bytes into the model and
optimizer tensors (they are read in place); the next load uses the same template, which
covers every element of every tensor it loads, so it rewrites all of them, and objects
(RNG, step) are only applied after a load succeeded. A corrupt step skipped this way is
overwritten when the run saves at that step again (otherwise the bad checkpoint would be
kept as "already saved"). An explicit ``checkpoint.resume`` path, or fallback off, stops
with `CheckpointCorruptError` naming the file and the checkpoint, and the remedy.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from shardwork.dist_checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    ShardedObject,
    is_committed,
    read_info,
)
from shardwork.models.lora import lora_state_dict
from shardwork.models.lora_checkpoint import (
    LORA_METADATA_KEY,
    check_lora_record,
    lora_config_record,
)
from shardwork.trainer.config.load import config_to_toml
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.data.gpt_dataset import SAMPLE_ORDERS
from shardwork.trainer.model_factory import hf_config
from shardwork.trainer.run.checkpoint_choice import resume_candidates
from shardwork.trainer.run.optimizer_keys import optimizer_param_rects
from shardwork.trainer.run.resume_advice import (
    corrupt_message,
    data_order_differences,
    data_order_warning,
    mismatch_message,
)
from shardwork.trainer.run.rng import (
    capture_rng,
    derived_seed,
    rank_role,
    restore_rng,
    seed_everything,
)
from shardwork.trainer.schedules import consumed_samples

#: the checkpoint metadata's key for the training set's sample order (data/gpt_dataset.py)
SAMPLE_ORDER_KEY = "sample_order"


def layout_of(runtime) -> dict:
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


def no_checkpoint_reason(path: str | Path) -> str:
    """Why ``path`` names no checkpoint to load, with what to pass instead: the trainer reads
    ``step_<N>`` directories (or their parent), and the message must say so when ``path`` is a
    complete checkpoint under another name or a run directory."""
    path = Path(path)
    if not path.exists():
        return "no such directory"
    if is_committed(path):
        return (
            "it is a complete checkpoint, but checkpoints are read from directories named "
            "step_<N> (N = its step, e.g. step_000000006): rename it, or pass its parent when "
            "that holds step_<N> directories"
        )
    if (path / "checkpoints").is_dir():
        return f"it looks like a run directory: pass {str(path / 'checkpoints')!r}"
    if (path / ".metadata").is_file():
        return "a checkpoint whose save never finished (no COMMITTED marker): it is incomplete"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (
            "it is a Hugging Face model folder (config.json and safetensors, e.g. a run's "
            "checkpoint.hf_export), not a shardwork checkpoint: pass the step_<N> checkpoint "
            "of the run that exported it, or start a run from it with --checkpoint.hf_init "
            f"{str(path)!r}"
        )
    return "no step_<N> directory with a COMMITTED marker there (no complete checkpoint)"


class ResumeError(ValueError):
    """``checkpoint.resume`` names no checkpoint this run can resume: none complete there, none
    intact, or one whose tensors do not fit this run's model."""


def saved_sample_order(info: dict) -> str:
    """The training set's sample order a checkpoint's run read (``info``: its ``read_info``):
    one written before the "blocks" order records none and read the "whole" order. Checked
    before any tensor is read."""
    saved = (info.get("user_metadata") or {}).get(SAMPLE_ORDER_KEY, "whole")
    if saved not in SAMPLE_ORDERS:
        raise ResumeError(
            f"the checkpoint's metadata records {SAMPLE_ORDER_KEY}={saved!r}, which this "
            f"version does not know (valid: {list(SAMPLE_ORDERS)}): resume it with the "
            "version that wrote it, or start afresh with a new --checkpoint.dir"
        )
    return saved


class Checkpointer:
    """Saves and restores the run's state (see module docstring)."""

    def __init__(self, config, runtime, assembly) -> None:
        self.config = config
        self.runtime = runtime
        self.assembly = assembly
        self.param_rects = optimizer_param_rects(assembly.modules, runtime.groups)
        c = config.checkpoint
        self.manager = CheckpointManager(
            c.dir,
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            async_save=c.async_save,
            layout=layout_of(runtime),
            # the background writes' collectives wait no longer than the training ones
            async_timeout=datetime.timedelta(minutes=config.parallel.timeout_minutes),
        )
        #: what every checkpoint of the run stores beside its state (read once, not per save)
        self.metadata = {"train_config": config_to_toml(config)}
        #: corrupt checkpoints skipped by a fallback: saved over when the run reaches them
        self.corrupt_steps: set[int] = set()
        #: samples the resumed checkpoint's run had consumed minus what this run's batch
        #: schedule says its steps consume (0 unless a resume changed the batch sizes)
        self.data_offset = 0
        #: the training set's sample order (data/gpt_dataset.py): a checkpoint written before
        #: the "blocks" order records none, and the run resumed from it keeps "whole"
        self.sample_order = "blocks"
        self.metadata[SAMPLE_ORDER_KEY] = self.sample_order
        if c.hf_init is not None:  # the architecture (shardwork-generate reads it)
            self.metadata["hf_config"] = hf_config(c.hf_init)
        self.lora = lora_config_of(config)
        if self.lora is not None:
            self.metadata[LORA_METADATA_KEY] = lora_config_record(self.lora)

    # ---- state -------------------------------------------------------------------------------
    def _model_state(self) -> dict:
        state: dict = {}
        for module in self.assembly.modules:
            # A LoRA run saves its adapters only: the frozen base is rebuilt from
            # checkpoint.hf_init (or the seed) when the run resumes.
            state.update(lora_state_dict(module) if self.lora else module.sharded_state_dict())
        return state

    def _rng_state(self):
        value = capture_rng(self.runtime.device)
        value["trackers"] = [m.rng_tracker.get_states() for m in self.assembly.modules]
        # One cell per global rank: it only fits a run with the same ranks in the same roles.
        return ShardedObject(
            "rng",
            value,
            global_shape=(self.runtime.world_size,),
            global_offset=(self.runtime.rank,),
        )

    def state(self, step: int, *, include_optimizer: bool = True, include_rng: bool = True) -> dict:
        s = self.config.schedule
        state = {
            "model": self._model_state(),
            "trainer": {
                "step": step,
                "consumed_samples": self.data_offset
                + consumed_samples(
                    step, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
                ),
                "seed": self.config.seed,
                "layout": layout_of(self.runtime),
            },
        }
        if include_optimizer:
            state["optimizer"] = self.assembly.optimizer.sharded_state_dict(
                param_rects=self.param_rects
            )
        if include_rng:
            state["rng"] = self._rng_state()
        return state

    # ---- save / load -------------------------------------------------------------------------
    def save(self, step: int) -> str:
        """Save at ``step`` (async if configured: committed by the next save or ``close``).

        A step that already has a complete checkpoint (a resumed, finished run) is kept.
        """
        if step in self.corrupt_steps:
            # A checkpoint skipped as corrupt by the fallback is saved over, not kept as "already
            # saved".
            self.manager.save(step, self.state(step), metadata=self.metadata, overwrite=True)
            self.corrupt_steps.discard(step)
        elif step not in self.manager.list():
            self.manager.save(step, self.state(step), metadata=self.metadata)
        return str(self.manager.step_path(step))

    def close(self) -> None:
        self.manager.close()

    def maybe_resume(self, *, say) -> int:
        """Resume per ``checkpoint.resume``; returns the step to start from (0 for a fresh run)."""
        c = self.config.checkpoint
        candidates = resume_candidates(c.resume, c.dir)
        if candidates is None:
            return 0
        if c.resume == "auto":  # candidates.root is self.manager's: checkpoint.dir
            steps = candidates.steps
            return self._resume_newest_intact(steps, say=say) if steps else 0
        if not candidates.steps:
            raise ResumeError(f"checkpoint.resume={c.resume!r}: {no_checkpoint_reason(c.resume)}")
        try:
            return self._resume_from(
                CheckpointManager(candidates.root), candidates.steps[-1], say=say
            )
        except CheckpointCorruptError as exc:
            why = f"checkpoint.resume={c.resume!r} names it, so the run does not fall back"
            raise corrupt_message(exc, why=why) from exc

    def _resume_newest_intact(self, steps: list[int], *, say) -> int:
        """``checkpoint.resume = "auto"``: the newest checkpoint that loads intact (see the
        module docstring); raises `CheckpointCorruptError` if fallback is off, `ResumeError` if
        no checkpoint is intact."""
        skipped: list[int] = []
        for step in reversed(steps):
            try:
                start = self._resume_from(self.manager, step, say=say)
            except CheckpointCorruptError as exc:
                if not self.config.checkpoint.fallback:
                    why = "checkpoint.fallback=False, so the run does not fall back"
                    raise corrupt_message(exc, why=why) from exc
                say(f"warning: {exc}; trying the previous checkpoint")
                skipped.append(step)
                continue
            if skipped:
                say(
                    f"warning: fell back to step {step}: checkpoint(s) of step(s) {skipped} in "
                    f"{self.manager.root} failed verification and are saved over when the run "
                    "reaches those steps; until then they stay, so a resume before that falls "
                    "back again (`shardwork-ckpt verify` checks them; deleting them is safe)"
                )
            self.corrupt_steps = set(skipped)
            return start
        raise ResumeError(
            f"checkpoint.resume='auto': every checkpoint in {self.manager.root} (steps {steps}) "
            f"failed verification (see the warnings above). Start fresh with "
            f"--checkpoint.resume none or a new --checkpoint.dir."
        )

    def _continue_data_position(self, saved_consumed: int, step: int, *, say) -> None:
        """Read on from the checkpoint's consumed samples: a run resumed with other batch sizes
        (``global_batch_size``, ``batch_size_ramp``) would otherwise start at the sample its
        own schedule puts at ``step``, skipping samples or reading some twice."""
        s = self.config.schedule
        ours = consumed_samples(step, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp)
        self.data_offset = saved_consumed - ours
        if self.data_offset:
            say(
                f"notice: the checkpoint's run consumed {saved_consumed} samples in its {step} "
                f"steps, where this run's batch sizes would have consumed {ours}: reading "
                f"continues at sample {saved_consumed}"
            )

    def _keep_sample_order(self, order: str, *, say) -> None:
        """Continue in the checkpoint's sample ``order``, and save it in this run's checkpoints:
        a run that switched orders would re-read some samples and skip others."""
        self.sample_order = self.metadata[SAMPLE_ORDER_KEY] = order
        if order == "whole" and self.config.data.shuffle:
            say(
                "notice: the checkpoint was written by a version of shardwork from before the "
                "sample order of blocks, so this run keeps its order to continue it (one shuffle "
                "over the run's total samples; a longer train_steps or other batch sizes than "
                "the checkpoint's run reorder it) and so do its checkpoints. A run started "
                "afresh uses the new order, which does not depend on the run's length."
            )

    def _check_lora(self, info: dict, path) -> None:
        """Refuse, before reading tensors, a checkpoint whose LoRA options differ from the run's
        (a full-model checkpoint in a LoRA run, adapters in a full run, another rank...)."""
        saved = (info.get("user_metadata") or {}).get(LORA_METADATA_KEY)
        hint = "; resume with the [peft] section it was saved with, or start fresh with "
        hint += "--checkpoint.resume none or a new --checkpoint.dir"
        if self.lora is None:
            if saved is not None:
                raise ResumeError(
                    f"{path} holds LoRA adapters only (peft.method='lora', rank="
                    f"{saved.get('rank')}) but this run has no [peft] section{hint}"
                )
            return
        try:
            check_lora_record(saved, self.lora, path)
        except ValueError as exc:
            raise ResumeError(f"{exc}{hint}") from None

    def _resume_from(self, manager, step: int, *, say) -> int:
        """Load checkpoint ``step`` of ``manager`` into the run; return the step it holds."""
        c = self.config.checkpoint
        path = manager.step_path(step)
        info = read_info(path)
        self._check_lora(info, path)
        order = saved_sample_order(info)
        saved_layout = info.get("layout") or {}
        same_layout = saved_layout == layout_of(self.runtime)
        # The RNG grid is indexed by global rank, whose role changes with the layout.
        load_rng = c.load_rng and same_layout
        exclude = [] if c.load_optimizer else ["optimizer"]
        if not load_rng:
            exclude.append("rng")
        template = self.state(0, include_optimizer=c.load_optimizer, include_rng=load_rng)
        try:
            loaded = manager.load(template, step=step, exclude=exclude)
        except CheckpointMismatchError as exc:
            saved_toml = (info.get("user_metadata") or {}).get("train_config")
            message = mismatch_message(
                exc, saved_toml=saved_toml, run_toml=self.metadata["train_config"]
            )
            raise ResumeError(message) from exc
        step = int(loaded["trainer"]["step"])
        if c.load_optimizer:
            # This also writes the loaded fp32 masters back into the model's parameters.
            self.assembly.optimizer.load_sharded_state_dict(
                loaded["optimizer"], param_rects=self.param_rects
            )
        if load_rng:
            value = loaded["rng"]
            restore_rng(value, self.runtime.device)
            for module, states in zip(self.assembly.modules, value["trackers"]):
                module.rng_tracker.set_states(states)
        else:
            seed_everything(
                derived_seed(self.config.seed, step, rank_role(self.runtime.groups)),
                self.runtime.device,
            )
            if c.load_rng:
                say(
                    f"notice: the checkpoint was saved at layout {saved_layout} and this run is "
                    f"{layout_of(self.runtime)}: RNG state cannot be resharded, so each rank's RNG "
                    f"is re-derived from (seed={self.config.seed}, step={step}, rank role)"
                )
        say(f"resumed from {path} at step {step}")
        self._continue_data_position(int(loaded["trainer"]["consumed_samples"]), step, say=say)
        self._keep_sample_order(order, say=say)
        saved_toml = (info.get("user_metadata") or {}).get("train_config")
        differences = data_order_differences(
            saved_toml, self.metadata["train_config"], whole_order=self.sample_order == "whole"
        )
        if differences:
            say(data_order_warning(step, differences))
        return step
