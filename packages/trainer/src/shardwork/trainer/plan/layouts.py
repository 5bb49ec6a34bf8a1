"""Enumerate the layouts ``shardwork-train`` would accept for a model, batch and GPU count.

A :class:`Layout` is one way to run a step: the parallel sizes (tp, cp, pp with vpp, dp, ep,
etp), the uneven pipeline split (if any), the micro-batch size and the recompute mode.
:func:`parallel_layouts` yields every parallel layout the trainer's own checks accept
(:func:`variants` adds the micro-batch and recompute choices), reusing them
rather than restating them:

- ``ParallelConfig(...).resolve(num_gpus)`` (sizes, vpp needs pp > 1),
- ``GPTConfig.check_layout(parallel, seq_length=...)`` (heads, kv heads, ffn and vocabulary
  rows divisible by tp; experts by ep; ep·etp tiling tp·cp·dp; sequence vs 2·cp and tp),
- ``shardwork.models.pipeline.chunk_layer_counts`` (the pp/vpp split, uneven ends included),
- the schedule rule: ``global_batch`` a multiple of ``micro_batch × dp``.

Search space (what the planner chooses among; docs/planner.md says why):
- cp only while each rank keeps at least ``MIN_CP_TOKENS`` = 4096 tokens of a sequence. The
  cost model assumes matmul efficiency independent of the token count and bandwidth-only
  collectives, which stop holding for short chunks (CP is a long-context tool: Llama 3 uses
  it only at 131k, 8192 tokens a rank). 4096 is a round bound below that, not fitted.
- tp up to the GPUs of one node (every layer's tp collectives would otherwise cross the
  slowest link: Narayanan et al. 2021, takeaway 1); sequence parallelism on whenever tp > 1.
- pp: an even split, or, when ``num_layers`` does not divide, the first and last ranks each
  giving up layers (``q = ceil(L/pp)`` on every other rank; the last rank, which also holds
  the head, gives up the larger half of the deficit) — BLOOM's pipeline rule.
- vpp: 1 or any chunk count up to 8 that a split allows: the per-rank split above (each rank's
  layers a multiple of vpp), or the same rule one level down, over the ``pp·vpp`` virtual
  stages (the first and last *virtual* stage give up the deficit of ``ceil(L/(pp·vpp))``) —
  Llama 3's interleaved split (126 layers, pp 16, vpp 8: 0 + 126 × 1 + 0). When both exist
  and differ, both are enumerated.
- etp: 1 or tp (MoE only); ep: the divisors of the expert count that the dense ranks tile.
- micro-batch: 1, 2, 4, 8 (those dividing ``global_batch / dp``, and with vpp > 1 leaving a
  multiple of pp micro-batches: the interleaved schedule runs them in groups of pp);
  recompute none/selective/full.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shardwork.models import GPTConfig
from shardwork.models.pipeline import chunk_layer_counts
from shardwork.parallel_state import ParallelConfig

__all__ = ["Layout", "parallel_layouts", "pipeline_split", "variants", "virtual_split"]

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VPP = 8
MIN_CP_TOKENS = 4096


@dataclass(frozen=True, order=True)
class Layout:
    """One candidate layout (``dp`` excludes cp: ``num_gpus = tp·cp·pp·dp``)."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    first_virtual_stage_layers: int | None = None
    last_virtual_stage_layers: int | None = None
    moe: bool = False
    """The model has experts: its rows always name ep and etp (etp 1 below tp would otherwise
    read as the trainer's default, etp = tp)."""

    @property
    def split(self) -> dict:
        """The uneven ends as keywords of ``layers_per_rank`` and the calculator."""
        return dict(
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
            first_virtual_stage_layers=self.first_virtual_stage_layers,
            last_virtual_stage_layers=self.last_virtual_stage_layers,
        )

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def parallel_key(self) -> tuple[int, int, int, int, int, int]:
        """(tp, cp, pp, dp, ep, etp): the layout without its schedule/batch/recompute knobs."""
        return (self.tp, self.cp, self.pp, self.dp, self.ep, self.etp)

    @property
    def schedule(self) -> str:
        """The trainer's ``schedule.pipeline_schedule`` for this layout."""
        if self.pp == 1:
            return "none"
        return "interleaved" if self.vpp > 1 else "1f1b"

    def train_flags(self, *, moe: bool) -> list[str]:
        """The ``shardwork-train`` flags that run this layout (sizes, the uneven split, the
        micro-batch size, recompute; sequence parallelism with tensor parallelism, as the
        planner prices it); dp follows from the world size. ``moe``: the model has experts,
        so ep and etp are given (the trainer's etp defaults to tp)."""
        flags = {"parallel.tp": self.tp, "parallel.cp": self.cp, "parallel.pp": self.pp}
        if self.vpp > 1:
            flags["parallel.vpp"] = self.vpp
        if moe:
            flags["parallel.ep"], flags["parallel.etp"] = self.ep, self.etp
        for name, value in self.split.items():
            if value is not None:
                flags[f"parallel.{name}"] = value
        if self.tp > 1:
            flags["parallel.sequence_parallel"] = "true"
        flags["schedule.micro_batch_size"] = self.micro_batch
        if self.recompute != "none":
            flags["model.recompute"] = self.recompute
        return [part for name, value in flags.items() for part in (f"--{name}", str(value))]

    def describe(self) -> str:
        """Short text, e.g. ``TP8 CP1 PP16x8 DP64 mb1 full``; an uneven split shows its ends:
        per rank (``parallel.first_stage_layers/last_stage_layers``) in brackets, e.g.
        ``PP16[3+..+2]``, per virtual stage in parentheses, e.g. ``PP16x8(0+..+0)``."""
        pp = f"PP{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "")
        if self.first_stage_layers is not None:
            pp += f"[{self.first_stage_layers}+..+{self.last_stage_layers}]"
        if self.first_virtual_stage_layers is not None:
            pp += f"({self.first_virtual_stage_layers}+..+{self.last_virtual_stage_layers})"
        ep = f" EP{self.ep} ETP{self.etp}" if self.moe or self.ep > 1 or self.etp > 1 else ""
        return f"TP{self.tp} CP{self.cp} {pp} DP{self.dp}{ep} mb{self.micro_batch} {self.recompute}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_split(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """(first_stage_layers, last_stage_layers) for ``pp`` ranks: (None, None) when even."""
    if num_layers % pp == 0:
        return None, None
    q = -(-num_layers // pp)
    deficit = q * pp - num_layers
    return q - deficit // 2, q - (deficit - deficit // 2)


def virtual_split(num_layers: int, pp: int, vpp: int) -> tuple[int | None, int | None]:
    """(first, last) virtual-stage layers of Llama 3's rule over ``pp·vpp`` virtual stages:
    ``q = ceil(L/(pp·vpp))`` on the others, the last (with the head) giving up the larger half
    of the deficit; (None, None) when the layers divide evenly or a deficit end would be
    negative."""
    stages = pp * vpp
    if num_layers % stages == 0:
        return None, None
    q = -(-num_layers // stages)
    deficit = q * stages - num_layers
    first, last = q - deficit // 2, q - (deficit - deficit // 2)
    return (first, last) if min(first, last) >= 0 else (None, None)


def _model_accepts(model: GPTConfig, parallel: ParallelConfig, seq_length: int) -> bool:
    try:
        model.replace(sequence_parallel=parallel.tp > 1).check_layout(
            parallel, seq_length=seq_length
        )
    except ValueError:
        return False
    return True


def _splits(model: GPTConfig, pp: int) -> list[tuple[int, dict]]:
    """(vpp, uneven-ends keywords) of every pipeline split the search space holds for pp."""
    if pp == 1:
        return [(1, {})]
    first, last = pipeline_split(model.num_layers, pp)
    out = []
    for v in range(1, MAX_VPP + 1):
        candidates = [dict(first_stage_layers=first, last_stage_layers=last)]
        vfirst, vlast = virtual_split(model.num_layers, pp, v)
        if v > 1 and vfirst is not None:
            candidates.append(
                dict(first_virtual_stage_layers=vfirst, last_virtual_stage_layers=vlast)
            )
        seen = []
        for ends in candidates:
            try:
                counts = chunk_layer_counts(model.num_layers, pp, vpp=v, **ends)
            except ValueError:
                continue
            if counts not in seen:  # a virtual split equal to the per-rank one adds nothing
                seen.append(counts)
                out.append((v, ends))
    return out


def parallel_layouts(
    model: GPTConfig, *, num_gpus: int, gpus_per_node: int, global_batch: int, seq_length: int
) -> Iterator[Layout]:
    """Every (tp, cp, pp, vpp, dp, ep, etp) the trainer accepts, micro-batch 1, no recompute."""
    experts = model.moe.router.num_experts if model.moe is not None else 1
    for tp in (t for t in _divisors(num_gpus) if t <= gpus_per_node):
        for cp in _divisors(num_gpus // tp):
            if cp > 1 and seq_length // cp < MIN_CP_TOKENS:
                continue
            for pp in _divisors(num_gpus // (tp * cp)):
                dp = num_gpus // (tp * cp * pp)
                if global_batch % dp != 0 or pp > model.num_layers:
                    continue
                for ep in (e for e in _divisors(experts) if (tp * cp * dp) % e == 0):
                    for etp in sorted({1, tp}) if experts > 1 else [tp]:
                        if (tp * cp * dp) % (ep * etp) != 0:
                            continue
                        for vpp, ends in _splits(model, pp):
                            parallel = ParallelConfig(
                                tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp, ep=ep, etp=etp
                            )
                            parallel.resolve(num_gpus)
                            if not _model_accepts(model, parallel, seq_length):
                                continue
                            yield Layout(
                                tp, cp, pp, dp, ep, etp if experts > 1 else 1, vpp, **ends,
                                moe=experts > 1,
                            )  # fmt: skip


def variants(base: Layout, global_batch: int) -> Iterator[list[Layout]]:
    """Per recompute mode, ``base`` at each micro-batch size dividing ``global_batch / dp``, in
    increasing order (memory grows with the micro-batch, so a caller may stop at the first
    that does not fit)."""
    per_replica = global_batch // base.dp
    sizes = [b for b in MICRO_BATCHES if per_replica % b == 0]
    if base.vpp > 1:  # the interleaved schedule runs micro-batches in groups of pp
        sizes = [b for b in sizes if (per_replica // b) % base.pp == 0]
    for recompute in RECOMPUTE:
        yield [Layout(**{**base.__dict__, "micro_batch": b, "recompute": recompute}) for b in sizes]
