"""Pipeline schedules as data: each rank's order of forward/backward steps, timed into ticks.

- A schedule is first a per-rank *order* of actions, ``F(chunk, microbatch)`` and
  ``B(chunk, microbatch)``: 1F1B (Megatron's warm-up / steady / cool-down order) and
  interleaved 1F1B (virtual chunks; Megatron's grouping of microbatches in groups of
  ``pp``). Model chunk ``c`` on pipeline rank ``r`` is *virtual stage* ``c * pp + r``;
  activations flow from virtual stage ``v`` to ``v + 1`` (so from the last rank back to
  the first one between chunks) and gradients the other way.
- :func:`plan_ticks` then times every rank's order together (as soon as possible, one
  action per rank per tick, an input usable one tick after it was produced). Every
  message produced at tick ``t`` is exchanged by both its ends in their tick-``t``
  exchange, so each exchange pairs only with exchanges of the same tick: by induction
  on ``t`` no exchange can wait forever, whatever the transport's send semantics
  (rendezvous NCCL sends or buffered gloo ones). A schedule whose order cannot run
  raises here, before any communication.
- Every rank computes the plan of every rank (cheap: ``O(pp · vpp · microbatches)``),
  so both ends of a message agree on it without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``kind`` "F" (forward) or "B" (backward) of one model chunk."""

    kind: str
    chunk: int
    microbatch: int


@dataclass(frozen=True, order=True)
class Message:
    """A tensor travelling between pipeline ranks (ranks are indices in the pp group).

    ``kind`` "act" (activation, forward) or "grad" (gradient of that activation);
    ``chunk`` is the receiver's model chunk that consumes it (for "act") or produced
    the activation it is the gradient of (for "grad").
    """

    kind: str
    src: int
    dst: int
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Tick:
    """What one rank does at one tick: an action (or none), then one exchange."""

    index: int
    action: Action | None
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")


def one_f_one_b_order(
    pp_size: int, pp_rank: int, num_microbatches: int, *, forward_only: bool = False
) -> list[Action]:
    """1F1B: ``pp_size - pp_rank - 1`` warm-up forwards, then alternate F/B, then cool-down Bs.

    At most ``pp_size - pp_rank`` microbatches are in flight (activations kept) on a rank.
    With ``pp_size == 1`` this is plain gradient accumulation: F0 B0 F1 B1 ...
    """
    m = num_microbatches
    if forward_only:
        return [Action("F", 0, i) for i in range(m)]
    # The last stage needs no warm-up; each earlier stage one more, to fill the pipeline before
    # its first backward arrives (Narayanan et al. 2021, PipeDream-Flush / 1F1B).
    warmup = min(pp_size - pp_rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, i) for i in range(m - warmup, m)]
    return order


def interleaved_order(
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int,
    *,
    forward_only: bool = False,
) -> list[Action]:
    """Interleaved 1F1B over ``vpp`` chunks per rank; ``num_microbatches % pp_size == 0``.

    Microbatches run in groups of ``pp_size``: virtual step ``k`` runs the forward of chunk
    ``(k // pp) % vpp`` and the backward of chunk ``vpp - 1 - (k // pp) % vpp``, on
    microbatch ``(k // (pp·vpp))·pp + k % pp``. Warm-up length is
    ``min(2·(pp - rank - 1) + (vpp - 1)·pp, microbatches·vpp)`` as in Megatron-Core.
    """
    p, v, m = pp_size, vpp, num_microbatches
    total = m * v

    def microbatch(k: int) -> int:
        # Within a group of p·v virtual steps the same p microbatches visit each chunk in turn.
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action("F", (k // p) % v, microbatch(k))

    def backward(k: int) -> Action:
        return Action("B", v - 1 - (k // p) % v, microbatch(k))

    if forward_only:
        return [forward(k) for k in range(total)]
    # Megatron-Core's num_warmup_microbatches for the interleaved schedule, so the two orders match.
    warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def peak_in_flight(
    pp_size: int, pp_rank: int, num_microbatches: int, chunk_bytes: list[float]
) -> float:
    """Most activation bytes rank ``pp_rank`` holds at once under :func:`schedule_orders`
    (interleaved when ``len(chunk_bytes) > 1``, else 1F1B), ``chunk_bytes[c]`` being what one
    micro-batch's forward of chunk ``c`` keeps until its backward.

    Walks the order's chunk sequence without building it: the warm-up forwards, then
    forward/backward pairs. After the warm-up every ``pp·vpp`` pairs repeat the same chunks, so
    the peak is reached within one such period; the cool-down only frees. 1F1B gives
    ``min(pp − rank, m)·chunk_bytes[0]``; the interleaved order does not reduce to a factor
    when chunks differ (Llama 3's split empties the first chunk, the one most micro-batches
    wait in).
    """
    p, v, m = pp_size, len(chunk_bytes), num_microbatches
    total = m * v
    if v == 1:
        warmup = min(p - pp_rank - 1, m)
    else:
        warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    # forward k runs chunk (k // p) % v; backward k chunk v - 1 - (k // p) % v (interleaved_order)
    held = sum(chunk_bytes[(k // p) % v] for k in range(warmup))
    peak = held
    for j in range(min(total - warmup, p * v)):
        held += chunk_bytes[((warmup + j) // p) % v]
        peak = max(peak, held)
        held -= chunk_bytes[v - 1 - (j // p) % v]
    return peak


def schedule_orders(
    pp_size: int,
    num_microbatches: int,
    *,
    vpp: int | None = None,
    forward_only: bool = False,
) -> list[list[Action]]:
    """Every rank's action order: interleaved when ``vpp > 1``, else 1F1B. Validates sizes."""
    _check_positive("pp_size", pp_size)
    _check_positive("num_microbatches", num_microbatches)
    v = 1 if vpp is None else vpp
    _check_positive("vpp", v)
    if v == 1:
        return [
            one_f_one_b_order(pp_size, r, num_microbatches, forward_only=forward_only)
            for r in range(pp_size)
        ]
    if pp_size < 2:
        raise ValueError(f"vpp={vpp} needs pp_size >= 2 (got pp_size={pp_size})")
    if num_microbatches % pp_size != 0:
        raise ValueError(
            f"num_microbatches={num_microbatches} is invalid for the interleaved schedule: it must "
            f"be a multiple of pp_size={pp_size} (microbatches run in groups of pp_size)"
        )
    return [
        interleaved_order(pp_size, r, num_microbatches, v, forward_only=forward_only)
        for r in range(pp_size)
    ]


def plan_ticks(orders: list[list[Action]], *, vpp: int = 1) -> list[list[Tick]]:
    """Time every rank's order into ticks; returns, per rank, its non-empty ticks in order.

    Raises RuntimeError if an order cannot run (an action waits on one that never comes).
    """
    p = len(orders)
    last_virtual = p * vpp - 1
    produced: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, mb) -> tick
    pointers = [0] * p
    done_forward: set[tuple[int, int, int]] = set()
    actions: list[dict[int, Action]] = [{} for _ in range(p)]
    messages: dict[int, list[Message]] = {}
    tick = 0
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            if pointers[r] == len(orders[r]):
                continue
            a = orders[r][pointers[r]]
            vs = a.chunk * p + r
            if a.kind == "F":
                dep = ("F", vs - 1, a.microbatch) if vs > 0 else None
            else:
                if (r, a.chunk, a.microbatch) not in done_forward:
                    raise RuntimeError(f"rank {r}: {a} comes before its forward")
                dep = ("B", vs + 1, a.microbatch) if vs < last_virtual else None
            # An input produced at tick t is exchanged at the end of tick t, so it is usable from
            # t+1.
            if dep is not None and produced.get(dep, tick) >= tick:
                continue
            produced[(a.kind, vs, a.microbatch)] = tick
            actions[r][tick] = a
            if a.kind == "F":
                done_forward.add((r, a.chunk, a.microbatch))
                if vs < last_virtual:
                    nxt = vs + 1
                    # Virtual stage v lives on rank v % p as chunk v // p.
                    msg = Message("act", r, nxt % p, nxt // p, a.microbatch)
                    messages.setdefault(tick, []).append(msg)
            elif vs > 0:
                msg = Message("grad", r, (vs - 1) % p, (vs - 1) // p, a.microbatch)
                messages.setdefault(tick, []).append(msg)
            pointers[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {r: orders[r][pointers[r]] for r in range(p) if pointers[r] < len(orders[r])}
            raise RuntimeError(f"pipeline order cannot run; waiting actions: {stuck}")
        tick += 1

    plans: list[list[Tick]] = [[] for _ in range(p)]
    for t in range(tick):
        # Both ends see the same sorted list, so they post a tick's messages in the same order.
        msgs = sorted(messages.get(t, ()))
        for r in range(p):
            sends = tuple(m for m in msgs if m.src == r)
            recvs = tuple(m for m in msgs if m.dst == r)
            action = actions[r].get(t)
            if action is not None or sends or recvs:
                plans[r].append(Tick(t, action, sends, recvs))
    return plans
