"""shardwork.trainer: the lean trainer that composes the shardwork packages.

- ``shardwork-train`` (:mod:`shardwork.trainer.cli`, also ``python -m shardwork.trainer``
  under torchrun): config dataclasses from TOML + ``--section.field`` flags, validated as a
  whole before any process group exists; with no arguments, a small GPT on Python's own
  ``pydoc_data`` topics on the CPU.
- Data (:mod:`shardwork.trainer.data`): Megatron-compatible ``.bin``/``.idx`` indexed
  datasets, ``shardwork-preprocess``, GPT sample index, weighted blends, splits, the
  bigram-entropy baseline.
- The run (:mod:`shardwork.trainer.run`): shardwork.models' pipeline schedules and
  ``finalize_model_grads``, shardwork.dist_optimizer's ZeRO-1 optimizer,
  shardwork.dist_checkpoint's CheckpointManager; LR / weight-decay / batch-size schedules
  (:mod:`shardwork.trainer.schedules`); signals, NaN policy, replica check.
- Observability (:mod:`shardwork.trainer.observe`): JSONL + TensorBoard metrics, progress
  bar or plain lines, ``shardwork-plot``; ``shardwork-generate`` samples from a checkpoint.

Importing this package does not import torch (the CLI sets CPU thread policy first).
"""

__version__ = "0.1.0"
