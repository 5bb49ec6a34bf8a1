"""Blending several datasets by weight, deterministically.

Each component's ``k``-th sample is placed at virtual time ``(k + ½) / w``
and samples are taken in time order (ties broken by component order). Over
any prefix of ``n`` samples a component with normalised weight ``w`` holds
``n·w`` samples to within one, the order depends on nothing but the weights
(so it is the same on every rank and after a resume), and the index is built
with one sort instead of a per-sample loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def blend_index(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` for ``size`` blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights={list(weights)} must be non-negative with a positive sum")
    w = w / w.sum()
    times, owners, ordinals = [], [], []
    for d, weight in enumerate(w):
        if weight == 0:
            continue
        count = int(np.ceil(weight * size)) + 1
        k = np.arange(count)
        times.append((k + 0.5) / weight)
        owners.append(np.full(count, d, dtype=np.int64))
        ordinals.append(k)
    time = np.concatenate(times)
    order = np.lexsort((np.concatenate(owners), time))[:size]
    return np.concatenate(owners)[order], np.concatenate(ordinals)[order]


def samples_per_component(weights: Sequence[float], size: int) -> list[int]:
    """How many samples each component contributes to ``size`` blended samples."""
    dataset_index, _ = blend_index(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """Samples from ``datasets`` interleaved by ``weights`` (see module docstring)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(
                f"{len(datasets)} datasets but {len(weights)} weights: give one weight per dataset"
            )
        self.datasets = list(datasets)
        self.weights = list(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = blend_index(weights, size)
        for d, count in enumerate(np.bincount(self.dataset_index, minlength=len(datasets))):
            if count > len(self.datasets[d]):
                raise ValueError(
                    f"blend component {d} needs {count} samples but holds {len(self.datasets[d])}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        d = int(self.dataset_index[index])
        return self.datasets[d][int(self.dataset_sample_index[index])]
