"""The training run: process setup, model/optimizer assembly, the loop, evaluation, checkpoints."""
