"""Train / valid / test datasets from the data config, and per-rank micro-batches.

- Sources: a built-in corpus, indexed prefixes blended by weights (each
  prefix's documents split train/valid/test by ``data.split``, in document
  order, as Megatron does), or a JSON data config naming a blend per split.
- The training set holds exactly the samples the run consumes (the sum of
  the batch-size schedule), so sample ``i`` is fixed by (config, seed) alone.
- The validation set is fixed: every evaluation sees the same samples in
  the same (unshuffled) order, so validation curves are comparable; with
  ``eval.steps`` unset it is one pass over each validation component.
- :func:`micro_batch` lays a global batch out like Megatron's sampler: the
  ``m``-th micro-batch of data-parallel rank ``r`` holds global samples
  ``consumed + m·mbs·dp + r·mbs + [0, mbs)``. Resuming needs only the
  number of consumed samples, at any data-parallel size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwork.trainer.data.blend import BlendedDataset, samples_per_component
from shardwork.trainer.data.corpus import builtin_corpus, default_cache_dir
from shardwork.trainer.data.gpt_dataset import GPTDataset
from shardwork.trainer.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")


def read_data_config(path: str | Path) -> dict[str, list[tuple[float, str]]]:
    """``{"train": [[weight, prefix], ...], "valid": ..., "test": ...}`` -> per-split blends.

    A split may also be given as ``{"prefix": weight, ...}``. ``train`` is required.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError("no such file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or "train" not in raw:
        raise ValueError(
            'must be a JSON object with a "train" blend (and optional "valid", "test")'
        )
    blends: dict[str, list[tuple[float, str]]] = {}
    for split, blend in raw.items():
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
        if not isinstance(blend, dict | list):
            raise ValueError(
                f"{split}: {blend!r} is a JSON {type(blend).__name__}; valid: a list of "
                '[weight, prefix] pairs, e.g. [[1.0, "data/wiki"]], or {prefix: weight}'
            )
        items = list(blend.items()) if isinstance(blend, dict) else blend
        pairs = []
        for item in items:
            if isinstance(blend, dict):
                prefix, weight = item
            else:
                if not (isinstance(item, list | tuple) and len(item) == 2):
                    raise ValueError(f"{split}: entry {item!r} must be [weight, prefix]")
                weight, prefix = item
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ValueError(
                    f"{split}: entry {list(item)!r} has weight {weight!r}, not a number; valid: "
                    '[weight, prefix] pairs such as [1.0, "data/corpus"], or {"prefix": weight}'
                )
            if not weight >= 0 or weight == float("inf"):
                raise ValueError(
                    f"{split}: weight {weight!r} of {prefix!r} must be >= 0 and finite"
                )
            if not isinstance(prefix, str):
                raise ValueError(f"{split}: prefix {prefix!r} of weight {weight!r} must be a path")
            # No shell reads the file: a leading ~ is expanded here, as in the config's paths.
            pairs.append((float(weight), os.path.expanduser(prefix)))
        blends[split] = pairs
    return blends


def split_documents(num_documents: int, split: str) -> dict[str, np.ndarray]:
    """Contiguous document ranges for train/valid/test from proportions like ``"90,10,0"``."""
    parts = np.asarray([float(x) for x in split.split(",")], dtype=np.float64)
    bounds = np.concatenate([[0.0], np.cumsum(parts / parts.sum())])
    edges = np.round(bounds * num_documents).astype(np.int64)
    # Rounding can leave the last edge short: the final split ends at the last document.
    edges[-1] = num_documents
    return {name: np.arange(edges[i], edges[i + 1]) for i, name in enumerate(SPLITS)}


@dataclass(frozen=True)
class Component:
    """One dataset prefix and the documents of it that a split uses."""

    prefix: str
    weight: float
    documents: np.ndarray


def split_components(data, *, cache_dir: str | None = None) -> dict[str, list[Component]]:
    """The components of each split for a :class:`DataConfig`."""
    if data.data_config is not None:
        blends = read_data_config(data.data_config)
        out: dict[str, list[Component]] = {}
        for split in SPLITS:
            comps = []
            for weight, prefix in blends.get(split, []):
                num = len(IndexedDataset(prefix))
                comps.append(Component(prefix, weight, np.arange(num)))
            out[split] = comps
        return out
    if data.prefixes:
        prefixes = list(data.prefixes)
        weights = list(data.weights) or [1.0] * len(prefixes)
    else:
        prefixes = [builtin_corpus(data.corpus, cache_dir or data.cache_dir or default_cache_dir())]
        weights = [1.0]
    out = {split: [] for split in SPLITS}
    for prefix, weight in zip(prefixes, weights):
        docs = split_documents(len(IndexedDataset(prefix)), data.split)
        for split in SPLITS:
            if docs[split].size:
                out[split].append(Component(prefix, weight, docs[split]))
    return out


def build_blend(
    components: list[Component],
    *,
    size: int,
    seq_length: int,
    seed: int,
    shuffle: bool,
    sample_order: str = "blocks",
) -> BlendedDataset:
    """``size`` samples blended from ``components`` by weight (``sample_order``: see
    :class:`GPTDataset`)."""
    weights = [c.weight for c in components]
    counts = samples_per_component(weights, size)
    datasets = [
        GPTDataset(
            IndexedDataset(c.prefix),
            c.documents,
            seq_length=seq_length,
            num_samples=max(count, 1),
            # A different shuffle seed per component, fixed by (seed, position).
            seed=seed + 7919 * i,
            shuffle=shuffle,
            sample_order=sample_order,
        )
        for i, (c, count) in enumerate(zip(components, counts))
    ]
    return BlendedDataset(datasets, weights, size)


def build_eval_set(
    components: list[Component], *, seq_length: int, num_samples: int | None
) -> BlendedDataset | None:
    """A fixed, unshuffled evaluation set: ``num_samples`` blended samples, or one pass of each."""
    if not components:
        return None
    if num_samples is None:
        sets = []
        for c in components:
            # A one-sample probe, only to learn how many samples one pass holds.
            probe = GPTDataset(
                IndexedDataset(c.prefix),
                c.documents,
                seq_length=seq_length,
                num_samples=1,
                seed=0,
                shuffle=False,
            )
            count = probe.samples_per_epoch
            if count < 1:
                continue
            sets.append(
                GPTDataset(
                    IndexedDataset(c.prefix),
                    c.documents,
                    seq_length=seq_length,
                    num_samples=count,
                    seed=0,
                    shuffle=False,
                )
            )
        if not sets:
            return None
        sizes = [len(s) for s in sets]
        # Weights = sizes: each component contributes exactly its one pass.
        return BlendedDataset(sets, sizes, sum(sizes))
    return build_blend(components, size=num_samples, seq_length=seq_length, seed=0, shuffle=False)


def micro_batch(
    dataset, *, consumed: int, index: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> torch.Tensor:
    """Micro-batch ``index`` of this data-parallel rank: int64 ``[mbs, seq_length + 1]``."""
    start = consumed + index * micro_batch_size * dp_size + dp_rank * micro_batch_size
    # Wraps: an evaluation set smaller than one micro-batch per rank is still run once (_datasets
    # gives every rank at least one micro-batch).
    rows = [dataset[(start + j) % len(dataset)] for j in range(micro_batch_size)]
    return torch.from_numpy(np.stack(rows))
