"""``RouterConfig``: every routing and load-balancing option of :class:`TopKRouter`.

- One frozen, keyword-only dataclass; each field carries its documentation as an
  attribute docstring (the README's option table is generated from the same text).
- Validated at construction: a bad value raises ``ValueError`` naming the field,
  the value and what would be valid, before any module or process group exists; a bool
  field holding anything but ``True`` / ``False`` (the string ``"False"`` is true) raises
  ``TypeError``. Numbers must be finite (no ``inf`` / ``nan``).
- Field names drop Megatron-Core's ``moe_`` prefix; ``docs/moe-router.md`` maps
  each one to its Megatron-Core flag.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields

from shardwork.moe_router.checks import (
    check_bool,
    check_groups,
    check_top_k,
    is_finite_number,
    is_int,
)

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = (
    "aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "sinkhorn",
    "quantile_balancing",
    "none",
)
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")
FUSED_BACKENDS = (None, "auto", "torch", "triton", "te")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Options of a top-k MoE router (semantics of Megatron-Core 0.19's ``TopKRouter``)."""

    num_experts: int
    """Number of routed experts E (Megatron: ``num_moe_experts``)."""
    hidden_size: int
    """Size H of the token vectors the router reads; inputs with another last dim are refused."""
    top_k: int = 2
    """Experts selected per token k (``moe_router_topk``)."""
    score_function: str = "softmax"
    """Score function turning logits into scores: ``softmax``, ``sigmoid`` or ``sqrtsoftplus``
    (``sqrt(softplus(x))``); ``moe_router_score_function``."""
    pre_softmax: bool = False
    """Softmax only: apply softmax over all experts before top-k (Mixtral after-norm, Switch)
    instead of a softmax over the k selected logits (``moe_router_pre_softmax``)."""
    top_k_scaling_factor: float | None = None
    """Multiply the selected probabilities by this factor (DeepSeek-V3: 2.5);
    ``moe_router_topk_scaling_factor``."""
    num_groups: int | None = None
    """Group-limited routing: experts split into this many equal groups, e.g. one per EP rank
    or node (``moe_router_num_groups``); needs ``group_top_k``."""
    group_top_k: int | None = None
    """Group-limited routing: groups kept per token, ranked by their group score (see
    ``group_score_top_n``); ``moe_router_group_topk``."""
    group_score_top_n: int | None = None
    """Group-limited routing: a group's score is the sum of its n best selection scores. None:
    n = ``top_k // group_top_k`` (Megatron-Core's rule); 2: transformers' DeepSeek-V3 / Kimi-K2 /
    GLM-4.5 rule; 1: DeepSeek-V2's group maximum. :func:`group_score_top_n_for_hf` reads it off
    a Hugging Face ``config.json``. Must be between 1 and the experts per group."""
    load_balancing_type: str | tuple[str, ...] = "aux_loss"
    """``aux_loss`` (Switch/GShard over the micro-batch), ``seq_aux_loss`` (per sequence),
    ``global_aux_loss`` (token counts over data-parallel ranks and micro-batches),
    ``sinkhorn`` (balanced assignment, no loss), ``quantile_balancing`` (a per-expert offset
    ``qb_beta`` from a quantile of the logits, updated by :func:`update_quantile_balancing`
    once per step; no loss), ``none``, or a tuple of the three loss types with one coefficient
    each in ``aux_loss_coeff`` (``moe_router_load_balancing_type``)."""
    aux_loss_coeff: float | tuple[float, ...] = 0.0
    """Coefficient of the load-balancing loss, or one per entry of ``load_balancing_type``
    when that is a tuple (``moe_aux_loss_coeff``). 0 disables the loss."""
    z_loss_coeff: float | None = None
    """Coefficient of the router z-loss ``mean(logsumexp(logits)^2)`` (ST-MoE);
    ``moe_z_loss_coeff``. None disables it."""
    capacity_factor: float | None = None
    """Expert capacity = ceil(tokens * top_k / E * capacity_factor); tokens beyond it are dropped
    (``moe_expert_capacity_factor``). None: dropless."""
    token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: highest ``probs`` or earliest ``position``
    (``moe_token_drop_policy``)."""
    pad_to_capacity: bool = False
    """Fill every expert to exactly its capacity with zero-probability slots, giving static
    shapes (``moe_pad_expert_input_to_capacity``); needs ``capacity_factor``."""
    router_dtype: str | None = None
    """Precision of the gating matmul and scores: None (the input's dtype), ``fp32`` or ``fp64``
    whatever the model dtype (``moe_router_dtype``)."""
    input_jitter_eps: float | None = None
    """Multiply router inputs by uniform noise in [1-eps, 1+eps] while training (Switch);
    ``moe_input_jitter_eps``."""
    add_bias: bool = False
    """Learnable gating bias added to the logits (Megatron-Core's ``add_bias_linear`` on the
    router; MoE recipes keep it off)."""
    enable_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert fp32 bias added to the scores
    for selection only, updated by :func:`update_expert_bias` from token counts
    (``moe_router_enable_expert_bias``). Needs sigmoid or sqrtsoftplus scores."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update, ``bias += rate * sign(mean_count - count)``
    (``moe_router_bias_update_rate``)."""
    quantile_balancing_ema: float = 0.0
    """Quantile balancing only: memory of the ``qb_beta`` update, ``beta = ema * beta + (1 - ema)
    * mean quantile`` once per step; 0 replaces the offset by the step's quantile, 1 freezes it
    (``moe_router_quantile_balancing_ema``). A value from 0 to 1."""
    force_load_balancing: bool = False
    """Benchmarking only: replace the logits by standard-normal noise with straight-through
    gradients, giving balanced random routing (``moe_router_force_load_balancing``)."""
    calculate_per_token_loss: bool = False
    """The trainer divides gradients by the global token count instead of averaging per
    micro-batch: aux and z losses are multiplied by the local token count so their gradients
    keep the same scale (``calculate_per_token_loss``)."""
    check_finite: bool = False
    """Raise ``FloatingPointError`` when router logits contain NaN/Inf. Forces a host sync on
    every forward, so it is opt-in."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the gating weight (and bias)."""
    fused_backend: str | None = None
    """Run score + top-k selection through ``shardwork.fused_kernels.router_topk`` with this
    backend (``auto``, ``torch``, ``triton``, ``te``); needs the ``[fused]`` extra. None: this
    package's own torch path. Losses and dropping are unchanged either way."""
    _coeffs: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_bools()
        self._check_sizes()
        self._check_choices()
        self._check_losses()
        self._check_capacity()
        self._check_quantile_balancing()
        coeffs: dict[str, float] = {}
        if isinstance(self.load_balancing_type, str):
            if self.load_balancing_type in AUX_LOSS_TYPES:
                coeffs[self.load_balancing_type] = float(self.aux_loss_coeff)
        else:
            for name, coeff in zip(self.load_balancing_type, self.aux_loss_coeff):
                coeffs[name] = float(coeff)
        object.__setattr__(self, "_coeffs", coeffs)

    def _check_bools(self) -> None:
        """Every ``bool`` field must hold a real bool: ``pre_softmax="False"`` would act as
        True and route silently wrong."""
        for f in fields(self):
            if f.type == "bool":
                check_bool("RouterConfig.", f.name, getattr(self, f.name))

    def _check_sizes(self) -> None:
        for name in ("num_experts", "hidden_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(
                    f"RouterConfig.{name}={value!r} is invalid: it must be an integer >= 1"
                )
        check_top_k("RouterConfig.", self.top_k, self.num_experts)
        check_groups(
            "RouterConfig.",
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_groups=self.num_groups,
            group_top_k=self.group_top_k,
            group_score_top_n=self.group_score_top_n,
        )
        self._check_fused_group_score()

    def _check_fused_group_score(self) -> None:
        """The fused router scores a group by its top ``top_k // group_top_k`` only."""
        n = self.group_score_top_n
        if n is not None and self.fused_backend is not None and n != self.top_k // self.group_top_k:
            raise ValueError(
                f"RouterConfig.group_score_top_n={n} is invalid with fused_backend="
                f"{self.fused_backend!r}: the fused router scores a group by its top "
                f"top_k // group_top_k = {self.top_k // self.group_top_k}; use that value, None, "
                "or fused_backend=None"
            )

    def _check_choices(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"RouterConfig.score_function={self.score_function!r} is invalid: use one of {SCORE_FUNCTIONS}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"RouterConfig.router_dtype={self.router_dtype!r} is invalid: use one of {ROUTER_DTYPES}"
            )
        if self.token_drop_policy not in DROP_POLICIES:
            raise ValueError(
                f"RouterConfig.token_drop_policy={self.token_drop_policy!r} is invalid: use one of "
                f"{DROP_POLICIES}"
            )
        if self.fused_backend not in FUSED_BACKENDS:
            raise ValueError(
                f"RouterConfig.fused_backend={self.fused_backend!r} is invalid: use one of {FUSED_BACKENDS}"
            )
        if (
            self.fused_backend is not None
            and importlib.util.find_spec("shardwork.fused_kernels") is None
        ):
            raise ValueError(
                f"RouterConfig.fused_backend={self.fused_backend!r} needs shardwork-fused-kernels: "
                "install shardwork-moe-router[fused] or set fused_backend=None"
            )
        if self.pre_softmax and self.score_function != "softmax":
            raise ValueError(
                f"RouterConfig.pre_softmax=True is invalid with score_function={self.score_function!r}: "
                "it only applies to softmax"
            )
        if self.enable_expert_bias and self.score_function == "softmax":
            raise ValueError(
                "RouterConfig.enable_expert_bias=True is invalid with score_function='softmax': "
                "use 'sigmoid' or 'sqrtsoftplus'"
            )
        if (
            self.top_k == 1
            and self.score_function == "softmax"
            and not self.pre_softmax
            and self.load_balancing_type != "sinkhorn"
        ):
            raise ValueError(
                "RouterConfig.pre_softmax=False is invalid with top_k=1 and softmax scores: a softmax "
                "over one logit is constant 1 and gives the router no gradient; set pre_softmax=True"
            )
        for name in ("top_k_scaling_factor", "input_jitter_eps", "z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and (not is_finite_number(value) or value < 0):
                raise ValueError(
                    f"RouterConfig.{name}={value!r} is invalid: it must be None or a finite "
                    "number >= 0"
                )
        for name in ("expert_bias_update_rate", "init_std"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(
                    f"RouterConfig.{name}={value!r} is invalid: it must be a finite number >= 0"
                )

    def _check_losses(self) -> None:
        lb = self.load_balancing_type
        if isinstance(lb, list):
            lb = tuple(lb)
            object.__setattr__(self, "load_balancing_type", lb)
        if isinstance(self.aux_loss_coeff, list):
            object.__setattr__(self, "aux_loss_coeff", tuple(self.aux_loss_coeff))
        coeff = self.aux_loss_coeff
        if isinstance(lb, str):
            if lb not in LOAD_BALANCING_TYPES:
                raise ValueError(
                    f"RouterConfig.load_balancing_type={lb!r} is invalid: use one of "
                    f"{LOAD_BALANCING_TYPES} or a tuple of {AUX_LOSS_TYPES}"
                )
            if not is_finite_number(coeff) or coeff < 0:
                raise ValueError(
                    f"RouterConfig.aux_loss_coeff={coeff!r} is invalid: with a single "
                    "load_balancing_type it must be one finite number >= 0"
                )
            if lb == "sinkhorn" and coeff != 0:
                raise ValueError(
                    f"RouterConfig.aux_loss_coeff={coeff!r} is invalid with load_balancing_type="
                    "'sinkhorn': sinkhorn balances without a loss, set it to 0"
                )
            return
        if (
            not isinstance(lb, tuple)
            or not lb
            or any(t not in (*AUX_LOSS_TYPES, "none") for t in lb)
        ):
            raise ValueError(
                f"RouterConfig.load_balancing_type={lb!r} is invalid: a tuple must be non-empty and "
                f"list only {(*AUX_LOSS_TYPES, 'none')}"
            )
        if len(set(lb)) != len(lb):
            raise ValueError(
                f"RouterConfig.load_balancing_type={lb!r} is invalid: it repeats a type"
            )
        if (
            not isinstance(coeff, tuple)
            or len(coeff) != len(lb)
            or any(not is_finite_number(c) or c < 0 for c in coeff)
        ):
            raise ValueError(
                f"RouterConfig.aux_loss_coeff={coeff!r} is invalid: with load_balancing_type={lb!r} "
                f"it must be a tuple of {len(lb)} finite numbers >= 0, one per type"
            )

    def _check_capacity(self) -> None:
        cf = self.capacity_factor
        if cf is not None:
            if not is_finite_number(cf) or cf <= 0:
                raise ValueError(
                    f"RouterConfig.capacity_factor={cf!r} is invalid: it must be None or a finite "
                    "number > 0 (None: no dropping)"
                )
            if self.load_balancing_type == "sinkhorn":
                raise ValueError(
                    f"RouterConfig.capacity_factor={cf!r} is invalid with load_balancing_type="
                    "'sinkhorn': token dropping needs top-k routing"
                )
        if self.pad_to_capacity and cf is None:
            raise ValueError(
                "RouterConfig.pad_to_capacity=True is invalid without capacity_factor: set a capacity"
            )

    def _check_quantile_balancing(self) -> None:
        ema = self.quantile_balancing_ema
        if not is_finite_number(ema) or not 0 <= ema <= 1:
            raise ValueError(
                f"RouterConfig.quantile_balancing_ema={ema!r} is invalid: it must be a number "
                "from 0 to 1"
            )
        if self.load_balancing_type != "quantile_balancing":
            if ema != 0:
                raise ValueError(
                    f"RouterConfig.quantile_balancing_ema={ema!r} is invalid with "
                    f"load_balancing_type={self.load_balancing_type!r}: it is used only with "
                    "'quantile_balancing'; leave it 0"
                )
            return
        refused = (
            (self.aux_loss_coeff != 0, f"aux_loss_coeff={self.aux_loss_coeff!r}", "0 (no loss)"),
            (self.num_groups is not None, f"num_groups={self.num_groups!r}", "None"),
            (self.enable_expert_bias, "enable_expert_bias=True", "False"),
            (self.fused_backend is not None, f"fused_backend={self.fused_backend!r}", "None"),
            (
                self.capacity_factor is not None,
                f"capacity_factor={self.capacity_factor!r}",
                "None (Megatron-Core refuses token dropping here too; the offset balances)",
            ),
            (
                self.top_k >= self.num_experts,
                f"top_k={self.top_k}",
                f"< num_experts={self.num_experts} (the (top_k+1)-th expert sets the token's level)",
            ),
        )
        for bad, setting, valid in refused:
            if bad:
                raise ValueError(
                    f"RouterConfig.{setting} is invalid with load_balancing_type="
                    f"'quantile_balancing': use {valid}"
                )

    def aux_loss_coeff_for(self, loss_type: str) -> float:
        """Coefficient of ``loss_type`` (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``); 0 if unused."""
        return self._coeffs.get(loss_type, 0.0)

    @property
    def aux_loss_enabled(self) -> bool:
        """True when any load-balancing loss has a positive coefficient."""
        return any(c > 0 for c in self._coeffs.values())
