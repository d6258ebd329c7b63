"""Shared machinery of stages 2 and 3: options, prompts, models, teacher data, the training step,
checkpoints and the adapter file.

Inputs. `--prompts` files: `.jsonl` gives one prompt per line from its string field "prompt";
any other file gives one prompt per non-empty line. Every prompt is wrapped as a single user turn
in the student's chat template (`add_generation_prompt=True`), encoded exactly the way the
OpenCompass wrappers encode prompts (template text, then `encode(add_special_tokens=False)`).
Held-out prompts: `--eval-prompts FILE`, else a seeded `--heldout` fraction of `--prompts`
(at least one prompt each side).

Models. The teacher is `mlx_lm.load(TEACHER)` (on CPU: unquantized experts upcast, activations
float32); the student is `Engine.load(STUDENT)` in the mode it is served in (`--routing
prerouted`: prerouted with its heads; `--routing true`: reactive, the true router). Before
anything heavy runs, config.json of both must agree on the architecture (model_type, vocab,
hidden size, layers, experts, ...), the tokenizers must have identical vocabularies, and every
LoRA target pattern must match at least one resident linear layer.

The step (see served.py): a no-gradient pass learns which experts every layer routes the batch
to, the union per layer is loaded into the slot pool (this *is* the memory bound: only the
batch's experts are resident), switches are pinned and `mx.value_and_grad` runs over the LoRA
matrices only (base weights frozen, experts int4 and never trained). If some layer's union
exceeds `--slots-per-layer`, the batch is split into micro-batches whose unions fit and the
gradients are accumulated (the loss is normalised by the whole batch's token count, so the
result is the full-batch gradient).

Checkpoints: `<out>.ckpt/state.safetensors` (LoRA matrices in float32, Adam state, step, loss
history, data position and RNG scheme, settings fingerprint), written atomically every
`--ckpt-every` steps and at the end; `<out>.ckpt/latest.safetensors` is the same adapter in the
served format. Resume rule: if `<out>.ckpt/state.safetensors` exists and was written with the
same settings and inputs, the run continues from it automatically; otherwise (different
settings) it is an error unless `--fresh`. Batches, samples and teacher data are pure functions of
(seed, step, prompt index), so a run killed at any point and continued by the same command ends
with the same adapter as an uninterrupted run (bit-identical on one machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.jsonl import iter_jsonl
from edge0_eval.training.state import load_training_state, save_training_state

STATE_NAME = "state.safetensors"
LATEST_NAME = "latest.safetensors"
TEACHER_DATA = "teacher.jsonl"
TEACHER_META = "teacher.meta.json"
KILL_ENV = "EDGE0_TRAIN_KILL_AFTER_STEP"   # test hook: SIGKILL self after that step's checkpoint

# Architecture keys that teacher and student config.json must agree on (those present).
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
             "num_experts_per_tok", "moe_intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "full_attention_interval", "intermediate_size",
             "shared_expert_intermediate_size", "first_k_dense_replace", "layer_group_size",
             "num_shared_experts", "linear_num_value_heads", "linear_num_key_heads")


# -- options ----------------------------------------------------------------------------------------

@dataclass
class StageOptions:
    student: str
    teacher: str
    prompts: list[str]
    out: str
    stage: str = "sft"                      # "sft" | "distill"
    eval_prompts: list[str] | None = None
    heldout: float = 0.1
    rank: int | None = None                 # None: 16 (or the --init-adapter's)
    alpha: float | None = None              # None: 32 (or the --init-adapter's)
    targets: list[str] | None = None        # None: the family's resident linear layers
    init_adapter: str | None = None
    lr: float = 1e-4
    steps: int = 100
    batch: int = 4
    seq_len: int = 512
    max_new_tokens: int = 128
    grad_checkpoint: bool = False
    routing: str = "prerouted"
    prerouter: str | None = None
    prerouted_weights: str = "head"
    top_k: int | None = None
    slots_per_layer: int | None = None
    ckpt_every: int = 10
    seed: int = 0
    resume: bool = False
    fresh: bool = False
    progress: bool = True
    save_dtype: str = "float16"
    teacher_temperature: float = 0.0
    max_prompts: int | None = None
    eval_batch: int = 4
    loss: str = "kl"                        # stage 2: "kl" (teacher soft labels) | "ce"
    kl_topk: int = 64
    # stage 3
    temperature: float = 1.0
    top_p: float = 1.0

    def validate(self) -> None:
        if not self.prompts:
            raise ConfigError("give at least one --prompts file")
        for name in ("steps", "batch", "ckpt_every", "max_new_tokens", "eval_batch", "kl_topk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.seq_len < 2:
            raise ConfigError("--seq-len must be at least 2")
        if not self.lr > 0:
            raise ConfigError("--lr must be positive")
        if self.rank is not None and self.rank < 1:
            raise ConfigError("--rank must be at least 1")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError("--alpha must be positive")
        if not 0 < self.heldout < 1:
            raise ConfigError("--heldout must be a fraction strictly between 0 and 1")
        if self.loss not in ("kl", "ce"):
            raise ConfigError("--loss must be kl or ce")
        if self.routing not in ("prerouted", "true"):
            raise ConfigError("--routing must be prerouted or true")
        if self.prerouted_weights not in ("head", "router"):
            raise ConfigError("--prerouted-weights must be head or router")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError("--save-dtype must be float16, bfloat16 or float32")
        if self.resume and self.fresh:
            raise ConfigError("--resume and --fresh contradict each other")
        if self.slots_per_layer is not None and self.slots_per_layer < 1:
            raise ConfigError("--slots-per-layer must be at least 1")
        if self.teacher_temperature < 0 or self.temperature < 0:
            raise ConfigError("temperatures must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError("--max-prompts must be at least 1")
        if self.init_adapter and not Path(self.init_adapter).is_file():
            raise CheckpointError(f"--init-adapter {self.init_adapter}: no such file")
        if self.init_adapter and Path(self.init_adapter).resolve() == Path(self.out).resolve():
            raise ConfigError("--out must differ from --init-adapter (the starting adapter is "
                              "part of the run's identity and must stay as it is)")
        for label, path in (("student", self.student), ("teacher", self.teacher)):
            if not (Path(path) / "config.json").is_file():
                raise CheckpointError(f"{label} {path}: no config.json there; is it a model "
                                      f"directory?")


def add_common_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    d = StageOptions(student="", teacher="", prompts=[], out="")
    parser.add_argument("models", nargs="+", metavar="[TEACHER] STUDENT",
                        help="the converted student directory (edge0-eval convert), optionally "
                             "preceded by the teacher (like `convert SRC OUT`); or give the "
                             "teacher with --teacher")
    parser.add_argument("--teacher", default=None,
                        help="the fp16 teacher checkpoint (mlx-lm directory) the student came from")
    parser.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                        help="prompt files: .jsonl (one per line, field \"prompt\") or text "
                             "(one prompt per non-empty line); chat template applied")
    parser.add_argument("--out", required=True,
                        help="adapter to write (served format, e.g. STUDENT/lora.safetensors); "
                             "report next to it, checkpoints in <out>.ckpt/")
    parser.add_argument("--eval-prompts", nargs="+", default=None, metavar="FILE",
                        help="held-out prompts (default: a --heldout fraction of --prompts)")
    parser.add_argument("--heldout", type=float, default=d.heldout,
                        help="fraction of --prompts held out when --eval-prompts is not given")
    parser.add_argument("--rank", type=int, default=None, help="LoRA rank r (default 16)")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 32)")
    parser.add_argument("--targets", nargs="+", default=None, metavar="PATTERN",
                        help="module path suffixes that get LoRA (default: attention, linear "
                             "attention and shared-expert projections of the family)")
    parser.add_argument("--init-adapter", default=None, metavar="FILE",
                        help="start from this adapter (its r, alpha and targets)"
                             + (" - normally stage 2's output" if stage == "distill" else ""))
    parser.add_argument("--lr", type=float, default=d.lr,
                        help="Adam learning rate, constant (default 1e-4; distill 5e-5)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len,
                        help="max tokens per sequence (prompt + completion)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="completion length cap (teacher data, student samples)")
    parser.add_argument("--grad-checkpoint", action="store_true",
                        help="recompute each decoder layer in the backward pass (mx.checkpoint)")
    parser.add_argument("--routing", default=d.routing, choices=("prerouted", "true"),
                        help="prerouted: the served path (prerouter predictions as routing); "
                             "true: the true router everywhere")
    parser.add_argument("--prerouter", default=None, metavar="FILE",
                        help="prerouter heads (default STUDENT/prerouter.safetensors)")
    parser.add_argument("--prerouted-weights", default=d.prerouted_weights,
                        choices=("head", "router"), help="as the engine option of that name")
    parser.add_argument("--top-k", type=int, default=None, help="serving K (default native)")
    parser.add_argument("--slots-per-layer", type=int, default=None,
                        help="expert slots per MoE layer while training: the memory bound "
                             "(default min(experts, batch x seq-len x K)); batches whose routed "
                             "experts do not fit are split into micro-batches")
    parser.add_argument("--ckpt-every", type=int, default=d.ckpt_every,
                        help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--resume", action="store_true",
                        help="require an existing checkpoint (resuming is automatic anyway)")
    parser.add_argument("--fresh", action="store_true",
                        help="discard an existing training checkpoint and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--save-dtype", default=d.save_dtype,
                        help="dtype of the written adapter: float16 | bfloat16 | float32")
    if stage == "sft":
        parser.add_argument("--teacher-temperature", type=float, default=d.teacher_temperature,
                            help="teacher sampling temperature for its training completions "
                                 "(0 = greedy; held-out continuations are always greedy)")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="use at most this many prompts of --prompts (first ones)")
    parser.add_argument("--eval-batch", type=int, default=d.eval_batch,
                        help="sequences per held-out evaluation batch")
    parser.add_argument("--kl-topk", type=int, default=d.kl_topk,
                        help="teacher top-k buckets (+ one tail bucket) of the KL losses")


def teacher_and_student(args: argparse.Namespace) -> tuple[str, str]:
    """`TEACHER STUDENT`, or `STUDENT --teacher TEACHER`."""
    models = list(args.models)
    if len(models) == 2 and args.teacher is None:
        return models[0], models[1]
    if len(models) == 1 and args.teacher is not None:
        return args.teacher, models[0]
    raise ConfigError("give the models as `TEACHER STUDENT` or as `STUDENT --teacher TEACHER` "
                      f"(got positional {models} and --teacher {args.teacher})")


def options_from_args(args: argparse.Namespace, stage: str) -> StageOptions:
    teacher, student = teacher_and_student(args)
    extra = {"kl_topk": args.kl_topk}
    if stage == "distill":
        extra.update(temperature=args.temperature, top_p=args.top_p)
    else:
        extra.update(loss=args.loss)
    return StageOptions(
        student=student, teacher=teacher, prompts=list(args.prompts), out=args.out,
        stage=stage, eval_prompts=args.eval_prompts, heldout=args.heldout, rank=args.rank,
        alpha=args.alpha, targets=args.targets, init_adapter=args.init_adapter, lr=args.lr,
        steps=args.steps, batch=args.batch, seq_len=args.seq_len,
        max_new_tokens=args.max_new_tokens, grad_checkpoint=args.grad_checkpoint,
        routing=args.routing, prerouter=args.prerouter,
        prerouted_weights=args.prerouted_weights, top_k=args.top_k,
        slots_per_layer=args.slots_per_layer, ckpt_every=args.ckpt_every, seed=args.seed,
        resume=args.resume, fresh=args.fresh, progress=not args.no_progress,
        save_dtype=args.save_dtype,
        teacher_temperature=getattr(args, "teacher_temperature", 0.0),
        max_prompts=args.max_prompts, eval_batch=args.eval_batch, **extra)


# -- prompts ----------------------------------------------------------------------------------------

def read_prompts(paths: list[str], what: str = "--prompts") -> list[str]:
    """Prompts from text files (one per non-empty line) and .jsonl files (field "prompt")."""
    prompts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"{what} {path}: no such file")
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix.lower() == ".jsonl":
            for lineno, record in iter_jsonl(path, raw):
                if not isinstance(record.get("prompt"), str):
                    raise ConfigError(f"{path}:{lineno}: needs a string field \"prompt\" "
                                      f"(got {sorted(record)})")
                if record["prompt"].strip():
                    prompts.append(record["prompt"])
        else:
            prompts.extend(line for line in raw.splitlines() if line.strip())
    if not prompts:
        raise ConfigError(f"{what} {' '.join(paths)}: the prompt set is empty (text files: one "
                          f"prompt per non-empty line; .jsonl: a \"prompt\" field per line)")
    return prompts


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn in the chat template, encoded like the OpenCompass wrappers."""
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def split_prompts(n: int, heldout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): a seeded shuffle, at least one each."""
    if n < 2:
        raise ConfigError(f"need at least 2 prompts to hold some out (got {n}); add prompts or "
                          f"give --eval-prompts")
    order = np.random.default_rng([seed, 7]).permutation(n).tolist()
    n_hold = min(n - 1, max(1, round(heldout * n)))
    return sorted(order[n_hold:]), sorted(order[:n_hold])


# -- model checks -----------------------------------------------------------------------------------

def _text_config(config: dict) -> dict:
    return config.get("text_config", config) if config.get("model_type") == "qwen3_5_moe" \
        else config


def architecture(model_dir: str | Path) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = _text_config(config)
    arch = {"model_type": config.get("model_type")}
    for key in ARCH_KEYS[1:]:
        if key in text:
            arch[key] = text[key]
    return arch


def check_pair(teacher: str | Path, student: str | Path) -> dict:
    """Teacher and student must be the same architecture; one ConfigError listing what differs."""
    t, s = architecture(teacher), architecture(student)
    diff = [f"{k}: teacher {t.get(k)!r} vs student {s.get(k)!r}"
            for k in ARCH_KEYS if k in t or k in s if t.get(k) != s.get(k)]
    if diff:
        raise ConfigError(f"teacher {teacher} and student {student} are different models ("
                          f"{'; '.join(diff)}); the student must be `edge0-eval convert` of "
                          f"this teacher")
    return s


def check_tokenizers(teacher_tok, student_tok) -> None:
    tv, sv = teacher_tok.get_vocab(), student_tok.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv))[:3]
        only_s = sorted(set(sv) - set(tv))[:3]
        moved = [k for k in tv if k in sv and tv[k] != sv[k]][:3]
        raise ConfigError(f"teacher and student tokenizers differ ({len(tv)} vs {len(sv)} "
                          f"tokens; only teacher {only_t}, only student {only_s}, different ids "
                          f"{moved}); token-level training needs one vocabulary")


def load_teacher(path: str | Path):
    """mlx-lm's model and tokenizer for the teacher, in the CPU-safe compute dtype."""
    from mlx_lm import load

    from edge0_eval.engine.mlx_compat import (cast_floating, resolve_compute_dtype,
                                       upcast_unquantized_experts_for_cpu)

    try:
        model, tokenizer = load(str(path))
    except Exception as exc:
        raise CheckpointError(f"teacher {path}: mlx_lm.load failed ({exc})") from None
    upcast_unquantized_experts_for_cpu(model)
    cast_floating(model, resolve_compute_dtype("auto"))
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer


def default_slots(opts: StageOptions, student: str | Path) -> int:
    from edge0_eval.engine.families import family_for

    config = json.loads((Path(student) / "config.json").read_text())
    family = family_for(config)
    experts = family.num_experts(config)
    k = opts.top_k or family.native_top_k(config)
    if opts.slots_per_layer is not None:
        if opts.slots_per_layer < k:
            raise ConfigError(f"--slots-per-layer {opts.slots_per_layer} is below top-k {k}")
        return min(opts.slots_per_layer, experts)
    return min(experts, opts.batch * opts.seq_len * k)


def load_student(opts: StageOptions, slots: int):
    """The student engine in its served routing mode, without any adapter."""
    from edge0_eval.engine.engine import Engine, EngineOptions
    from edge0_eval.engine.prerouted import PREROUTER_FILE

    if opts.routing == "prerouted":
        heads = Path(opts.prerouter or Path(opts.student) / PREROUTER_FILE)
        if not heads.is_file():
            raise CheckpointError(f"--routing prerouted trains the served path, which needs "
                                  f"prerouter heads: {heads} not found; train them with "
                                  f"`edge0-eval train-prerouter`, pass --prerouter FILE, or use "
                                  f"--routing true")
    options = EngineOptions(mode="prerouted" if opts.routing == "prerouted" else "reactive",
                            top_k=opts.top_k, slots_per_layer=slots, no_lora=True,
                            prerouter_path=opts.prerouter,
                            prerouted_weights=opts.prerouted_weights, seed=opts.seed)
    return Engine.load(opts.student, options)


def attach_lora(engine, opts: StageOptions) -> dict:
    """Put the trainable LoRA on the student (zero-init or --init-adapter); freeze the rest."""
    from edge0_eval.engine import lora

    model = engine.model
    if opts.init_adapter:
        meta = lora.load_adapter(model, opts.init_adapter, top_k=engine.top_k)
        for name, given, have in (("rank", opts.rank, meta["r"]), ("alpha", opts.alpha,
                                                                   meta["alpha"])):
            if given is not None and float(given) != float(have):
                raise ConfigError(f"--{name} {given} contradicts --init-adapter "
                                  f"{opts.init_adapter} ({name} {have}); leave --{name} out")
        if opts.targets:
            wanted = set(_resolve_targets(model, opts.targets))
            if wanted != set(meta["targets"]):
                raise ConfigError(f"--targets select {len(wanted)} layers but --init-adapter "
                                  f"{opts.init_adapter} covers {len(meta['targets'])}; leave "
                                  f"--targets out to continue that adapter")
        paths = meta["targets"]
        r, alpha = meta["r"], meta["alpha"]
    else:
        patterns = opts.targets or lora.default_targets(engine.family.name)
        if opts.targets:
            _resolve_targets(model, patterns)      # one clear error for a pattern that misses
        # (The family defaults may list layers a given config does not build, e.g. MLA's
        # q_a_proj without q_lora_rank: those simply match nothing.)
        r, alpha = opts.rank or 16, opts.alpha or 32.0
        paths = lora.apply_lora(model, r=r, alpha=alpha, targets=patterns, init="zeros",
                                seed=opts.seed, family=engine.family.name)
    lora.mark_trainable(model)
    return {"targets": paths, "r": int(r), "alpha": float(alpha)}


def _resolve_targets(model, patterns: list[str]) -> list[str]:
    from edge0_eval.engine.lora import find_targets

    found = []
    for pattern in patterns:
        paths = find_targets(model, [pattern])     # routers / routed experts raise here
        if not paths:
            raise ConfigError(f"LoRA target {pattern!r} matches no module of the student; "
                              f"targets are module path suffixes such as self_attn.q_proj or "
                              f"mlp.shared_expert.up_proj")
        found += paths
    return sorted(set(found))


# -- fingerprints -----------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_MODEL_JSON = ("config.json", "experts.index.json", "tokenizer.json", "tokenizer_config.json",
               "model.safetensors.index.json")


def model_fingerprint(model: str | Path) -> dict:
    """The model's own files only (adapters, heads and reports written beside it are not)."""
    model = Path(model)
    out = {"path": str(model.resolve())}
    for p in sorted(model.iterdir()):
        if not p.is_file():
            continue
        if p.name in _MODEL_JSON:
            out[p.name] = sha256_file(p)
        elif p.name in ("resident.safetensors", "experts.bin") or (
                p.name.startswith("model") and p.suffix == ".safetensors"):
            out[p.name] = [p.stat().st_size, p.stat().st_mtime_ns]
    return out


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# -- data -------------------------------------------------------------------------------------------

@dataclass
class Example:
    prompt: list[int]
    completion: list[int]


@dataclass
class Batch:
    tokens: np.ndarray        # [B, L] model input (sequence without its last token)
    targets: np.ndarray       # [B, L] next token
    valid: np.ndarray         # [B, L] real positions
    loss_mask: np.ndarray     # [B, L] positions that predict a completion token
    n_true: np.ndarray        # [B] positions routed with the true router (the prompt)

    @property
    def n_loss(self) -> int:
        return int(self.loss_mask.sum())


def fit(example: Example, seq_len: int) -> Example | None:
    """Cut the completion so prompt + completion <= seq_len; None if no completion token fits."""
    room = seq_len - len(example.prompt)
    if room < 1 or not example.completion:
        return None
    return Example(example.prompt, example.completion[:room])


def collate(examples: list[Example], pad_id: int = 0) -> Batch:
    seqs = [e.prompt + e.completion for e in examples]
    length = max(len(s) for s in seqs) - 1
    b = len(seqs)
    tokens = np.full((b, length), pad_id, np.int32)
    targets = np.full((b, length), pad_id, np.int32)
    valid = np.zeros((b, length), bool)
    loss_mask = np.zeros((b, length), bool)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        n = len(s) - 1
        tokens[i, :n] = s[:-1]
        targets[i, :n] = s[1:]
        valid[i, :n] = True
        loss_mask[i, len(e.prompt) - 1: n] = True
    n_true = np.array([len(e.prompt) for e in examples])
    return Batch(tokens, targets, valid, loss_mask, n_true)


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """The train-example ids of `step`: consecutive seeded epoch permutations (pure in step)."""
    out = []
    start = step * batch
    for pos in range(start, start + batch):
        epoch, i = divmod(pos, n)
        out.append(int(np.random.default_rng([seed, 1, epoch]).permutation(n)[i]))
    return out


class TeacherData:
    """Teacher completions per prompt, cached in `<ckpt>/teacher.jsonl` (resumable per prompt).

    A line: {"key": K, "prompt": [...], "completion": [...]}. A line cut short by a kill is
    dropped and regenerated. `teacher.meta.json` holds the fingerprint; another teacher, prompt
    set or generation setting starts the file over.
    """

    def __init__(self, directory: Path, fingerprint: dict):
        self.path = directory / TEACHER_DATA
        self.meta = directory / TEACHER_META
        self.fingerprint = fingerprint
        directory.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict] = {}
        same = False
        if self.meta.is_file():
            try:
                same = json.loads(self.meta.read_text()).get("fingerprint") == fingerprint
            except ValueError:
                same = False
        if not same:
            self.path.unlink(missing_ok=True)
            write_json(self.meta, {"fingerprint": fingerprint})
        if self.path.is_file():
            good = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.records[rec["key"]] = rec
                    good.append(line)
                except (ValueError, KeyError, TypeError):
                    break                          # a torn last line
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(g + "\n" for g in good))
            os.replace(tmp, self.path)

    def fill(self, jobs: list[tuple[str, list[int]]], generate, progress: bool, desc: str) -> None:
        from tqdm import tqdm

        # A record made for another encoding of the prompt (e.g. a changed chat template) is
        # made again.
        todo = [(k, p) for k, p in jobs
                if k not in self.records or self.records[k]["prompt"] != list(p)]
        if not todo:
            return
        with open(self.path, "a") as f, tqdm(total=len(jobs), initial=len(jobs) - len(todo),
                                              desc=desc, unit="prompt",
                                              disable=not progress) as bar:
            for key, prompt in todo:
                completion = generate(key, prompt)
                rec = {"key": key, "prompt": prompt, "completion": completion}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
                self.records[key] = rec
                bar.update(1)

    def example(self, key: str) -> Example:
        rec = self.records[key]
        return Example(list(rec["prompt"]), list(rec["completion"]))


def stable_seed(*parts) -> int:
    h = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def teacher_generate(teacher, prompt: list[int], max_new: int, temperature: float,
                     seed: int, stop: set[int]) -> list[int]:
    """The teacher's completion (mlx-lm generate_step; seeded, greedy at temperature 0)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    out = []
    for token, _ in generate_step(mx.array(prompt), teacher, max_tokens=max_new,
                                  sampler=sampler):
        token = int(token)
        out.append(token)
        if token in stop:
            break
    return out


def teacher_log_probs(teacher, tokens: np.ndarray) -> mx.array:
    """Teacher log-probabilities [B, L, V] (float32) for a padded batch (cache-less pass)."""
    logits = teacher(mx.array(tokens)).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# -- the training step ------------------------------------------------------------------------------

@dataclass
class StepStats:
    loss: float
    tokens: int
    micro_batches: int
    max_union: int                  # most experts one layer held for the batch
    bundles_read: int


class Trainer:
    """value_and_grad over the LoRA matrices on the served path, with the expert bound kept."""

    def __init__(self, engine, path, optimizer):
        self.engine, self.path, self.optimizer = engine, path, optimizer
        self.model = engine.model
        self.n_slots = engine.slots_per_layer

    def step(self, batch: Batch, loss_fn, aux: dict | None = None) -> StepStats:
        """loss_fn(logits [b, L, V] float32, rows, batch, aux) -> summed per-token loss."""
        from mlx.utils import tree_map

        from edge0_eval.training.served import pack_rows

        path = self.path
        disc = path.discover(batch.tokens, batch.valid, batch.n_true)
        groups = pack_rows(disc, self.n_slots)
        total = max(1, batch.n_loss)
        grads_sum, loss_sum, max_union, read = None, 0.0, 0, 0
        for rows in groups:
            unions = disc.unions(rows)
            max_union = max(max_union, max(len(u) for u in unions.values()))
            read += path.load_routed(unions)
            plan = path.replay_plan(disc, rows, unions)
            tokens = mx.array(batch.tokens[rows])
            mask = mx.array(disc.mask[rows])

            def objective(model):
                logits = path.forward(tokens, mask, plan).astype(mx.float32)
                return loss_fn(logits, rows, batch, aux) / total

            path.pin(True)
            try:
                loss, grads = nn.value_and_grad(self.model, objective)(self.model)
                mx.eval(loss, grads)
            finally:
                path.clear_plans()
                path.pin(False)
            loss_sum += float(loss.item())
            grads_sum = grads if grads_sum is None else tree_map(lambda a, b: a + b,
                                                                 grads_sum, grads)
        self.optimizer.update(self.model, grads_sum)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)
        return StepStats(loss_sum, total, len(groups), max_union, read)


def cross_entropy_loss(logits, rows, batch: Batch, aux) -> mx.array:
    """Summed next-token cross-entropy at the completion positions (stage 2, --loss ce)."""
    targets = mx.array(batch.targets[rows])
    mask = mx.array(batch.loss_mask[rows])
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    return (ce * mask).sum()


def teacher_topk(lt: mx.array, k: int) -> dict:
    """Teacher top-k ids, their log-probs and the log of the remaining (tail) mass.

    k is capped at vocab - 1 so the tail bucket is never empty.
    """
    k = max(1, min(k, lt.shape[-1] - 1))
    ids = mx.argpartition(-lt, kth=k - 1, axis=-1)[..., :k]
    lt_top = mx.take_along_axis(lt, ids, axis=-1)
    in_top = mx.put_along_axis(mx.zeros(lt.shape, dtype=mx.bool_), ids, mx.array(True), axis=-1)
    lt_tail = mx.logsumexp(mx.where(in_top, -mx.inf, lt), axis=-1)
    return {"ids": ids, "lt_top": lt_top, "lt_tail": lt_tail}


def bucket_kl(logits: mx.array, ids: mx.array, lt_top: mx.array, lt_tail: mx.array,
              direction: str = "reverse") -> mx.array:
    """Tail-aware top-k KL per position, from student logits [.., V] and the teacher's buckets.

    Buckets: the teacher's top-k tokens `ids` plus one tail bucket holding the remaining mass
    (1 - sum over the top-k, computed as a log-sum-exp over the complement, so it stays exact
    and finite when the tail is tiny). reverse: KL(student || teacher) = sum_b p_s (log p_s -
    log p_t); forward: KL(teacher || student) = sum_b p_t (log p_t - log p_s).
    """
    ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ls_top = mx.take_along_axis(ls, ids, axis=-1)
    in_top = mx.put_along_axis(mx.zeros(ls.shape, dtype=mx.bool_), ids, mx.array(True), axis=-1)
    ls_tail = mx.logsumexp(mx.where(in_top, -mx.inf, ls), axis=-1)
    if direction == "reverse":
        return (mx.exp(ls_top) * (ls_top - lt_top)).sum(axis=-1) + \
            mx.exp(ls_tail) * (ls_tail - lt_tail)
    if direction == "forward":
        return (mx.exp(lt_top) * (lt_top - ls_top)).sum(axis=-1) + \
            mx.exp(lt_tail) * (lt_tail - ls_tail)
    raise ValueError(f"direction must be reverse or forward, not {direction!r}")


# -- checkpoints ------------------------------------------------------------------------------------

def lora_state(model) -> dict[str, mx.array]:
    from edge0_eval.engine.lora import lora_modules

    out = {}
    for p, m in lora_modules(model).items():
        out[f"{p}.lora_A"], out[f"{p}.lora_B"] = m.lora_A, m.lora_B
    return out


def set_lora_state(model, arrays: dict[str, mx.array]) -> None:
    from edge0_eval.engine.lora import lora_modules

    modules = lora_modules(model)
    names = {f"{p}.lora_{x}" for p in modules for x in "AB"}
    if names != set(arrays):
        raise CheckpointError("the checkpoint's LoRA layers do not match the model's; rerun with "
                              "--fresh")
    for p, m in modules.items():
        m.lora_A = arrays[f"{p}.lora_A"].astype(mx.float32)
        m.lora_B = arrays[f"{p}.lora_B"].astype(mx.float32)


def save_state(path: Path, model, optimizer, step: int, fingerprint: dict, history: dict) -> None:
    save_training_state(path, lora_state(model), optimizer, {
        "step": step, "fingerprint": fingerprint, "history": history,
        "data_position": {"next_step": step,
                          "rule": "batch ids are a pure function of (seed, step)"},
        "rng": {"scheme": "stateless: every random draw is seeded from (seed, step, index)"}})


def load_state(path: Path) -> tuple[dict, dict, int, dict, dict]:
    lora_arrays, opt, meta = load_training_state(path)
    return (lora_arrays, opt, int(meta["step"]), meta.get("fingerprint", {}),
            meta.get("history", {}))


def maybe_kill(step: int) -> None:
    """Test hook: EDGE0_TRAIN_KILL_AFTER_STEP=N kills this process (SIGKILL) after step N."""
    value = os.environ.get(KILL_ENV)
    if value and int(value) == step:
        os.kill(os.getpid(), signal.SIGKILL)


class Interrupted(Exception):
    """Raised by the in-process test hook `stop_after` (a simulated kill after that step)."""


def report_paths(out: Path) -> tuple[Path, Path]:
    stem = out.name[: -len(".safetensors")] if out.name.endswith(".safetensors") else out.name
    return out.with_name(f"{stem}.report.json"), out.with_name(f"{stem}.report.md")


@dataclass
class Setup:
    """Everything a stage has loaded and checked before it trains."""

    opts: StageOptions
    engine: object
    teacher: object
    tokenizer: object
    path: object
    lora: dict
    train_prompts: list[list[int]]
    eval_prompts: list[list[int]]
    prompt_texts: dict = field(default_factory=dict)
    stop_ids: set = field(default_factory=set)
    slots: int = 0


def prepare(opts: StageOptions) -> Setup:
    """Validate inputs, load and check both models, attach the LoRA - all before training."""
    from edge0_eval.training.served import ServedPath

    opts.validate()
    prompts = read_prompts(opts.prompts)
    if opts.max_prompts:
        prompts = prompts[: opts.max_prompts]
    if opts.eval_prompts:
        eval_texts = read_prompts(opts.eval_prompts, "--eval-prompts")
        train_texts = prompts
    else:
        train_ids, held_ids = split_prompts(len(prompts), opts.heldout, opts.seed)
        train_texts = [prompts[i] for i in train_ids]
        eval_texts = [prompts[i] for i in held_ids]
    check_pair(opts.teacher, opts.student)
    slots = default_slots(opts, opts.student)
    engine = load_student(opts, slots)
    try:
        lora_info = attach_lora(engine, opts)
        teacher, teacher_tok = load_teacher(opts.teacher)
        check_tokenizers(teacher_tok, engine.tokenizer)
        tok = engine.tokenizer
        encode = lambda text: encode_prompt(tok, text)  # noqa: E731
        train_prompts = [encode(t) for t in train_texts]
        eval_prompts = [encode(t) for t in eval_texts]
        path = ServedPath(engine, opts.routing, grad_checkpoint=opts.grad_checkpoint)
    except BaseException:
        engine.close()
        raise
    stop = set(getattr(tok, "eos_token_ids", None) or [])
    return Setup(opts, engine, teacher, tok, path, lora_info, train_prompts, eval_prompts,
                 {"train": len(train_texts), "heldout": len(eval_texts)}, stop, slots)


def fingerprint_base(opts: StageOptions, setup: Setup) -> dict:
    """Settings and inputs that determine the trained adapter (a change blocks resuming)."""
    keys = ("stage", "heldout", "lr", "batch", "seq_len", "max_new_tokens", "routing",
            "prerouted_weights", "top_k", "seed", "teacher_temperature", "max_prompts")
    fp = {k: getattr(opts, k) for k in keys}
    if opts.stage == "distill":
        fp.update(kl_topk=opts.kl_topk, temperature=opts.temperature, top_p=opts.top_p)
    else:
        fp.update(loss=opts.loss, kl_topk=opts.kl_topk if opts.loss == "kl" else None)
    fp["lora"] = setup.lora
    fp["student"] = model_fingerprint(opts.student)
    fp["teacher"] = model_fingerprint(opts.teacher)
    fp["prompts"] = [sha256_file(Path(p)) for p in opts.prompts]
    fp["eval_prompts"] = [sha256_file(Path(p)) for p in opts.eval_prompts or []]
    fp["init_adapter"] = sha256_file(Path(opts.init_adapter)) if opts.init_adapter else None
    if opts.routing == "prerouted":
        from edge0_eval.engine.prerouted import PREROUTER_FILE

        heads = Path(opts.prerouter or Path(opts.student) / PREROUTER_FILE)
        fp["prerouter"] = sha256_file(heads)
    return fp


def restore_or_start(opts: StageOptions, setup: Setup, fingerprint: dict, optimizer
                     ) -> tuple[int, dict]:
    """Apply the resume rule; returns (step, history)."""
    ckpt = Path(f"{opts.out}.ckpt")
    state_path = ckpt / STATE_NAME
    if opts.resume and not state_path.is_file():
        raise CheckpointError(f"--resume: no training checkpoint at {state_path}")
    if opts.fresh and state_path.is_file():
        state_path.unlink()
    optimizer.init(setup.engine.model.trainable_parameters())
    if not state_path.is_file():
        return 0, {"loss": [], "max_union": [], "micro_batches": []}
    arrays, opt_state, step, fp, history = load_state(state_path)
    if fp != fingerprint:
        diff = sorted(k for k in set(fp) | set(fingerprint) if fp.get(k) != fingerprint.get(k))
        raise CheckpointError(f"{state_path} was written with other settings or inputs "
                              f"({', '.join(diff)} differ); rerun the original command to "
                              f"resume, or add --fresh to start over")
    set_lora_state(setup.engine.model, arrays)
    optimizer.state = opt_state
    mx.eval(setup.engine.model.trainable_parameters(), optimizer.state)
    print(f"edge0-eval {'train-lora' if opts.stage == 'sft' else 'distill'}: resuming from "
          f"{state_path} at step {step}/{opts.steps}", flush=True)
    return step, history


def checkpoint(opts: StageOptions, setup: Setup, optimizer, step: int, fingerprint: dict,
               history: dict, metadata: dict) -> None:
    from edge0_eval.engine.lora import save_adapter

    ckpt = Path(f"{opts.out}.ckpt")
    save_adapter(setup.engine.model, ckpt / LATEST_NAME, {**metadata, "step": step},
                 dtype="float32")
    save_state(ckpt / STATE_NAME, setup.engine.model, optimizer, step, fingerprint, history)


def adapter_metadata(opts: StageOptions, setup: Setup) -> dict:
    engine = setup.engine
    return {
        "source": {"teacher": Path(opts.teacher).resolve().name,
                   "student": Path(opts.student).resolve().name,
                   "prompts": [Path(p).name for p in opts.prompts],
                   "routing": opts.routing, "lr": opts.lr, "batch": opts.batch,
                   "seq_len": opts.seq_len, "seed": opts.seed,
                   "init_adapter": Path(opts.init_adapter).name if opts.init_adapter else None},
        "stage": opts.stage,
        "model": engine.config.get("model_type"),
        "K": engine.top_k,
    }
