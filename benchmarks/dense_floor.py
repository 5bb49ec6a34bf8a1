"""The floor under a dense training step on the CPU: its products, attention and optimizer alone.

A step of the dense model must run every linear's three matrix products (forward ``x·Wᵀ``,
input gradient ``dY·W``, weight gradient ``dYᵀ·x``), the attention kernel forward and backward,
and the optimizer's update. This module times each of them alone at the model's shapes, in the
process that times the sides and in the same rounds (``dense_step.py --floor``):

- each product with both float32 libraries of the torch build (MKL through ``torch.mm``, oneDNN
  through its linear op: ``cpu_gemm.py``'s ``linear_products``), interleaved, and the faster
  one's median counts: a floor over the libraries at hand, not shardwork's own choice;
- attention as torch's SDPA (causal, grouped K/V), forward and backward, on contiguous
  ``[b, h, s, d]`` tensors and on views of ``[b, s, h, d]`` ones, the faster counting;
- the optimizer step the sides were timed with (gradients in place).

Their sum is what a step costs if everything else (norms, activations, rotary, residuals, the
loss's softmax, the embedding, autograd's bookkeeping) were free. ``side step / floor`` is then
the largest ratio shardwork could reach against that side without faster products, attention
or optimizer kernels; the goal's 1.10x is within reach only where it exceeds 1.10 by what the
elementwise work needs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from cpu_gemm import linear_products


def linears(shape: dict) -> list[tuple[str, int, int, int]]:
    """``(name, in, out, count)``: each linear of the model at ``shape`` (``dense_step.SHAPES``)
    and how many there are; ``M`` (rows) is the step's token count for all of them."""
    h, heads, kv = shape["hidden"], shape["heads"], shape["kv_heads"]
    d, layers = h // heads, shape["layers"]
    return [
        ("qkv", h, (heads + 2 * kv) * d, layers),
        ("attention out", heads * d, h, layers),
        ("mlp fc1", h, 2 * shape["ffn"], layers),
        ("mlp fc2", shape["ffn"], h, layers),
        ("head", h, shape["vocab"], 1),
    ]


class StepFloor:
    """The floor's calls at ``shape`` (``dense_step.SHAPES``), timed one round at a time so that
    the rounds can interleave with the sides' (``dense_step.time_rounds``); ``optimizer_step``
    steps the optimizer the sides were timed with."""

    def __init__(self, shape: dict, optimizer_step: Callable[[], None]):
        self.shape = shape
        self.calls: dict[tuple[str, ...], Callable[[], object]] = {}
        gen = torch.Generator().manual_seed(0)
        tokens = shape["seq"] * shape["batch"]
        for name, k, n, _ in linears(shape):
            x = torch.randn(tokens, k, generator=gen)
            w = torch.randn(n, k, generator=gen) * k**-0.5
            dy = torch.randn(tokens, n, generator=gen)
            for kind, (mkl, onednn) in linear_products(x, w, dy).items():
                self.calls[(name, kind, "mkl")] = mkl
                self.calls[(name, kind, "onednn")] = onednn
        for layout in ("bhsd", "bshd"):
            self.calls[("attention", layout)] = _attention_call(shape, layout, gen)
        self.calls[("optimizer",)] = optimizer_step
        self.times: dict[tuple[str, ...], list[float]] = {key: [] for key in self.calls}
        for fn in self.calls.values():  # warm-up
            fn()

    def time_round(self) -> None:
        """Each call once, in milliseconds."""
        for key, fn in self.calls.items():
            start = time.perf_counter()
            fn()
            self.times[key].append(1e3 * (time.perf_counter() - start))

    def result(self) -> dict:
        """The parts (medians over the rounds, ms) and their sum (module docstring)."""
        ms = {key: statistics.median(t) for key, t in self.times.items()}
        tokens = self.shape["seq"] * self.shape["batch"]
        products = []
        for name, k, n, count in linears(self.shape):
            for kind in ("forward x·Wᵀ", "input grad dY·W", "weight grad dYᵀ·x"):
                products.append({"linear": name, "product": kind, "mnk": [tokens, n, k],
                                 "count": count,
                                 "mkl_ms": ms[(name, kind, "mkl")],
                                 "onednn_ms": ms[(name, kind, "onednn")]})  # fmt: skip
        attention = {layout: ms[("attention", layout)] for layout in ("bhsd", "bshd")}
        products_ms = sum(r["count"] * min(r["mkl_ms"], r["onednn_ms"]) for r in products)
        attention_ms = self.shape["layers"] * min(attention.values())
        optimizer_ms = ms[("optimizer",)]
        return {
            "products": products,
            "attention_layer_ms": attention,
            "products_ms": products_ms,
            "attention_ms": attention_ms,
            "optimizer_ms": optimizer_ms,
            "floor_ms": products_ms + attention_ms + optimizer_ms,
            "rounds": len(self.times[("optimizer",)]),
            "threads": torch.get_num_threads(),
        }


def _attention_call(shape: dict, layout: str, gen: torch.Generator) -> Callable[[], None]:
    """One layer's SDPA (causal, grouped K/V) forward + backward on contiguous ``[b, h, s, d]``
    tensors (``bhsd``) or on views of ``[b, s, h, d]`` ones (``bshd``)."""
    b, s, heads, kv = shape["batch"], shape["seq"], shape["heads"], shape["kv_heads"]
    d = shape["hidden"] // heads
    dy = torch.randn(b, heads, s, d, generator=gen)
    dims = [(b, n, s, d) if layout == "bhsd" else (b, s, n, d) for n in (heads, kv, kv)]
    leaves = [torch.randn(dim, generator=gen).requires_grad_() for dim in dims]

    def call():
        q, k, v = leaves if layout == "bhsd" else (t.transpose(1, 2) for t in leaves)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
        out.backward(dy)
        for t in leaves:
            t.grad = None

    return call


def markdown(floor: dict, step_ms: dict[str, float]) -> list[str]:
    """The floor section of ``dense_step``'s table: the parts, then each side against them."""
    lines = [
        "",
        "## The floor: products, attention and optimizer alone",
        "",
        f"Each at the model's shapes, median of {floor['rounds']} rounds interleaved with the "
        f"sides' rounds, {floor['threads']} thread(s); a product counts at the faster of MKL "
        "and oneDNN, attention at the faster layout. side / floor: the largest ratio "
        "shardwork could reach against that side if nothing else in its step took time.",
        "",
        "| linear | product | M, N, K | count | MKL ms | oneDNN ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in floor["products"]:
        mnk = ", ".join(map(str, r["mnk"]))
        lines.append(f"| {r['linear']} | {r['product']} | {mnk} | {r['count']} "
                     f"| {r['mkl_ms']:.2f} | {r['onednn_ms']:.2f} |")  # fmt: skip
    att = ", ".join(f"{k} {v:.2f}" for k, v in floor["attention_layer_ms"].items())
    lines += [
        "",
        f"products {floor['products_ms']:.1f} ms + attention {floor['attention_ms']:.1f} ms "
        f"(one layer forward + backward: {att}) + optimizer {floor['optimizer_ms']:.1f} ms "
        f"= floor {floor['floor_ms']:.1f} ms",
        "",
        "| side | step ms | step / floor |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {ms:.1f} | {ms / floor['floor_ms']:.3f} |" for name, ms in step_ms.items()
    ]
    return lines
