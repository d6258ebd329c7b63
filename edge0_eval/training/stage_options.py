"""Options and command lines of the three training stages.

Every stage is a run of --steps optimizer steps over seeded batches that checkpoints to
<out>.ckpt/ and resumes; those arguments (`add_run_arguments`) and their checks (`validate_run`)
are defined once here for all of them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from edge0_eval.arguments import value_types as ct
from edge0_eval.arguments.engine_flags import add_experts_per_token
from edge0_eval.engine.engine import EngineOptions
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.collect_fp32 import CHECK_TOKENS, COLLECT_MODES, MIN_AGREEMENT

MODES = ("prerouted", "reactive")  # the engine modes a student is trained in, as served
SAVE_DTYPES = ("float16", "bfloat16", "float32")
DISTILL_LR = 5e-5  # stage 3 starts from a trained adapter: a smaller step


# -- what every stage shares -----------------------------------------------------------------------


def add_run_arguments(
    parser: argparse.ArgumentParser,
    d,
    *,
    unit: str,
    product: str,
    lr_help: str | None = None,
    fresh_help: str,
    top_k_help: str = "serving K, experts per token (default native)",
) -> None:
    """Output, steps, optimizer, seed, checkpoint and resume arguments; defaults from `d`."""
    parser.add_argument(
        "--out",
        required=True,
        help=f"{product} file to write (.safetensors); the report goes next to "
        f"it, checkpoints to <out>.ckpt/",
    )
    add_experts_per_token(parser, top_k_help, type=int)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--lr", type=float, default=d.lr, help=lr_help)
    parser.add_argument("--batch", type=int, default=d.batch, help=f"{unit} per step")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--ckpt-every", type=int, default=d.ckpt_every, help="steps between checkpoints"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="require an existing checkpoint (resuming is automatic anyway)",
    )
    parser.add_argument("--fresh", action="store_true", help=fresh_help)
    parser.add_argument(
        "--save-dtype",
        default=d.save_dtype,
        help=f"dtype of the written {product}: {' | '.join(SAVE_DTYPES)}",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    # Test hook: SIGKILL the process right after that step's checkpoint (a real kill).
    parser.add_argument(
        "--kill-after-step", type=int, default=None, help=argparse.SUPPRESS
    )


def validate_run(opts) -> None:
    """The checks of `add_run_arguments`' options."""
    for name in ("steps", "batch", "ckpt_every"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not opts.lr > 0:
        raise ConfigError("--lr must be positive")
    if opts.save_dtype not in SAVE_DTYPES:
        raise ConfigError("--save-dtype must be float16, bfloat16 or float32")
    if opts.resume and opts.fresh:
        raise ConfigError("--resume and --fresh contradict each other")


# -- stage 1 ---------------------------------------------------------------------------------------


@dataclass
class PrerouterOptions:
    model: str
    texts: list[str]
    out: str
    owners: list[int] | None = None
    start_layer: int | None = None
    width: int | None = None
    experts_per_token: int | None = None
    steps: int = 1000
    lr: float = 1e-3
    batch: int = 256
    holdout: float = 0.1
    seed: int = 0
    resume: bool = False
    fresh: bool = False
    ckpt_every: int = 100
    max_doc_tokens: int = 1024
    max_tokens: int = 50_000  # 35B: ~160 KB of float16 features per token on disk
    expert_budget_mib: float | None = None
    save_dtype: str = "float16"
    progress: bool = True
    collect: str = "served"  # or "float32": collect_fp32.py
    check_tokens: int = CHECK_TOKENS
    # train on a random subset of the training documents
    train_tokens: int | None = None
    # heads also see the next token's embedding (engine/routing.py)
    next_token: bool = False

    def validate(self) -> None:
        validate_run(self)
        if self.collect not in COLLECT_MODES:
            raise ConfigError(
                f"--collect must be one of {', '.join(COLLECT_MODES)}, "
                f"not {self.collect!r}"
            )
        if self.check_tokens < 1:
            raise ConfigError("--check-tokens must be at least 1")
        if self.train_tokens is not None and self.train_tokens < 2:
            raise ConfigError("--train-tokens must be at least 2")
        if not self.texts:
            raise ConfigError("give at least one --text file")
        for text in self.texts:
            if not Path(text).is_file():
                raise ConfigError(f"--text {text}: no such file")
        if not 0 < self.holdout < 1:
            raise ConfigError("--holdout must be a fraction strictly between 0 and 1")
        if self.max_doc_tokens < 2 or self.max_tokens < 2:
            raise ConfigError("--max-doc-tokens and --max-tokens must be at least 2")
        if self.width is not None and self.width < 1:
            raise ConfigError("--width must be at least 1")
        if self.experts_per_token is not None and self.experts_per_token < 1:
            raise ConfigError("--experts-per-token must be at least 1")


def parse_owners(values: list[str] | None) -> list[int] | None:
    """Accepts `6 7 8`, `6,7,8`, `6..38` or `6-38` (inclusive ranges)."""
    if not values:
        return None
    out = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            for sep in ("..", "-"):
                if sep in part:
                    lo, hi = part.split(sep, 1)
                    try:
                        out.extend(range(int(lo), int(hi) + 1))
                    except ValueError:
                        raise ConfigError(
                            f"--owners: cannot read range {part!r}"
                        ) from None
                    break
            else:
                try:
                    out.append(int(part))
                except ValueError:
                    raise ConfigError(
                        f"--owners: {part!r} is not a layer number"
                    ) from None
    return out


def add_head_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Which layers the heads serve and their width (stage 1 and init-prerouter)."""
    parser.add_argument(
        "--start-layer",
        type=ct.nonneg_int,
        default=None,
        help="first consuming layer (default: 0 for the 35B and 8B tiers, "
        "i.e. every MoE layer with the wrap-around head; other models the "
        "first MoE layer + 1; the reference heads start at 7 (35B) and 8 "
        "(8B))",
    )
    parser.add_argument(
        "--width",
        type=ct.positive_int,
        default=None,
        help="fc1 width (tiers 512; other models min(512, 2 x hidden))",
    )
    parser.add_argument(
        "--next-token",
        action="store_true",
        help="heads also see the sampled next token's input embedding: "
        "higher recall, but their reads start after the LM head and the "
        "sampling instead of overlapping them (default: the published "
        "context features)",
    )


def add_prerouter_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of stage 1."""
    d = PrerouterOptions(model="", texts=[], out="")
    parser.add_argument("model", help="converted model directory (edge0-eval convert)")
    add_run_arguments(
        parser,
        d,
        unit="tokens",
        product="heads",
        top_k_help="serving K (35B tier 4, 8B tier 8; other models: native top-k)",
        fresh_help="discard the training checkpoint (features of the same data kept)",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        required=True,
        metavar="FILE",
        help="training text: plain files (one document each) or .jsonl (one "
        'document per line: "text", else "prompt" + "completion")',
    )
    parser.add_argument(
        "--owners",
        nargs="+",
        default=None,
        help="owner layers N (each predicts N+1; the last MoE layer: the first "
        "MoE layer of the next token): '6..38', '6-38', '6,7,8' or a list "
        "(default: start_layer-1 .. n_layers-2, MoE pairs only)",
    )
    add_head_layout_arguments(parser)
    parser.add_argument(
        "--holdout",
        type=float,
        default=d.holdout,
        help="fraction of documents held out for the report",
    )
    parser.add_argument(
        "--max-doc-tokens",
        type=int,
        default=d.max_doc_tokens,
        help="tokens kept per document (from its start)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help="total tokens collected over all documents",
    )
    parser.add_argument(
        "--expert-budget-mib",
        type=float,
        default=None,
        help="engine expert slot budget while collecting (default 2K slots/layer)",
    )
    parser.add_argument(
        "--collect",
        default=d.collect,
        choices=COLLECT_MODES,
        help="served: the engine as served (int4 kernels); float32: the same "
        "weights dequantized to float32 once (fast on a CPU with BLAS; "
        "checked against the served path first, refused if routing "
        f"agrees below {MIN_AGREEMENT} on any layer)",
    )
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=d.check_tokens,
        help="tokens of the first documents the float32 check runs on",
    )
    parser.add_argument(
        "--train-tokens",
        type=int,
        default=None,
        help="train on a seeded random subset of the training documents of "
        "about this many tokens (learning curves; the held-out documents "
        "stay the same)",
    )
    parser.epilog = (
        "Resume rule: checkpoints go to <out>.ckpt/ every --ckpt-every steps; running the same "
        "command again continues from the last one automatically (bit-identical to an "
        "uninterrupted run). Changed training settings with an existing checkpoint are an "
        "error unless --fresh; --resume only insists that a checkpoint exists. Features "
        "collected from the model are reused while model, texts, K and token limits match."
    )


def prerouter_options_from_args(args: argparse.Namespace) -> PrerouterOptions:
    """Stage 1 options from its parsed arguments."""
    return _from_args(
        PrerouterOptions,
        args,
        texts=list(args.text),
        owners=parse_owners(args.owners),
        experts_per_token=args.experts_per_token,
    )


# -- stages 2 and 3 --------------------------------------------------------------------------------


@dataclass
class StageOptions:
    student: str
    teacher: str
    prompts: list[str]
    out: str
    stage: str = "sft"  # "sft" | "distill"
    eval_prompts: list[str] | None = None
    heldout: float = 0.1
    rank: int | None = None  # None: 16 (or the --init-adapter's)
    alpha: float | None = None  # None: 32 (or the --init-adapter's)
    targets: list[str] | None = None  # None: the family's resident linear layers
    init_adapter: str | None = None
    lr: float = 1e-4
    steps: int = 100
    batch: int = 4
    seq_len: int = 512
    max_new_tokens: int = 128
    grad_checkpoint: bool = False
    # The student's engine, as served (mode, experts_per_token, prerouter_path,
    # slots_per_layer: None = `models.training_slots`); training attaches its own LoRA.
    engine: EngineOptions = field(
        default_factory=lambda: EngineOptions(mode="prerouted", no_lora=True)
    )
    ckpt_every: int = 10
    seed: int = 0
    resume: bool = False
    fresh: bool = False
    progress: bool = True
    save_dtype: str = "float16"
    teacher_temperature: float = 0.0
    max_prompts: int | None = None
    eval_batch: int = 4
    loss: str = "kl"  # stage 2: "kl" (teacher soft labels) | "ce"
    kl_topk: int = 64
    # stage 3
    temperature: float = 1.0
    top_p: float = 1.0

    def validate(self) -> None:
        validate_run(self)
        if not self.prompts:
            raise ConfigError("give at least one --prompts file")
        for name in ("max_new_tokens", "eval_batch", "kl_topk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.seq_len < 2:
            raise ConfigError("--seq-len must be at least 2")
        if self.rank is not None and self.rank < 1:
            raise ConfigError("--rank must be at least 1")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError("--alpha must be positive")
        if not 0 < self.heldout < 1:
            raise ConfigError("--heldout must be a fraction strictly between 0 and 1")
        if self.loss not in ("kl", "ce"):
            raise ConfigError("--loss must be kl or ce")
        self.engine.validate()
        if self.engine.mode not in MODES:
            raise ConfigError(f"--mode must be {' or '.join(MODES)}")
        if self.engine.slots_per_layer is not None and self.engine.slots_per_layer < 1:
            raise ConfigError("--slots-per-layer must be at least 1")
        if self.teacher_temperature < 0 or self.temperature < 0:
            raise ConfigError("temperatures must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError("--max-prompts must be at least 1")
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


def add_stage_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    """The arguments of stages 2 and 3 (`stage`: "sft" or "distill")."""
    d = StageOptions(student="", teacher="", prompts=[], out="")
    add_run_arguments(
        parser,
        d,
        unit="sequences",
        product="adapter",
        lr_help="Adam learning rate, constant (default 1e-4; distill 5e-5)",
        fresh_help="discard an existing training checkpoint and start over",
    )
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
    parser.add_argument(
        "--prompts",
        nargs="+",
        required=True,
        metavar="FILE",
        help='prompt files: .jsonl (one per line, field "prompt") or text '
        "(one prompt per non-empty line); chat template applied",
    )
    parser.add_argument(
        "--max-prompts",
        type=int,
        default=None,
        help="use at most this many prompts of --prompts (first ones)",
    )
    parser.add_argument(
        "--eval-prompts",
        nargs="+",
        default=None,
        metavar="FILE",
        help="held-out prompts (default: a --heldout fraction of --prompts)",
    )
    parser.add_argument(
        "--heldout",
        type=float,
        default=d.heldout,
        help="fraction of --prompts held out when --eval-prompts is not given",
    )
    parser.add_argument(
        "--eval-batch",
        type=int,
        default=d.eval_batch,
        help="sequences per held-out evaluation batch",
    )
    parser.add_argument(
        "--rank", type=int, default=None, help="LoRA rank r (default 16)"
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help="LoRA alpha (default 32)"
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="module path suffixes that get LoRA (default: attention, linear "
        "attention and shared-expert projections of the family)",
    )
    parser.add_argument(
        "--init-adapter",
        default=None,
        metavar="FILE",
        help="start from this adapter (its r, alpha and targets)"
        + (" - normally stage 2's output" if stage == "distill" else ""),
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=d.seq_len,
        help="max tokens per sequence (prompt + completion)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help="completion length cap (teacher data, student samples)",
    )
    parser.add_argument(
        "--grad-checkpoint",
        action="store_true",
        help="recompute each decoder layer in the backward pass (mx.checkpoint)",
    )
    parser.add_argument(
        "--mode",
        default=d.engine.mode,
        choices=MODES,
        help="the engine mode trained, as served: prerouted (prerouter "
        "predictions as routing) or reactive (the true router everywhere)",
    )
    parser.add_argument(
        "--prerouter",
        default=None,
        metavar="FILE",
        help="prerouter heads (default STUDENT/prerouter.safetensors)",
    )
    parser.add_argument(
        "--slots-per-layer",
        type=int,
        default=None,
        help="expert slots per MoE layer while training: the memory bound "
        "(default min(experts, batch x seq-len x K)); batches whose routed "
        "experts do not fit are split into micro-batches",
    )
    parser.add_argument(
        "--kl-topk",
        type=int,
        default=d.kl_topk,
        help="teacher top-k buckets (+ one tail bucket) of the KL losses",
    )
    if stage == "sft":
        parser.add_argument(
            "--teacher-temperature",
            type=float,
            default=d.teacher_temperature,
            help="teacher sampling temperature for its training completions "
            "(0 = greedy; held-out continuations are always greedy)",
        )
        parser.add_argument(
            "--loss",
            default=d.loss,
            choices=("kl", "ce"),
            help="kl: the teacher's next-token distribution on its completions "
            "(forward KL, tail-aware top-k; default); ce: cross-entropy on "
            "the completion tokens only (classic hard-label SFT)",
        )
    else:
        parser.set_defaults(lr=DISTILL_LR)
        parser.add_argument(
            "--temperature",
            type=float,
            default=d.temperature,
            help="student sampling temperature (0 = greedy)",
        )
        parser.add_argument(
            "--top-p", type=float, default=d.top_p, help="student nucleus sampling"
        )


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
    engine = EngineOptions(
        mode=args.mode,
        experts_per_token=args.experts_per_token,
        slots_per_layer=args.slots_per_layer,
        prerouter_path=args.prerouter,
        no_lora=True,
        seed=args.seed,
    )
    return _from_args(
        StageOptions,
        args,
        student=student,
        teacher=teacher,
        prompts=list(args.prompts),
        stage=stage,
        engine=engine,
    )


def _from_args(cls, args: argparse.Namespace, **given):
    """`cls` from the parsed arguments of its fields' names; `given` values win."""
    values = {
        f.name: getattr(args, f.name)
        for f in fields(cls)
        if f.name not in given and hasattr(args, f.name)
    }
    return cls(**values, progress=not args.no_progress, **given)
