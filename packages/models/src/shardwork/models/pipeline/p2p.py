"""Point-to-point exchange of activations and gradients between pipeline ranks.

- :class:`P2PExchange` runs one tick's exchange of a plan (see ``plan.py``): every send and
  receive of the tick is posted at once with ``torch.distributed.batch_isend_irecv`` and
  waited on before returning, so the exchange is one NCCL group on GPUs and a set of
  gloo isend/irecv on CPUs.
- Both ends post a tick's messages in the same canonical order (sorted :class:`Message`),
  and activations and gradients use different tags, so sends and receives pair correctly
  even when two messages travel between the same two ranks in one tick (pp = 2 with
  virtual chunks).
- Shapes: with ``tensor_shape`` given every activation has that shape and dtype
  (Megatron's convention, e.g. ``(seq, micro_batch, hidden)``). Without it, each
  activation is preceded by a small header (dtype code, rank, dims) exchanged in the
  same tick, so shapes may change from microbatch to microbatch. A gradient always has
  its activation's shape, which both ends know.
- Peers are addressed by their index in the pp group (``group_peer``). On NCCL a one-element
  all-reduce over the pp group precedes the first exchange (torch requires every rank of a
  group in its first ``batch_isend_irecv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwork.models.pipeline.plan import Message

# Distinct tags keep an activation and a gradient between the same two ranks in one tick
# (pp = 2 with virtual chunks) from pairing with each other.
_TAGS = {"act": 0, "grad": 1}
_HEADER_TAG = 2
# Header: [dtype code, ndim, dims..., zero padding], a fixed length so the receiver can post it
# before knowing the shape.
_MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
)


def _post(ops: list, messages: Sequence[Message], tensors: dict, me: int, group, tag_of) -> None:
    for msg in messages:
        tensor = tensors[msg]
        if msg.src == me:
            ops.append(
                dist.P2POp(dist.isend, tensor, group=group, group_peer=msg.dst, tag=tag_of(msg))
            )
        else:
            ops.append(
                dist.P2POp(dist.irecv, tensor, group=group, group_peer=msg.src, tag=tag_of(msg))
            )


def _run(ops: list) -> None:
    if ops:
        # All of a tick's sends and receives are posted together, so two ranks that both send before
        # they receive cannot block each other.
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def check_activation(
    tensor: object,
    tensor_shape: tuple[int, ...] | None,
    dtype: torch.dtype,
    *,
    chunk: int,
    microbatch: int,
) -> None:
    """Raise ValueError if a stage output cannot be sent as promised to the next stage."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"forward_step_func returned output of type {type(tensor).__name__} for chunk "
            f"{chunk}, microbatch {microbatch} on a non-last pipeline stage: it must be a tensor"
        )
    if tensor_shape is not None and (tuple(tensor.shape) != tensor_shape or tensor.dtype != dtype):
        raise ValueError(
            f"stage output of chunk {chunk}, microbatch {microbatch} has shape "
            f"{tuple(tensor.shape)} and dtype {tensor.dtype}, but tensor_shape="
            f"{tensor_shape} and dtype={dtype} were promised to the next stage"
        )
    if tensor_shape is None and (tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES):
        raise ValueError(
            f"stage output with shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot be "
            f"sent without tensor_shape: at most {_MAX_DIMS} dims and a dtype in {_DTYPES}"
        )


class P2PExchange:
    """Sends and receives the tensors of one pipeline rank over the pp group.

    ``tensor_shape``/``dtype``: fixed activation shape and dtype, or ``tensor_shape=None``
    to exchange a header with each activation. ``device``: where receive buffers live.
    """

    def __init__(
        self,
        pp_group,
        *,
        tensor_shape: Sequence[int] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group = pp_group
        self.rank = dist.get_rank(pp_group)
        self.tensor_shape = None if tensor_shape is None else tuple(int(s) for s in tensor_shape)
        self.dtype = dtype
        self.device = device
        if dist.get_backend(pp_group) != "gloo":
            # torch: if batch_isend_irecv is the first operation on a NCCL group, every rank of
            # the group must take part; the first tick involves only the first two stages.
            dist.all_reduce(torch.zeros(1, device=device), group=pp_group)

    def check_activation(self, tensor: object, *, chunk: int, microbatch: int) -> None:
        """Raise ValueError if a stage output cannot be sent as an activation."""
        check_activation(tensor, self.tensor_shape, self.dtype, chunk=chunk, microbatch=microbatch)

    def exchange(
        self,
        sends: dict[Message, torch.Tensor],
        recvs: Sequence[Message],
        *,
        grad_specs: dict[Message, tuple[torch.Size, torch.dtype]],
    ) -> dict[Message, torch.Tensor]:
        """Send ``sends`` and receive ``recvs`` (one tick); return the received tensors.

        ``grad_specs`` gives (shape, dtype) of each gradient to receive: those of the
        activation this rank sent earlier for the same chunk and microbatch.
        """
        specs: dict[Message, tuple[torch.Size, torch.dtype]] = {}
        act_recvs = [m for m in recvs if m.kind == "act"]
        if self.tensor_shape is None:
            headers: dict[Message, torch.Tensor] = {}
            for msg, tensor in sends.items():
                if msg.kind == "act":
                    header = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
                    header += [0] * (_MAX_DIMS + 2 - len(header))
                    headers[msg] = torch.tensor(header, dtype=torch.int64, device=self.device)
            for msg in act_recvs:
                headers[msg] = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
            ops: list = []
            # Headers go in their own round before the payloads: the receiver needs the shape to
            # allocate. Sorted, so both ends post in the same order.
            _post(ops, sorted(headers), headers, self.rank, self.group, lambda m: _HEADER_TAG)
            _run(ops)
            for msg in act_recvs:
                h = headers[msg].tolist()
                specs[msg] = (torch.Size(h[2 : 2 + h[1]]), _DTYPES[h[0]])
        else:
            for msg in act_recvs:
                specs[msg] = (torch.Size(self.tensor_shape), self.dtype)
        for msg in recvs:
            if msg.kind == "grad":
                specs[msg] = grad_specs[msg]

        # torch.distributed sends only contiguous tensors (a strided view would raise).
        tensors = {m: t.contiguous() for m, t in sends.items()}
        received = {
            m: torch.empty(specs[m][0], dtype=specs[m][1], device=self.device) for m in recvs
        }
        tensors.update(received)
        ops = []
        # Canonical (sorted) order on both ends, so matching sends and receives pair up.
        _post(ops, sorted(tensors), tensors, self.rank, self.group, lambda m: _TAGS[m.kind])
        _run(ops)
        return received
