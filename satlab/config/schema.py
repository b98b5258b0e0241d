"""The experiment configuration: one typed dataclass per component, combined in :class:`ExperimentConfig`.

Budgets are in tokens; optimizer steps and gradient accumulation are derived (see ``satlab.config.derived``).

Every setting declares what is valid on its field, checked by :func:`satlab.config.structured.field_problems`: a
number its range (``metadata=in_range(low, high)``: the values a user could mean; NaN and infinities never are), a
name with a fixed set of values its ``choices``. What depends on several settings is checked in
``satlab.config.loader``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from satlab.config.errors import shown
from satlab.config.model import MAX_VOCAB, ModelConfig
from satlab.config.structured import in_range

TOKENIZER_KINDS = ("byte", "bpe", "hub")
SOURCE_KINDS = ("auto", "corpus", "files", "hub")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed")
"""``train.precision``: Lightning's names, or ``auto`` (the default): ``bf16-mixed`` on a CUDA GPU with bf16
arithmetic, ``32-true`` anywhere else. A run resolves ``auto`` once, before it records its config (see
``satlab.training.machine.resolve_precision``), so ``config.yaml``, the MLflow params and the checkpoint name the
precision it trained in."""
STRATEGIES = ("auto", "ddp", "fsdp", "model_parallel")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
"""``train.accelerator``: Lightning's accelerators (``gpu`` is its alias of ``cuda``)."""
BPE_MIN_VOCAB = 259
"""The smallest ``data.tokenizer.vocab_size`` of a ``bpe`` tokenizer: 256 bytes, end-of-text and one merge
(``satlab.data.tokenizer.BYTE_VOCAB`` + 1; the data layer checks it again for callers that skip the config)."""
RESUME_MODES = ("auto", "never")
MIX_SOURCES = ("recall", "copy")
"""Synthetic document sources ``data.mix`` can mix into the train split (see ``satlab.data.synthetic``)."""
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TASKS = ("mqar",)
"""``data.source=synthetic:<task>``: token-level tasks generated on the fly (see ``satlab.data.mqar``)."""
MQAR_LAYOUTS = ("adjacent", "separated", "multi_token_key")
MAX_TOKENS = 10**15
"""The largest token count of a budget or interval: a thousand times the largest budgets trained today."""


@dataclass
class MQARConfig:
    """Multi-query associative recall (Zoology), the task of ``data.source: synthetic:mqar``.

    A sequence of ``data.seq_len`` tokens holds ``num_pairs`` key-value pairs, then a query region of random filler
    tokens in which ``num_queries`` keys appear again (null: each key once); the model is scored only at the query
    keys, where the next token is the key's value. Keys come from one half of the vocabulary, values from the other.
    Layouts: ``adjacent`` (``k v``, Zoology's), ``separated`` (``k = v``: the lookup needs a key -> separator ->
    value composition) and ``multi_token_key`` (``k k' v``: a key is two tokens, queried as both).

    Training sequences are drawn fresh from (``train.seed``, sequence index), so a resumed run sees the same ones;
    the held-out set (``eval_sequences`` sequences) depends only on the task's settings, so every architecture and
    seed is scored on the same items, and no training sequence equals one of them. ``stop_at_acc`` ends the run at
    the first validation whose held-out accuracy reaches it (Zoology stops at 0.99); null trains the full budget.
    """

    vocab_size: int = field(default=8192, metadata=in_range(1, MAX_VOCAB))
    num_pairs: int = field(default=4, metadata=in_range(1, 10**6))
    num_queries: int | None = field(default=None, metadata=in_range(1, 10**6))
    layout: str = "adjacent"  # checked by problems(), for a synthetic:mqar source only, as is stop_at_acc
    eval_sequences: int = field(default=1000, metadata=in_range(1, 10**7))
    stop_at_acc: float | None = None

    @property
    def bind_threshold(self) -> float:
        """The held-out accuracy at which a run counts as bound (``recall/steps_to_bind``): where it stops, else
        Zoology's 0.99."""
        return 0.99 if self.stop_at_acc is None else self.stop_at_acc

    @property
    def key_len(self) -> int:
        return 2 if self.layout == "multi_token_key" else 1

    @property
    def pair_len(self) -> int:
        """Tokens one key-value pair takes in the context: key, separator (``separated``), value."""
        return self.key_len + (1 if self.layout == "separated" else 0) + 1

    @property
    def queries(self) -> int:
        return self.num_pairs if self.num_queries is None else self.num_queries

    @property
    def first_key(self) -> int:
        """Token ids: 0 end-of-text (unused in sequences), 1 the separator, keys from 2, values after the keys."""
        return 2

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - self.first_key) // 2

    def problems(self, seq_len: int) -> list[str]:
        """Why these settings cannot make a sequence of ``seq_len`` tokens (empty when they can)."""
        if self.layout not in MQAR_LAYOUTS:
            return [f"data.mqar.layout must be one of {', '.join(MQAR_LAYOUTS)}, got {shown(self.layout)}"]
        problems = []
        if self.vocab_size < 6:
            problems.append(f"data.mqar.vocab_size must be >= 6 (end-of-text, separator, 2 keys, 2 values), "
                            f"got {self.vocab_size}")
        if self.num_pairs < 1 or self.queries < 1:
            problems.append(f"data.mqar.num_pairs and num_queries must be >= 1, got {self.num_pairs} and "
                            f"{self.num_queries}")
        if self.eval_sequences < 1:
            problems.append(f"data.mqar.eval_sequences must be >= 1, got {self.eval_sequences}")
        if self.stop_at_acc is not None and not 0 < self.stop_at_acc <= 1:
            problems.append(f"data.mqar.stop_at_acc must be null or in (0, 1], got {self.stop_at_acc}")
        if problems:
            return problems
        distinct = self.num_keys ** self.key_len
        if self.num_pairs > min(distinct, self.vocab_size - self.first_key - self.num_keys):
            problems.append(f"data.mqar.num_pairs={self.num_pairs} needs that many distinct keys and values; "
                            f"vocab_size={self.vocab_size} gives {self.num_keys} key and "
                            f"{self.vocab_size - self.first_key - self.num_keys} value tokens")
        needed = self.num_pairs * self.pair_len + self.queries * self.key_len
        if needed > seq_len:
            problems.append(f"data.seq_len={seq_len} is too short for {self.num_pairs} {self.layout} pairs "
                            f"({self.pair_len} tokens each) and {self.queries} queries ({self.key_len} each): "
                            f"it needs >= {needed}; raise data.seq_len or lower data.mqar.num_pairs")
        return problems


@dataclass
class TokenizerConfig:
    """``byte``: 256 byte ids + specials; ``bpe``: trained locally on the training split with HF ``tokenizers`` and
    cached; ``hub``: a pretrained tokenizer by name (needs the network the first time)."""

    kind: str = field(default="bpe", metadata={"choices": TOKENIZER_KINDS})
    # a bpe one: >= BPE_MIN_VOCAB (checked by the loader), and what its corpus allows (the data layer says when it
    # stops short)
    vocab_size: int = field(default=8192, metadata=in_range(1, MAX_VOCAB))
    name: str | None = None


@dataclass
class DataConfig:
    """Where text comes from and how it is cut into training sequences.

    ``source`` is an embedded corpus name (``shakespeare``, ``kjv``, ``pystdlib``), a local file, folder or glob
    (text, jsonl or parquet), or a Hugging Face hub dataset name; ``source_kind: auto`` decides in that order.
    ``synthetic:mqar`` is no text at all: token-level associative recall generated on the fly (``mqar``).

    ``mix`` maps a synthetic source (``recall``: associative-recall documents; ``copy``: repeated random sequences,
    which teach a small model to copy before recall asks it to) to its share of the TRAIN tokens, e.g.
    ``{recall: 0.1}`` gives 90 % corpus, 10 % synthetic documents interleaved between corpus documents in a seeded
    order; each share in (0, 0.5], all together < 1; ``{}`` (the default) mixes nothing. Validation and test stay
    the pure corpus, so validation loss compares across runs with and without a mix, and the BPE tokenizer is
    trained on the corpus only, so the corpus is tokenized the same either way.

    Preparation (tokenizing and packing, once per data configuration, cached under ``cache_dir``) runs in
    ``num_proc`` processes (``None``: every core this process may use); the token files do not depend on it. In a
    multi-process job one process prepares: global rank 0, or local rank 0 of every node with
    ``prepare_per_node`` (for nodes that share no filesystem under ``cache_dir``); the others wait for it, and give
    up with an error when it shows no sign of life for ``prepare_timeout_s`` seconds.
    """

    source: str = "shakespeare"
    source_kind: str = field(default="auto", metadata={"choices": SOURCE_KINDS})
    text_field: str = "text"
    hub_config: str | None = None
    hub_split: str = "train"
    hub_max_documents: int | None = field(default=None, metadata=in_range(1, 10**12))
    seq_len: int = field(default=256, metadata=in_range(1, 2**22))
    val_fraction: float = field(default=0.05, metadata=in_range(0, 0.999))
    cache_dir: str = ".cache/satlab"
    num_workers: int = field(default=0, metadata=in_range(0, 256))
    num_proc: int | None = field(default=None, metadata=in_range(1, 4096))
    prepare_per_node: bool = False
    prepare_timeout_s: float = field(default=600.0, metadata=in_range(0, 10**7, low_excluded=True))
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    mix: dict[str, float] = field(default_factory=dict)
    mqar: MQARConfig = field(default_factory=MQARConfig)

    @property
    def synthetic_task(self) -> str | None:
        """``mqar`` for ``source: synthetic:mqar``; None for text sources."""
        return self.source.removeprefix(SYNTHETIC_PREFIX) if self.source.startswith(SYNTHETIC_PREFIX) else None


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio`` × ``lr``.

    Weight decay applies to matrices only (not norms, gains or static mixing weights) unless ``decay_all`` is set,
    which matches the reference code's decay-everything.
    """

    lr: float = field(default=3e-3, metadata=in_range(0, 10, low_excluded=True))
    betas: tuple[float, float] = (0.9, 0.95)  # each in [0, 1): checked by the loader
    eps: float = field(default=1e-8, metadata=in_range(0, 1, low_excluded=True))
    weight_decay: float = field(default=0.1, metadata=in_range(0, 10))
    decay_all: bool = False
    warmup_fraction: float = field(default=0.01, metadata=in_range(0, 0.999))
    warmup_tokens: int | None = field(default=None, metadata=in_range(0, MAX_TOKENS))
    min_lr_ratio: float = field(default=0.1, metadata=in_range(0, 1))
    grad_clip: float = field(default=1.0, metadata=in_range(0, 1e6))
    gate_lr_multiplier: float = field(default=1.0, metadata=in_range(0, 1e4, low_excluded=True))


@dataclass
class TrainConfig:
    max_tokens: int = field(default=2_000_000, metadata=in_range(1, MAX_TOKENS))
    global_batch_tokens: int = field(default=8192, metadata=in_range(1, 10**10))
    micro_batch_size: int = field(default=32, metadata=in_range(1, 10**7))
    seed: int = field(default=1337, metadata=in_range(0, 2**32 - 1))
    # bf16-mixed on a CUDA GPU with bf16, else 32-true (resolved when a run starts)
    precision: str = field(default="auto", metadata={"choices": PRECISIONS})
    compile: bool = False
    accelerator: str = field(default="auto", metadata={"choices": ACCELERATORS})
    devices: int = field(default=1, metadata=in_range(1, 4096))
    num_nodes: int = field(default=1, metadata=in_range(1, 10**4))
    strategy: str = field(default="auto", metadata={"choices": STRATEGIES})
    # model_parallel: size of the FSDP2 data-parallel mesh (None: all devices)
    data_parallel_size: int | None = field(default=None, metadata=in_range(1, 10**6))
    activation_checkpointing: bool = False  # every strategy: each block or sublayer call is recomputed in backward
    deterministic: bool = False
    val_every_tokens: int = field(default=250_000, metadata=in_range(1, MAX_TOKENS))
    val_tokens: int = field(default=65_536, metadata=in_range(1, 10**12))
    ckpt_every_tokens: int = field(default=500_000, metadata=in_range(1, MAX_TOKENS))
    keep_last_k: int = field(default=2, metadata=in_range(0, 10**6))
    out_dir: str = "runs"
    resume: str = field(default="auto", metadata={"choices": RESUME_MODES})
    log_every_n_steps: int = field(default=10, metadata=in_range(1, 10**7))
    # steps with a non-finite loss or gradient norm skipped before the run stops
    max_skipped_steps: int = field(default=20, metadata=in_range(0, 10**9))
    max_time_minutes: float | None = field(default=None, metadata=in_range(0, 10**7, low_excluded=True))


@dataclass
class EvalConfig:
    """Evaluation inside a training run: lm-eval tasks and the gate analysis at the end (and every ``every_tokens``),
    gate statistics at every validation. ``tasks`` are offline suite names (``satlab_offline`` is all of it) or,
    online, any lm-eval task or group; ``limit`` caps the items per task."""

    every_tokens: int | None = field(default=None, metadata=in_range(1, MAX_TOKENS))
    at_end: bool = True
    tasks: list[str] = field(default_factory=lambda: ["satlab_offline"])
    limit: int | None = field(default=None, metadata=in_range(1, 10**9))
    gate_windows: int = field(default=8, metadata=in_range(1, 10**5))


@dataclass
class TrackingConfig:
    """MLflow. ``uri: null`` means ``$MLFLOW_TRACKING_URI`` or the project's sqlite store ``mlruns/mlflow.db``."""

    enabled: bool = True
    uri: str | None = None
    artifact_dir: str | None = None
    experiment: str | None = None
    run_name: str | None = None  # the name the MLflow UI shows (default: the experiment's name); studies set it
    fallback_local: bool = False
    tags: dict[str, str] = field(default_factory=dict)  # extra run tags (a sweep sets mlflow.parentRunId here)


@dataclass
class ExperimentConfig:
    name: str = "default"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
