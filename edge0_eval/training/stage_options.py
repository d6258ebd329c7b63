"""Options and command lines of the three training stages, each option declared once as a
field whose flag arguments/fields.py generates.

Every stage is a run of --steps optimizer steps over seeded batches that checkpoints to
<out>.ckpt/ and resumes; the fields they share are `RunOptions`' and their checks
`validate_run`'s, defined once here for all of them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from edge0_eval.arguments.engine_flags import refuse_top_k
from edge0_eval.arguments.fields import (
    add_fields,
    check_fields,
    field_default,
    from_args,
    option,
)
from edge0_eval.engine.engine import EngineOptions
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.collect_fp32 import CHECK_TOKENS, COLLECT_MODES, MIN_AGREEMENT

MODES = ("prerouted", "reactive")  # the engine modes a student is trained in, as served
SAVE_DTYPES = ("float16", "bfloat16", "float32")
DISTILL_LR = 5e-5  # stage 3 starts from a trained adapter: a smaller step
# the heads' layout: stage 1's fields, shared with init-prerouter
HEAD_LAYOUT = ("start_layer", "width", "next_token")
RESUME_RULE = (
    "Resume rule: checkpoints go to <out>.ckpt/ every --ckpt-every steps; running the same "
    "command again continues from the last one automatically (bit-identical to an "
    "uninterrupted run). Changed training settings with an existing checkpoint are an "
    "error unless --fresh; --resume only insists that a checkpoint exists."
)


# -- what every stage shares -----------------------------------------------------------------------


@dataclass(kw_only=True)
class RunOptions:
    """Output, seed, checkpoint and resume options of every stage."""

    out: str = option(
        help="file to write (.safetensors); the report goes next to it, checkpoints to "
        "<out>.ckpt/",
        required=True,
    )
    seed: int = option(0, "random seed of the run")
    resume: bool = option(
        False, "require an existing checkpoint (resuming is automatic anyway)"
    )
    save_dtype: str = option(
        "float16", "dtype of the written heads or adapter", choices=SAVE_DTYPES
    )
    progress: bool = option(
        True, "no progress bars", flag="--no-progress", action="store_false"
    )


def add_run_flags(parser: argparse.ArgumentParser, cls, **changes) -> None:
    """A stage's flags from `cls`' fields; `--top-k` refused with the routing width's name."""
    add_fields(parser, cls, **changes)
    refuse_top_k(parser)
    # Test hook: SIGKILL the process right after that step's checkpoint (a real kill).
    parser.add_argument(
        "--kill-after-step", type=int, default=None, help=argparse.SUPPRESS
    )


def validate_run(opts) -> None:
    """The checks every stage shares: its fields' `least` and `choices`, and more."""
    check_fields(opts)
    if not opts.lr > 0:
        raise ConfigError("--lr must be positive")
    if opts.resume and opts.fresh:
        raise ConfigError("--resume and --fresh contradict each other")


# -- stage 1 ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PrerouterOptions(RunOptions):
    model: str = option(
        help="converted model directory (edge0-eval convert)", flag="model"
    )
    texts: list[str] = option(
        help="training text: plain files (one document each) or .jsonl (one "
        'document per line: "text", else "prompt" + "completion")',
        flag="--text",
        nargs="+",
        required=True,
        metavar="FILE",
    )
    owners: list[int] | None = option(
        None,
        "owner layers N (each predicts N+1; the last MoE layer: the first "
        "MoE layer of the next token): '6..38', '6-38', '6,7,8' or a list "
        "(default: start_layer-1 .. n_layers-2, MoE pairs only)",
        nargs="+",
    )
    start_layer: int | None = option(
        None,
        "first consuming layer (default: 0 for the 35B and 8B tiers, i.e. every MoE "
        "layer with the wrap-around head; other models the first MoE layer + 1; the "
        "reference heads start at 7 (35B) and 8 (8B))",
        type="nonneg_int",
    )
    width: int | None = option(
        None,
        "fc1 width (tiers 512; other models min(512, 2 x hidden))",
        type="positive_int",
        least=1,
    )
    experts_per_token: int | None = option(
        None,
        "serving K (35B tier 4, 8B tier 8; other models: native top-k)",
        type=int,
        metavar="K",
        least=1,
    )
    steps: int = option(1000, "optimizer steps", least=1)
    lr: float = option(1e-3, "Adam learning rate")
    batch: int = option(256, "tokens per step", least=1)
    holdout: float = option(0.1, "fraction of documents held out for the report")
    fresh: bool = option(
        False, "discard the training checkpoint (features of the same data kept)"
    )
    ckpt_every: int = option(100, "steps between checkpoints", least=1)
    max_doc_tokens: int = option(
        1024, "tokens kept per document (from its start)", least=2
    )
    # 35B: ~160 KB of float16 features per token on disk
    max_tokens: int = option(
        50_000, "total tokens collected over all documents", least=2
    )
    expert_budget_mib: float | None = option(
        None,
        "engine expert slot budget while collecting (default 2K slots/layer)",
        type=float,
    )
    collect: str = option(
        "served",
        "served: the engine as served (int4 kernels); float32: the same "
        "weights dequantized to float32 once (fast on a CPU with BLAS; "
        "checked against the served path first, refused if routing "
        f"agrees below {MIN_AGREEMENT} on any layer)",
        choices=COLLECT_MODES,
    )
    check_tokens: int = option(
        CHECK_TOKENS, "tokens of the first documents the float32 check runs on", least=1
    )
    train_tokens: int | None = option(
        None,
        "train on a seeded random subset of the training documents of about this many "
        "tokens (learning curves; the held-out documents stay the same)",
        type=int,
        least=2,
    )
    next_token: bool = option(
        False,
        "heads also see the sampled next token's input embedding: higher recall, but "
        "their reads start after the LM head and the sampling instead of overlapping "
        "them (default: the published context features)",
    )

    def validate(self) -> None:
        validate_run(self)
        if not self.texts:
            raise ConfigError("give at least one --text file")
        for text in self.texts:
            if not Path(text).is_file():
                raise ConfigError(f"--text {text}: no such file")
        if not 0 < self.holdout < 1:
            raise ConfigError("--holdout must be a fraction strictly between 0 and 1")


def parse_owners(values: list[str] | None) -> list[int] | None:
    """Accepts `6 7 8`, `6,7,8`, `6..38` or `6-38` (inclusive ranges)."""
    if not values:
        return None
    out = []
    for part in (p.strip() for value in values for p in str(value).split(",")):
        sep = ".." if ".." in part else "-" if "-" in part else None
        try:
            if sep:
                lo, hi = part.split(sep, 1)
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
        except ValueError:
            if sep:
                raise ConfigError(f"--owners: cannot read range {part!r}") from None
            raise ConfigError(f"--owners: {part!r} is not a layer number") from None
    return out


def add_prerouter_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of stage 1."""
    add_run_flags(parser, PrerouterOptions)
    parser.epilog = (
        f"{RESUME_RULE} Features collected from the model are reused while model, texts, K "
        "and token limits match."
    )


def prerouter_options_from_args(args: argparse.Namespace) -> PrerouterOptions:
    """Stage 1 options from its parsed arguments."""
    return from_args(PrerouterOptions, args, owners=parse_owners(args.owners))


# -- stages 2 and 3 --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class StageOptions(RunOptions):
    student: str = option(flag=False)  # from the positional models
    teacher: str = option(flag=False)
    prompts: list[str] = option(
        help='prompt files: .jsonl (one per line, field "prompt") or text '
        "(one prompt per non-empty line); chat template applied",
        nargs="+",
        required=True,
        metavar="FILE",
    )
    stage: str = option("sft", flag=False)  # "sft" | "distill": the verb's
    max_prompts: int | None = option(
        None,
        "use at most this many prompts of --prompts (first ones)",
        type=int,
        least=1,
    )
    eval_prompts: list[str] | None = option(
        None,
        "held-out prompts (default: a --heldout fraction of --prompts)",
        nargs="+",
        metavar="FILE",
    )
    heldout: float = option(
        0.1, "fraction of --prompts held out when --eval-prompts is not given"
    )
    eval_batch: int = option(4, "sequences per held-out evaluation batch", least=1)
    rank: int | None = option(None, "LoRA rank r (default 16)", type=int, least=1)
    alpha: float | None = option(None, "LoRA alpha (default 32)", type=float)
    targets: list[str] | None = option(
        None,
        "module path suffixes that get LoRA (default: attention, linear "
        "attention and shared-expert projections of the family)",
        nargs="+",
        metavar="PATTERN",
    )
    init_adapter: str | None = option(
        None, "start from this adapter (its r, alpha and targets)", metavar="FILE"
    )
    lr: float = option(
        1e-4, "Adam learning rate, constant (default 1e-4; distill 5e-5)"
    )
    steps: int = option(100, "optimizer steps", least=1)
    batch: int = option(4, "sequences per step", least=1)
    fresh: bool = option(
        False, "discard an existing training checkpoint and start over"
    )
    ckpt_every: int = option(10, "steps between checkpoints", least=1)
    seq_len: int = option(512, "max tokens per sequence (prompt + completion)", least=2)
    max_new_tokens: int = option(
        128, "completion length cap (teacher data, student samples)", least=1
    )
    grad_checkpoint: bool = option(
        False, "recompute each decoder layer in the backward pass (mx.checkpoint)"
    )
    # The student's engine, as served (its flags: ENGINE_FLAGS); training attaches its own
    # LoRA; slots_per_layer None: `models.training_slots`.
    engine: EngineOptions = option(
        factory=lambda: EngineOptions(mode="prerouted", no_lora=True), flag=False
    )
    kl_topk: int = option(
        64, "teacher top-k buckets (+ one tail bucket) of the KL losses", least=1
    )
    # stage 2
    teacher_temperature: float = option(
        0.0,
        "teacher sampling temperature for its training completions "
        "(0 = greedy; held-out continuations are always greedy)",
    )
    loss: str = option(
        "kl",
        "kl: the teacher's next-token distribution on its completions "
        "(forward KL, tail-aware top-k; default); ce: cross-entropy on "
        "the completion tokens only (classic hard-label SFT)",
        choices=("kl", "ce"),
    )
    # stage 3
    temperature: float = option(1.0, "student sampling temperature (0 = greedy)")
    top_p: float = option(1.0, "student nucleus sampling")

    def validate(self) -> None:
        validate_run(self)
        if not self.prompts:
            raise ConfigError("give at least one --prompts file")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError("--alpha must be positive")
        if not 0 < self.heldout < 1:
            raise ConfigError("--heldout must be a fraction strictly between 0 and 1")
        self.engine.validate()
        if self.engine.mode not in MODES:
            raise ConfigError(f"--mode must be {' or '.join(MODES)}")
        if self.teacher_temperature < 0 or self.temperature < 0:
            raise ConfigError("temperatures must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.init_adapter and not Path(self.init_adapter).is_file():
            raise CheckpointError(f"--init-adapter {self.init_adapter}: no such file")
        if (
            self.init_adapter
            and Path(self.init_adapter).resolve() == Path(self.out).resolve()
        ):
            raise ConfigError(
                "--out must differ from --init-adapter (the starting adapter is "
                "part of the run's identity and must stay as it is)"
            )
        for label, path in (("student", self.student), ("teacher", self.teacher)):
            if not (Path(path) / "config.json").is_file():
                raise CheckpointError(
                    f"{label} {path}: no config.json there; is it a model directory?"
                )


STAGE_ONLY = {
    "sft": ("temperature", "top_p"),
    "distill": ("teacher_temperature", "loss"),
}
# The student engine's flags: EngineOptions' fields, as a stage trains them.
ENGINE_FLAGS = {
    "mode": {
        "choices": MODES,
        "help": "the engine mode trained, as served: prerouted (prerouter "
        "predictions as routing) or reactive (the true router everywhere)",
    },
    "experts_per_token": {
        "help": "serving K, experts per token (default native)",
        "type": int,
    },
    "prerouter_path": {
        "help": "prerouter heads (default STUDENT/prerouter.safetensors)",
        "metavar": "FILE",
    },
    "slots_per_layer": {
        "help": "expert slots per MoE layer while training: the memory bound "
        "(default min(experts, batch x seq-len x K)); batches whose routed "
        "experts do not fit are split into micro-batches",
        "type": int,
    },
}


def engine_flags() -> dict:
    """ENGINE_FLAGS with the defaults of StageOptions' engine."""
    engine = field_default(StageOptions.__dataclass_fields__["engine"])
    return {k: {**v, "default": getattr(engine, k)} for k, v in ENGINE_FLAGS.items()}


def add_stage_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    """The arguments of stages 2 and 3 (`stage`: "sft" or "distill")."""
    parser.add_argument(
        "models",
        nargs="+",
        metavar="[TEACHER] STUDENT",
        help="the converted student directory (edge0-eval convert), optionally "
        "preceded by the teacher (like `convert SRC OUT`); or give the "
        "teacher with --teacher",
    )
    parser.add_argument(
        "--teacher",
        default=None,
        help="the fp16 teacher checkpoint (mlx-lm directory) the student came from",
    )
    suffix = " - normally stage 2's output" if stage == "distill" else ""
    add_run_flags(
        parser,
        StageOptions,
        skip=STAGE_ONLY[stage],
        init_adapter={
            "help": f"start from this adapter (its r, alpha and targets){suffix}"
        },
    )
    add_fields(parser, EngineOptions, only=ENGINE_FLAGS, **engine_flags())
    if stage == "distill":
        parser.set_defaults(lr=DISTILL_LR)


def teacher_and_student(args: argparse.Namespace) -> tuple[str, str]:
    """`TEACHER STUDENT`, or `STUDENT --teacher TEACHER`."""
    models = list(args.models)
    if len(models) == 2 and args.teacher is None:
        return models[0], models[1]
    if len(models) == 1 and args.teacher is not None:
        return args.teacher, models[0]
    raise ConfigError(
        "give the models as `TEACHER STUDENT` or as `STUDENT --teacher TEACHER` "
        f"(got positional {models} and --teacher {args.teacher})"
    )


def options_from_args(args: argparse.Namespace, stage: str) -> StageOptions:
    """Stage 2 or 3 options from its parsed arguments."""
    teacher, student = teacher_and_student(args)
    engine = from_args(EngineOptions, args, no_lora=True)
    return from_args(
        StageOptions, args, student=student, teacher=teacher, stage=stage, engine=engine
    )
