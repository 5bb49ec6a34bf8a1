"""The trainer's configuration: one small ``kw_only`` dataclass per concern.

- :class:`TrainConfig` composes model, parallel, precision, optimizer,
  schedule, data, checkpoint, logging, eval and reliability sections.
- Every field's docstring is its documentation: ``shardwork-train --help``
  shows it next to the ``--section.field`` flag.
- The defaults ARE the no-argument demo: a small byte-level GPT trained on
  the standard library's ``pydoc_data`` topics on one CPU process.
- Names: a section that configures a package's own object is a ``*Section`` (``model`` →
  ``shardwork.models.GPTConfig``, ``parallel`` → ``shardwork.parallel_state.ParallelConfig``,
  ``optimizer`` → the ``shardwork.dist_optimizer`` optimizers); the trainer's own concerns are
  ``*Config``. No two classes share a name across the packages.
- ``[model]`` holds a preset and changes to its GPTConfig (:class:`ModelSection`); the
  dimensions the run leaves unset come from the preset or :data:`DEMO_MODEL`, and
  ``resolve_config`` writes them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DEMO_MODEL = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "ffn_hidden_size": 352,
    "make_vocab_size_divisible_by": 64,
}
"""Architecture of the demo GPT (about 0.87 M parameters with the byte vocabulary)."""


@dataclass(kw_only=True)
class ModelSection:
    """Which model to train: a base architecture and changes to it (the ``[model]`` table).

    The base is ``preset`` (a shardwork.models preset), else the folder of
    ``checkpoint.hf_init``, else :data:`DEMO_MODEL`. Every other key of ``[model]`` is a field
    of :class:`shardwork.models.GPTConfig`, and nested configs are nested tables
    (``[model.moe]``, ``[model.moe.router]``, ``[model.mla]``, ``[model.mtp]``), checked against
    those dataclasses when the file is read (:mod:`.model_table`).
    """

    preset: str | None = None
    """A shardwork.models preset name (e.g. 'llama3-8b'); None: the small demo GPT."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The GPTConfig fields this run changes, nested like the configs, e.g. ``{"num_layers": 2,
    "moe": {"router": {"aux_loss_coeff": 0.01}}}``; written as keys and tables of ``[model]``."""


@dataclass(kw_only=True)
class ParallelSection:
    """How the ranks are laid out (shardwork.parallel_state.ParallelConfig); dp is derived."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    vpp: int | None = None
    """Virtual pipeline chunks per stage (interleaved 1F1B); None: not interleaved."""
    cp: int = 1
    """Context-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models)."""
    etp: int | None = None
    """Expert tensor-parallel size; None: equal to tp."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying first."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline rank (uneven split, e.g. to make room for the embedding);
    None: an even split."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline rank (e.g. fewer, to make room for the LM head and loss)."""
    first_virtual_stage_layers: int | None = None
    """Layers of the first virtual stage (chunk 0 of the first rank); every other virtual
    stage holds the same share of the rest. Llama 3's interleaved split gives the first and last
    virtual stage one layer fewer (e.g. 126 layers, pp=16, vpp=8: 0 and 0, the other 126
    chunks one layer each). Excludes first_stage_layers / last_stage_layers; None: unset."""
    last_virtual_stage_layers: int | None = None
    """Layers of the last virtual stage (the last chunk of the last rank, with the head)."""
    mtp_standalone: bool = False
    """Put the model's MTP depths on a pipeline rank of their own (Megatron-Core's standalone MTP
    stage): the last rank holds no decoder layer, only MTP, the LM head and the losses; the rank
    before it applies the final norm. Needs [model.mtp], pp >= 2 and vpp unset or 1;
    last_stage_layers must stay unset. False: MTP shares the last stage with its layers."""
    sequence_parallel: bool = False
    """Split activations outside attention/MLP along the sequence over the TP group (needs tp > 1)."""
    fsdp: Literal["off", "full", "zero2"] = "off"
    """Fully sharded data parallelism (torch's FSDP2 per transformer layer, through
    shardwork.dist_optimizer.FullyShardedDataParallel): parameters, gradients and AdamW state
    sharded over the data-parallel ranks (dense over dp×cp, experts over edp), on top of
    tp/pp/cp/ep. 'full': a layer's parameters are gathered for its forward and again for its
    backward. 'zero2': kept gathered from a layer's forward to its backward (no second gather;
    every layer's gathered parameters resident in between). 'off': ZeRO-1 (optimizer state
    sharded only). Needs optimizer.name='adamw', at least 2 ranks; with precision.dtype='bf16'
    the sharded parameters stay fp32 (the masters) and layers compute in bf16."""
    fsdp_prefetch: int = 1
    """fsdp: layers ahead (in forward) and behind (in backward) whose parameter all-gather a
    layer starts before its own compute, to overlap the two; 0: torch's own order."""
    fsdp_reduce_per_micro_batch: bool = False
    """fsdp: reduce-scatter gradients after every micro-batch instead of accumulating them
    unsharded (every parameter's TP-local size, fp32) until the last micro-batch; holds less
    memory, costs one reduce-scatter per micro-batch."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: nccl on CUDA, gloo on CPU."""
    timeout_minutes: float = 10.0
    """Timeout of every process group (world and subgroups) and of the start-up rendezvous. A
    collective that waits longer (a hung or vanished peer) ends the rank with exit status 6 and
    a message naming the phase and the groups; see docs/trainer.md, "When a rank dies"."""


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numeric formats, device, and how the layers execute (eager or compiled)."""

    dtype: Literal["fp32", "bf16", "fp16", "fp64"] = "fp32"
    """Parameter / activation dtype. bf16/fp16 keep fp32 master weights and optimizer state;
    fp64 keeps everything (parameters, gradients, masters, moments) in float64, for exactness
    tests that compare layouts at rtol 1e-9."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto: CUDA when available, else CPU."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 main_grad buffers."""
    initial_loss_scale: float = 65536.0
    """fp16 only: starting dynamic loss scale."""
    compile: bool = False
    """Compile each transformer layer with torch.compile (inductor: generated C++ on a CPU,
    Triton on a GPU; shardwork.models.compile_blocks). The first step also compiles (seconds to
    minutes); the trainer then logs the graphs and every graph break once. MoE dispatch runs
    eagerly inside the layer; generation stays eager. On a CPU it needs a C++ compiler ($CXX,
    else g++), checked before start-up."""


@dataclass(kw_only=True)
class OptimizerSection:
    """Optimizer (shardwork.dist_optimizer: AdamW over ZeRO-1 shards of fp32 master weights and
    state, or Muon with whole parameters on owner ranks) and its weight-decay schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """The update rule. 'adamw': AdamW (decoupled weight decay; 1-D parameters get no decay)
    on every parameter, ZeRO-1 sharded. 'muon': Muon (momentum + Newton–Schulz
    orthogonalisation) for the 2-D hidden-layer matrices and AdamW (beta1, beta2, eps) for
    embedding, LM head, norms, biases and stacked expert weights; each parameter is stepped
    whole on one data-parallel owner rank."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Weight decay at step 0 (decoupled, AdamW style)."""
    weight_decay_end: float | None = None
    """Weight decay at the last step; None: constant."""
    weight_decay_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from weight_decay to weight_decay_end over the run."""
    muon_lr: float = 0.02
    """muon: peak learning rate of the Muon matrices (their LR is lr(step) × muon_lr / lr, so
    they follow the same schedule); the update is also scaled by sqrt(max(1, rows/cols))."""
    muon_momentum: float = 0.95
    """muon: momentum μ of the Muon matrices, in [0, 1)."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum (orthogonalise (1-μ)·g + μ·buf instead of buf)."""
    muon_ns_steps: int = 5
    """muon: Newton–Schulz iterations per update (>= 1)."""
    beta1: float = 0.9
    """Adam beta1 (with muon: of the AdamW part)."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the next forward pass."""
    bucket_size_mb: float = 40.0
    """Gradient bucket size for the data-parallel reduction."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """Steps, batch sizes and the learning-rate schedule."""

    train_steps: int = 300
    """Optimizer steps to train."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 16
    """Sequences per forward pass on one rank; global / (micro × dp) micro-batches are accumulated."""
    batch_size_ramp: list[tuple[int, int]] = field(default_factory=list)
    """(step, global batch size) pairs: from that step on, that batch size (before the first: global_batch_size)."""
    lr_schedule: Literal["constant", "linear", "cosine", "inverse_sqrt", "wsd"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = 20
    """Linear warmup steps: lr = lr * (step + 1) / warmup_steps."""
    lr_decay_steps: int | None = None
    """Step at which the decay reaches min_lr; None: train_steps."""
    wsd_decay_steps: int | None = None
    """WSD: length of the final decay phase; None: 20% of lr_decay_steps."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """WSD: shape of the final decay."""
    pipeline_schedule: Literal["auto", "1f1b", "interleaved"] = "auto"
    """Pipeline schedule: auto picks no-pipelining (pp=1), 1F1B, or interleaved 1F1B (vpp>1).
    The layout decides it; a value that disagrees with the layout is refused."""


@dataclass(kw_only=True)
class DataConfig:
    """Training data: a built-in corpus, indexed datasets with weights, or a JSON data config."""

    corpus: str | None = "pydoc"
    """Built-in corpus used when no prefixes or data_config are given ('pydoc': Python's help topics)."""
    prefixes: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (PREFIX.bin / PREFIX.idx), blended by weights and split by split."""
    weights: list[float] = field(default_factory=list)
    """One blend weight per prefix; empty: equal weights."""
    data_config: str | None = None
    """JSON file with per-split blends: {"train": [[w, prefix], ...], "valid": [...], "test": [...]}."""
    split: str = "90,10,0"
    """train,valid,test proportions of each prefix's documents (ignored with data_config)."""
    seq_length: int = 128
    """Tokens per sample."""
    tokenizer: str = "byte"
    """'byte' (built in) or the path of a Hugging Face tokenizers JSON file."""
    eod_token: str | None = None
    """End-of-document token of a HF tokenizer; None: the usual names are tried."""
    cache_dir: str | None = None
    """Where built-in corpora are preprocessed; None: $SHARDWORK_CACHE or ~/.cache/shardwork."""
    shuffle: bool = True
    """Shuffle documents and samples (with the run's seed)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints through shardwork.dist_checkpoint's CheckpointManager."""

    dir: str | None = None
    """Checkpoint directory; None: RUN_DIR/checkpoints."""
    interval: int | None = None
    """Save every this many steps; None: only at the end (and on a signal)."""
    keep_last: int = 2
    """Keep the newest this many checkpoints."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = "auto"
    """'auto': resume from the newest complete checkpoint in dir if any; 'none'; or a checkpoint path."""
    fallback: bool = True
    """With resume='auto': if the newest checkpoint fails verification (a file differs from its
    recorded checksum), resume from the newest intact one, saying so. False: stop (exit 4)."""
    load_optimizer: bool = True
    """On resume, load the optimizer state (False: fresh optimizer, e.g. for fine-tuning)."""
    load_rng: bool = True
    """On resume, load RNG states (only possible at the same layout; otherwise re-derived)."""
    save_at_end: bool = True
    """Save a checkpoint when training finishes."""
    save_on_signal: bool = True
    """On SIGTERM/SIGINT, finish the current step, save a checkpoint and exit cleanly."""
    hf_init: str | None = None
    """A Hugging Face checkpoint folder (config.json + safetensors; Llama, Qwen 2/3, Mixtral,
    Qwen-MoE, DeepSeek-V3) to fine-tune: the architecture comes from its config.json (leave
    model.preset and the model dimensions unset, or equal to it; other [model] keys may change
    fields that keep every tensor's shape, e.g. dropout) and its weights are imported at this
    run's layout before step 0. A run that resumes a shardwork checkpoint loads that instead."""
    megatron_init: str | None = None
    """A Megatron-Core ``torch_dist`` checkpoint folder (e.g. Megatron-LM's ``iter_0001000``;
    GPT/Llama-style, TE or local layer names, MoE experts) to start from: the architecture is
    the ``[model]`` table's (preset and fields, which must match the checkpoint's tensors) and
    the weights are imported at this run's layout before step 0. Not with ``hf_init``, nor with
    ``resume`` naming a checkpoint; a run that resumes its own checkpoint (``auto``) loads that."""
    hf_export: str | None = None
    """When training finishes (not when stopped by a signal), write the model as a Hugging Face
    folder here (config.json + safetensors, loadable by transformers); a new or empty directory."""


@dataclass(kw_only=True)
class LoggingConfig:
    """Where the run writes and what it shows."""

    name: str = "demo"
    """Run name."""
    run_dir: str | None = None
    """Output directory (metrics, plots, checkpoints); None: runs/NAME."""
    interval: int = 10
    """Log metrics every this many steps."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """auto: a progress bar on a terminal, plain lines otherwise."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    per_rank: bool = False
    """Every other rank also writes RUN_DIR/metrics-rank{r}.jsonl (default: rank 0 only)."""
    plot: bool = True
    """Write PNG plots into RUN_DIR at the end."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; None: known GPU table, or a measured matmul rate on CPU."""


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation on the validation split."""

    interval: int | None = 100
    """Evaluate every this many steps; None: only at the end."""
    steps: int | None = None
    """Global batches per evaluation (``steps × schedule.global_batch_size`` validation samples,
    the same at every layout, as Megatron's ``eval_iters``); None: the whole validation split,
    rounded down to whole global batches."""
    at_end: bool = True
    """Evaluate after the last step."""


@dataclass(kw_only=True)
class ReliabilityConfig:
    """What to do when things go wrong."""

    on_nan: Literal["skip", "stop"] = "stop"
    """NaN/Inf loss or gradient: skip the step (no update) or stop with a checkpoint-free error."""
    max_consecutive_skips: int = 5
    """With on_nan='skip': stop after this many skipped steps in a row."""
    check_dp_params_interval: int | None = None
    """Every this many steps, check that all data-parallel replicas hold identical parameters."""


@dataclass(kw_only=True)
class PeftSection:
    """Parameter-efficient fine-tuning: LoRA adapters on a frozen model (shardwork.models'
    ``LoRAConfig``). The base weights come from ``checkpoint.hf_init`` (or the seed's init);
    checkpoints of the run hold the adapters and their optimizer state only."""

    method: str = "none"
    """'none' (train every weight) or 'lora'."""
    rank: int = 8
    """Adapter rank r."""
    alpha: float = 16.0
    """Scale numerator: updates are scaled by alpha / r (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1)."""
    use_rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(r)."""
    target_modules: tuple[str, ...] | str = ("linear_qkv", "linear_proj", "fc1", "fc2")
    """Module-name suffixes (a list, like PEFT's) or one regular expression over full module
    names (a string), e.g. ["linear_qkv", "fc2"] or 'decoder\\.layers\\.[01]\\..*fc1'."""
    init: str | None = None
    """A Hugging Face PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for the
    model of ``checkpoint.hf_init``: the adapters start from it instead of PEFT's init. Its
    rank, alpha, rsLoRA and targets (after shardwork's rank-k·r rule for separate q/k/v
    adapters) must be the section's: validation says which values to write."""
    export: str | None = None
    """A new or empty directory: a finished run writes its adapters there as a Hugging Face
    PEFT folder (adapter_config.json + adapter_model.safetensors) for the model of
    ``checkpoint.hf_init`` (needed). ``checkpoint.hf_export`` writes the merged model."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs."""

    seed: int = 1234
    """Seed of parameter init, data order and dropout (per-rank streams are derived from it)."""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    peft: PeftSection = field(default_factory=PeftSection)
