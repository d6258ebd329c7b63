"""Stages 2 and 3 end to end: check and load the models, resume, teacher data, train, write the
adapter, evaluate it held out, report. What differs between the stages is a `StageImpl`.

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

import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from tqdm import tqdm

from edge0_eval.engine.lora import save_adapter
from edge0_eval.errors import ConfigError
from edge0_eval.training.batches import fit, stable_seed
from edge0_eval.training.corpus import encode_prompt, read_prompts, split_prompts
from edge0_eval.training.evaluate import (
    adapter_arrays,
    evaluate,
    markdown,
    write_report,
)
from edge0_eval.training.models import (
    attach_lora,
    check_pair,
    check_tokenizers,
    load_student,
    load_teacher,
    training_slots,
)
from edge0_eval.training.served import ServedPath
from edge0_eval.training.stage_options import StageOptions
from edge0_eval.training.state import (
    after_step,
    announce_resume,
    begin,
    check_fingerprint,
    load_training_state,
    model_fingerprint,
    save_training_state,
    sha256_file,
)
from edge0_eval.training.teacher import TeacherData, teacher_generate
from edge0_eval.training.trainer import Trainer, lora_state, set_lora_state

STATE_NAME = "state.safetensors"
LATEST_NAME = "latest.safetensors"
VERBS = {"sft": "train-lora", "distill": "distill"}

RANDOM_NOTE = (
    "If teacher and student are random-weight checkpoints (e.g. `edge0-eval "
    "make-tiny`), these figures only check the mechanics: the student differs from "
    "the teacher by int4 quantization (and prerouted routing) of random weights, so "
    "there is little structure for a LoRA to recover."
)


# -- setup -----------------------------------------------------------------------------------------


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
    slots = training_slots(opts, opts.student)
    engine = load_student(opts, slots)
    try:
        lora_info = attach_lora(engine, opts)
        teacher, teacher_tok = load_teacher(opts.teacher)
        check_tokenizers(teacher_tok, engine.tokenizer)
        tok = engine.tokenizer
        encode = lambda text: encode_prompt(tok, text)  # noqa: E731
        train_prompts = [encode(t) for t in train_texts]
        eval_prompts = [encode(t) for t in eval_texts]
        path = ServedPath(engine, grad_checkpoint=opts.grad_checkpoint)
    except BaseException:
        engine.close()
        raise
    stop = set(getattr(tok, "eos_token_ids", None) or [])
    return Setup(
        opts,
        engine,
        teacher,
        tok,
        path,
        lora_info,
        train_prompts,
        eval_prompts,
        {"train": len(train_texts), "heldout": len(eval_texts)},
        stop,
        slots,
    )


def stage_fingerprint(opts: StageOptions, setup: Setup) -> dict:
    """Settings and inputs that determine the trained adapter (a change blocks resuming)."""
    keys = (
        "stage heldout lr batch seq_len max_new_tokens seed teacher_temperature "
        "max_prompts"
    ).split()
    fp = {k: getattr(opts, k) for k in keys}
    # "top_k": the fingerprint's name for K since before the option was experts_per_token.
    fp.update(mode=opts.engine.mode, top_k=opts.engine.experts_per_token)
    if opts.stage == "distill":
        fp.update(kl_topk=opts.kl_topk, temperature=opts.temperature, top_p=opts.top_p)
    else:
        fp.update(loss=opts.loss, kl_topk=opts.kl_topk if opts.loss == "kl" else None)
    fp["lora"] = setup.lora
    fp["student"] = model_fingerprint(opts.student)
    fp["teacher"] = model_fingerprint(opts.teacher)
    fp["prompts"] = [sha256_file(Path(p)) for p in opts.prompts]
    fp["eval_prompts"] = [sha256_file(Path(p)) for p in opts.eval_prompts or []]
    fp["init_adapter"] = (
        sha256_file(Path(opts.init_adapter)) if opts.init_adapter else None
    )
    if opts.engine.mode == "prerouted":
        fp["prerouter"] = sha256_file(setup.engine.resolved.prerouter_path)
    return fp


def restore_or_start(
    opts: StageOptions, setup: Setup, fingerprint: dict, optimizer
) -> tuple[int, dict]:
    """Apply the resume rule; returns (step, history)."""
    state_path = Path(f"{opts.out}.ckpt") / STATE_NAME
    begin(state_path, opts.resume, opts.fresh)
    optimizer.init(setup.engine.model.trainable_parameters())
    if not state_path.is_file():
        return 0, {"loss": [], "max_union": [], "micro_batches": []}
    arrays, opt_state, meta = load_training_state(state_path)
    check_fingerprint(state_path, meta.get("fingerprint", {}), fingerprint)
    step = int(meta["step"])
    set_lora_state(setup.engine.model, arrays)
    optimizer.state = opt_state
    mx.eval(setup.engine.model.trainable_parameters(), optimizer.state)
    announce_resume(f"edge0-eval {VERBS[opts.stage]}", state_path, step, opts.steps)
    return step, meta.get("history", {})


def checkpoint(
    opts: StageOptions,
    setup: Setup,
    optimizer,
    step: int,
    fingerprint: dict,
    history: dict,
    metadata: dict,
) -> None:
    ckpt = Path(f"{opts.out}.ckpt")
    model = setup.engine.model
    save_adapter(model, ckpt / LATEST_NAME, {**metadata, "step": step}, dtype="float32")
    save_training_state(
        ckpt / STATE_NAME,
        lora_state(model),
        optimizer,
        {
            "step": step,
            "fingerprint": fingerprint,
            "history": history,
            "data_position": {
                "next_step": step,
                "rule": "batch ids are a pure function of (seed, step)",
            },
            "rng": {
                "scheme": "stateless: every random draw is seeded from (seed, step, index)"
            },
        },
    )


def adapter_metadata(opts: StageOptions, setup: Setup) -> dict:
    engine = setup.engine
    return {
        "source": {
            "teacher": Path(opts.teacher).resolve().name,
            "student": Path(opts.student).resolve().name,
            "prompts": [Path(p).name for p in opts.prompts],
            "mode": opts.engine.mode,
            "lr": opts.lr,
            "batch": opts.batch,
            "seq_len": opts.seq_len,
            "seed": opts.seed,
            "init_adapter": Path(opts.init_adapter).name if opts.init_adapter else None,
        },
        "stage": opts.stage,
        "model": engine.config.get("model_type"),
        "K": engine.experts_per_token,
    }


# -- the loop --------------------------------------------------------------------------------------


class StageImpl:
    """What differs between the stages."""

    name = "sft"
    loss_name = ""
    needs_teacher_train = False

    def prepare(self, setup, data: TeacherData) -> None:
        raise NotImplementedError

    def batch(self, setup, step: int):
        raise NotImplementedError

    def loss_fn(self, logits, rows, batch, aux):
        raise NotImplementedError

    def report_extra(self, opts: StageOptions) -> dict:
        return {}


def run_stage(
    opts: StageOptions,
    impl_class: type[StageImpl],
    stop_after: int | None = None,
    kill_after: int | None = None,
) -> dict:
    """Run a stage end to end; returns the report. Test hooks (state.after_step): `stop_after`
    raises Interrupted after that step, `kill_after` SIGKILLs the process."""
    opts.stage = impl_class.name
    impl = impl_class(opts)
    setup = prepare(opts)
    try:
        fingerprint = stage_fingerprint(opts, setup)
        optimizer = optim.Adam(learning_rate=opts.lr)
        step, history = restore_or_start(opts, setup, fingerprint, optimizer)
        heldout = _teacher_data(opts, setup, impl, fingerprint)
        meta = adapter_metadata(opts, setup)
        started = time.perf_counter()
        step = _train(
            opts,
            setup,
            impl,
            optimizer,
            (step, history),
            fingerprint,
            meta,
            stop_after,
            kill_after,
        )
        seconds = time.perf_counter() - started
        out = Path(opts.out)
        save_adapter(
            setup.engine.model, out, {**meta, "step": step}, dtype=opts.save_dtype
        )
        variants = {"no_lora": None}
        if opts.init_adapter:
            variants["init"] = adapter_arrays(opts.init_adapter)
        variants["trained"] = adapter_arrays(out)  # evaluate what was written
        metrics = evaluate(setup, heldout, variants, opts.eval_batch, opts.progress)
        report = _report(opts, setup, impl, heldout, metrics, step, history, seconds)
        json_path, md_path = write_report(out, report)
        if opts.progress:
            print(markdown(report))
        print(f"wrote {out}, {json_path}, {md_path}", flush=True)
        return report
    finally:
        setup.path.close()
        setup.engine.close()


_DATA_KEYS = (
    "teacher prompts eval_prompts heldout seed max_new_tokens teacher_temperature "
    "max_prompts seq_len"
).split()


def _teacher_data(
    opts: StageOptions, setup, impl: StageImpl, fingerprint: dict
) -> list:
    """The teacher's continuations (cached beside the checkpoint) handed to the stage;
    the held-out examples fitted to --seq-len."""
    data = TeacherData(
        Path(f"{opts.out}.ckpt"), {k: fingerprint[k] for k in _DATA_KEYS}
    )
    jobs = [(f"heldout:{i}", p) for i, p in enumerate(setup.eval_prompts)]
    if impl.needs_teacher_train:
        jobs = [(f"train:{i}", p) for i, p in enumerate(setup.train_prompts)] + jobs

    def generate(key: str, prompt: list[int]) -> list[int]:
        # Held-out continuations are always greedy, so every stage scores the same targets.
        temp = 0.0 if key.startswith("heldout:") else opts.teacher_temperature
        budget = max(1, min(opts.max_new_tokens, opts.seq_len - len(prompt)))
        return teacher_generate(
            setup.teacher,
            prompt,
            budget,
            temp,
            stable_seed(opts.seed, key),
            setup.stop_ids,
        )

    data.fill(jobs, generate, opts.progress, "teacher completions")
    heldout = [
        fit(data.example(k), opts.seq_len) for k, _ in jobs if k.startswith("heldout:")
    ]
    heldout = [e for e in heldout if e is not None]
    if not heldout:
        raise ConfigError(
            f"no held-out prompt leaves room for a completion within --seq-len "
            f"{opts.seq_len}; raise --seq-len"
        )
    impl.prepare(setup, data)
    return heldout


def _train(
    opts, setup, impl, optimizer, start, fingerprint, meta, stop_after, kill_after
):
    """Train from `start` = (step, history) to --steps, checkpointing; the last step."""
    step, history = start
    trainer = Trainer(setup.engine, setup.path, optimizer)
    bar = tqdm(
        total=opts.steps,
        initial=min(step, opts.steps),
        unit="step",
        desc=VERBS[opts.stage],
        disable=not opts.progress,
    )
    ema = None
    try:
        while step < opts.steps:
            batch, aux = impl.batch(setup, step)
            stats = trainer.step(batch, impl.loss_fn, aux)
            step += 1
            history["loss"].append(stats.loss)
            history["max_union"].append(stats.max_union)
            history["micro_batches"].append(stats.micro_batches)
            ema = stats.loss if ema is None else 0.9 * ema + 0.1 * stats.loss
            bar.update(1)
            bar.set_postfix(
                loss=f"{stats.loss:.4f}", ema=f"{ema:.4f}", experts=stats.max_union
            )
            if step % opts.ckpt_every == 0 or step == opts.steps:
                checkpoint(opts, setup, optimizer, step, fingerprint, history, meta)
            after_step(step, stop_after, kill_after)
    finally:
        bar.close()
    return step


def _report(opts, setup, impl, heldout, metrics, step, history, seconds) -> dict:
    engine, losses = setup.engine, history["loss"]
    return {
        "stage": opts.stage,
        "adapter": str(Path(opts.out)),
        "student": str(Path(opts.student).resolve()),
        "teacher": str(Path(opts.teacher).resolve()),
        "model_type": engine.config.get("model_type"),
        "top_k": engine.experts_per_token,
        "mode": opts.engine.mode,
        "lora": setup.lora,
        "init_adapter": opts.init_adapter,
        "heldout": {
            "prompts": len(heldout),
            "tokens": metrics["trained"]["tokens"],
            "source": "--eval-prompts"
            if opts.eval_prompts
            else f"seeded {opts.heldout:g} of --prompts",
            "continuations": "teacher greedy, chat template applied",
            "metrics": metrics,
        },
        "training": {
            "steps": step,
            "batch": opts.batch,
            "lr": opts.lr,
            "seq_len": opts.seq_len,
            "max_new_tokens": opts.max_new_tokens,
            "seed": opts.seed,
            "train_prompts": setup.prompt_texts["train"],
            "loss_name": impl.loss_name,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "loss_history": losses,
            "slots_per_layer": setup.slots,
            "expert_buffer_mib": setup.slots * engine.index.slot_bytes / 2**20,
            "max_union": max(history["max_union"], default=0),
            "max_micro_batches": max(history["micro_batches"], default=0),
            "grad_checkpoint": opts.grad_checkpoint,
            "seconds_this_run": seconds,
            "peak_memory_gib": mx.get_peak_memory() / 2**30,
            **impl.report_extra(opts),
        },
        "random_weights_note": RANDOM_NOTE,
    }
