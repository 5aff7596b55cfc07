"""The training configuration: one frozen dataclass; unknown keys are errors listing valid ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshlm.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    config: str = "cpu"  # model preset (see `meshlm configs`)
    data: tuple[str, ...] = ()  # files, directories or globs; () = the Python stdlib's .py files
    steps: int = 200  # optimizer steps (default: ~5 min on a 2-core CPU, val bpb 8.1 -> ~2.8)
    batch_size: int = 32  # global sequences per optimizer step (split over dp and micro-batches)
    seq_len: int = 128  # tokens per sequence (bytes)
    lr: float = 3e-3  # peak learning rate (warm-up then cosine decay to lr * 0.1)
    warmup_steps: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decay on weight matrices only
    clip_norm: float = 1.0  # global gradient-norm clip (0 disables)
    accum_steps: int = 1  # micro-batches per step (gradient accumulation)
    compute_dtype: str = "float32"  # "bfloat16": bf16 compute, float32 master weights
    eval_every: int = 50  # steps between validation evaluations (0: only at the end)
    eval_batches: int = 8  # validation batches per evaluation
    save_every: int = 100  # steps between checkpoints (0: only at the end)
    keep: int = 3  # checkpoints to keep
    log_every: int = 1  # steps between metrics.jsonl train rows
    seed: int = 0  # parameter init and data order
    out: str = "runs/main"  # run directory: checkpoints, metrics.jsonl, TensorBoard, loss curve
    fresh: bool = False  # start over; refuses if `out` already holds checkpoints
    checkpoint: str = ""  # initial parameters from this checkpoint (e.g. a converted HF model)
    sample_tokens: int = 200  # bytes generated at the end as a sample (0: none)

    def __post_init__(self):
        positive = ("steps", "batch_size", "seq_len", "accum_steps", "eval_batches", "keep", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.accum_steps:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by accum_steps={self.accum_steps}"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute_dtype={self.compute_dtype!r}; valid: float32, bfloat16")

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.accum_steps

    def optim(self):
        """The optax-side settings (imported lazily: this module must not import JAX)."""
        from meshlm.train.optim import OptimConfig

        return OptimConfig(
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.steps,
            weight_decay=self.weight_decay,
            clip_norm=self.clip_norm,
            accum_steps=self.accum_steps,
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        return d


def train_config_from_dict(d: dict) -> TrainConfig:
    valid = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ConfigError(f"unknown train config field(s) {unknown}; valid: {', '.join(valid)}")
    d = dict(d)
    if "data" in d:
        d["data"] = tuple(d["data"])
    return TrainConfig(**d)
