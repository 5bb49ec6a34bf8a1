"""Which transformer layers each pipeline stage (and virtual chunk) holds.

- ``pp`` ranks × ``vpp`` chunks = ``pp·vpp`` virtual stages; chunk ``c`` of rank ``r`` is
  virtual stage ``c·pp + r`` and the layers run in virtual-stage order.
- Uneven ends per rank (Megatron's ``num_layers_in_first/last_pipeline_stage``): the first
  and/or last *rank* may hold a given number of layers (e.g. fewer, to make room for the
  embedding or the LM head and loss), spread evenly over that rank's ``vpp`` chunks; the
  other ranks share the rest evenly.
- Uneven ends per virtual stage (``first_virtual_stage_layers`` /
  ``last_virtual_stage_layers``): virtual stage 0 (chunk 0 of the first rank) and/or the
  last virtual stage (the last chunk of the last rank) hold a given number of layers, and
  every other virtual stage the same share of the rest. This is the Llama 3 405B split
  (Dubey et al. 2024, §3.3.2): with interleaving, the first and the last virtual stage hold
  one layer fewer than the others, so that the first chunk holds only the embedding and the
  last one only the head and loss (126 layers over 16 ranks × 8 chunks: 0 + 126 × 1 + 0).
  The ends need not be multiples of ``vpp``; the two forms exclude each other.
- Counts that do not divide evenly raise ValueError naming the field and what would be
  valid. A stage may hold zero layers.
"""

from __future__ import annotations


def _check(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


def _rank_totals(
    num_layers: int, pp_size: int, v: int, first_stage_layers, last_stage_layers
) -> list[int]:
    """Layers per rank with (optionally) fixed first/last ranks, each spread over v chunks."""
    counts: list[int | None] = [None] * pp_size
    for name, value, rank in (
        ("first_stage_layers", first_stage_layers, 0),
        ("last_stage_layers", last_stage_layers, pp_size - 1),
    ):
        if value is None:
            continue
        _check(name, value, 0)
        if pp_size == 1:
            raise ValueError(f"{name}={value} needs pp_size > 1 (got pp_size=1)")
        if value % v != 0:
            raise ValueError(
                f"{name}={value} is invalid with vpp={v}: it must be a multiple of vpp "
                "(the rank's layers are spread evenly over its chunks; "
                "first_virtual_stage_layers / last_virtual_stage_layers set one chunk instead)"
            )
        counts[rank] = value
    fixed = sum(c for c in counts if c is not None)
    free = [r for r, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < 0 or (not free and rest != 0):
        raise ValueError(
            f"first_stage_layers={first_stage_layers} and last_stage_layers={last_stage_layers} "
            f"do not fit num_layers={num_layers} over pp_size={pp_size}"
        )
    if free and rest % (len(free) * v) != 0:
        raise ValueError(
            f"num_layers={num_layers} is invalid for pp_size={pp_size}, vpp={v}"
            + (
                f" with first_stage_layers={first_stage_layers}, last_stage_layers={last_stage_layers}"
                if fixed
                else ""
            )
            + f": the {rest} remaining layers must split evenly over {len(free)} ranks × {v} chunks"
        )
    for r in free:
        counts[r] = rest // len(free)
    return [int(c) for c in counts]  # type: ignore[arg-type]


def _virtual_counts(
    num_layers: int, pp_size: int, v: int, first: int | None, last: int | None
) -> list[list[int]]:
    """Layers per virtual stage with (optionally) fixed first/last virtual stages."""
    stages: list[int | None] = [None] * (pp_size * v)
    for name, value, index in (
        ("first_virtual_stage_layers", first, 0),
        ("last_virtual_stage_layers", last, pp_size * v - 1),
    ):
        if value is None:
            continue
        _check(name, value, 0)
        if pp_size == 1:
            raise ValueError(f"{name}={value} needs pp_size > 1 (got pp_size=1)")
        stages[index] = value
    fixed = sum(c for c in stages if c is not None)
    free = [i for i, c in enumerate(stages) if c is None]
    rest = num_layers - fixed
    ends = f"first_virtual_stage_layers={first} and last_virtual_stage_layers={last}"
    if rest < 0 or (not free and rest != 0):
        raise ValueError(f"{ends} do not fit num_layers={num_layers} over pp_size={pp_size}")
    if free and rest % len(free) != 0:
        raise ValueError(
            f"num_layers={num_layers} is invalid for pp_size={pp_size}, vpp={v} with {ends}: "
            f"the {rest} remaining layers must split evenly over the {len(free)} other virtual "
            "stages"
        )
    counts = [rest // len(free) if c is None else c for c in stages]
    # virtual stage c·pp + r is chunk c of rank r
    return [[counts[c * pp_size + r] for c in range(v)] for r in range(pp_size)]


def chunk_layer_counts(
    num_layers: int,
    pp_size: int,
    *,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> list[list[int]]:
    """``counts[pp_rank][chunk]``: the number of layers of every virtual stage."""
    _check("num_layers", num_layers, 1)
    _check("pp_size", pp_size, 1)
    v = 1 if vpp is None else vpp
    _check("vpp", v, 1)
    per_rank = first_stage_layers is not None or last_stage_layers is not None
    virtual = first_virtual_stage_layers is not None or last_virtual_stage_layers is not None
    if per_rank and virtual:
        raise ValueError(
            f"first_stage_layers={first_stage_layers} / last_stage_layers={last_stage_layers} "
            f"and first_virtual_stage_layers={first_virtual_stage_layers} / "
            f"last_virtual_stage_layers={last_virtual_stage_layers} exclude each other: set the "
            "ends per rank or per virtual stage, not both"
        )
    if virtual:
        return _virtual_counts(
            num_layers, pp_size, v, first_virtual_stage_layers, last_virtual_stage_layers
        )
    totals = _rank_totals(num_layers, pp_size, v, first_stage_layers, last_stage_layers)
    return [[n // v] * v for n in totals]


def layers_per_rank(
    num_layers: int,
    pp_size: int,
    *,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> list[int]:
    """Number of layers on each pipeline rank (all its chunks together)."""
    counts = chunk_layer_counts(
        num_layers,
        pp_size,
        vpp=vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
    )
    return [sum(chunks) for chunks in counts]


def layer_split(
    num_layers: int,
    pp_size: int,
    *,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> list[list[range]]:
    """``split[pp_rank][chunk]``: the global layer indices of every stage and chunk."""
    v = 1 if vpp is None else vpp
    counts = chunk_layer_counts(
        num_layers,
        pp_size,
        vpp=vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
    )
    split: list[list[range]] = [[range(0)] * v for _ in range(pp_size)]
    start = 0
    # Chunk-major: chunk c of every rank before chunk c+1, so virtual stage c·pp + r holds the
    # next layers after virtual stage c·pp + r - 1 (Megatron's interleaved assignment).
    for c in range(v):
        for r in range(pp_size):
            split[r][c] = range(start, start + counts[r][c])
            start += counts[r][c]
    assert start == num_layers
    return split


def stage_layers(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    *,
    vpp: int | None = None,
    vp_chunk: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> range:
    """Global layer indices held by chunk ``vp_chunk`` (default 0) of rank ``pp_rank``."""
    v = 1 if vpp is None else vpp
    chunk = 0 if vp_chunk is None else vp_chunk
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank!r} is invalid: it must be in [0, {pp_size})")
    if not isinstance(chunk, int) or not 0 <= chunk < v:
        raise ValueError(f"vp_chunk={vp_chunk!r} is invalid: it must be in [0, {v}) for vpp={vpp}")
    split = layer_split(
        num_layers,
        pp_size,
        vpp=vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
    )
    return split[pp_rank][chunk]
