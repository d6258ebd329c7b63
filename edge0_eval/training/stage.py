"""The loop both stages share: prepare, resume, teacher data, train, write, evaluate, report."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx

from edge0_eval.errors import ConfigError
from edge0_eval.training.common import (
    Interrupted, StageOptions, TeacherData, Trainer, adapter_metadata, checkpoint, fingerprint_base,
    fit, maybe_kill, prepare, restore_or_start, stable_seed, teacher_generate,
)

RANDOM_NOTE = ("If teacher and student are random-weight checkpoints (e.g. `edge0-eval "
               "make-tiny`), these figures only check the mechanics: the student differs from "
               "the teacher by int4 quantization (and prerouted routing) of random weights, so "
               "there is little structure for a LoRA to recover.")


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


def run_stage(opts: StageOptions, impl: StageImpl, stop_after: int | None = None) -> dict:
    """Run a stage end to end; returns the report. `stop_after` (tests): raise after that step."""
    import mlx.optimizers as optim
    from tqdm import tqdm

    from edge0_eval.engine.lora import save_adapter
    from edge0_eval.training.evaluate import adapter_arrays, evaluate, markdown, write_report

    setup = prepare(opts)
    try:
        engine = setup.engine
        ckpt = Path(f"{opts.out}.ckpt")
        fingerprint = fingerprint_base(opts, setup)
        optimizer = optim.Adam(learning_rate=opts.lr)
        step, history = restore_or_start(opts, setup, fingerprint, optimizer)

        data_fp = {k: fingerprint[k] for k in ("teacher", "prompts", "eval_prompts", "heldout",
                                               "seed", "max_new_tokens", "teacher_temperature",
                                               "max_prompts", "seq_len")}
        data = TeacherData(ckpt, data_fp)
        jobs = [(f"heldout:{i}", p) for i, p in enumerate(setup.eval_prompts)]
        if impl.needs_teacher_train:
            jobs = [(f"train:{i}", p) for i, p in enumerate(setup.train_prompts)] + jobs

        def generate(key: str, prompt: list[int]) -> list[int]:
            # Held-out continuations are always greedy, so every stage scores the same targets.
            temp = 0.0 if key.startswith("heldout:") else opts.teacher_temperature
            budget = max(1, min(opts.max_new_tokens, opts.seq_len - len(prompt)))
            return teacher_generate(setup.teacher, prompt, budget, temp,
                                    stable_seed(opts.seed, key), setup.stop_ids)

        data.fill(jobs, generate, opts.progress, "teacher completions")
        heldout = [fit(data.example(k), opts.seq_len) for k, _ in jobs if k.startswith("heldout:")]
        heldout = [e for e in heldout if e is not None]
        if not heldout:
            raise ConfigError(f"no held-out prompt leaves room for a completion within --seq-len "
                              f"{opts.seq_len}; raise --seq-len")
        impl.prepare(setup, data)

        trainer = Trainer(engine, setup.path, optimizer)
        meta = adapter_metadata(opts, setup)
        started = time.perf_counter()
        bar = tqdm(total=opts.steps, initial=min(step, opts.steps), unit="step",
                   desc="train-lora" if opts.stage == "sft" else "distill",
                   disable=not opts.progress)
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
                bar.set_postfix(loss=f"{stats.loss:.4f}", ema=f"{ema:.4f}",
                                experts=stats.max_union)
                if step % opts.ckpt_every == 0 or step == opts.steps:
                    checkpoint(opts, setup, optimizer, step, fingerprint, history, meta)
                maybe_kill(step)
                if stop_after is not None and step >= stop_after:
                    raise Interrupted(f"stopped after step {step}")
        finally:
            bar.close()
        seconds = time.perf_counter() - started

        out = Path(opts.out)
        save_adapter(engine.model, out, {**meta, "step": step}, dtype=opts.save_dtype)
        variants = {"no_lora": None}
        if opts.init_adapter:
            variants["init"] = adapter_arrays(opts.init_adapter)
        variants["trained"] = adapter_arrays(out)        # evaluate what was written
        metrics = evaluate(setup, heldout, variants, opts.eval_batch, opts.progress)

        losses = history["loss"]
        index = engine.index
        report = {
            "stage": opts.stage, "adapter": str(out), "student": str(Path(opts.student).resolve()),
            "teacher": str(Path(opts.teacher).resolve()),
            "model_type": engine.config.get("model_type"), "top_k": engine.top_k,
            "routing": opts.routing, "prerouted_weights": opts.prerouted_weights,
            "lora": setup.lora, "init_adapter": opts.init_adapter,
            "heldout": {"prompts": len(heldout), "tokens": metrics["trained"]["tokens"],
                        "source": "--eval-prompts" if opts.eval_prompts else
                        f"seeded {opts.heldout:g} of --prompts",
                        "continuations": "teacher greedy, chat template applied",
                        "metrics": metrics},
            "training": {
                "steps": step, "batch": opts.batch, "lr": opts.lr, "seq_len": opts.seq_len,
                "max_new_tokens": opts.max_new_tokens, "seed": opts.seed,
                "train_prompts": setup.prompt_texts["train"], "loss_name": impl.loss_name,
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                "loss_history": losses,
                "slots_per_layer": setup.slots,
                "expert_buffer_mib": setup.slots * len(engine.moe_layers)
                                     * index.bundle_stride / 2**20,
                "max_union": max(history["max_union"]) if history["max_union"] else 0,
                "max_micro_batches": max(history["micro_batches"])
                                     if history["micro_batches"] else 0,
                "grad_checkpoint": opts.grad_checkpoint,
                "seconds_this_run": seconds,
                "peak_memory_gib": mx.get_peak_memory() / 2**30,
                **impl.report_extra(opts),
            },
            "random_weights_note": RANDOM_NOTE,
        }
        json_path, md_path = write_report(out, report)
        if opts.progress:
            print(markdown(report))
        print(f"wrote {out}, {json_path}, {md_path}", flush=True)
        return report
    finally:
        setup.path.close()
        setup.engine.close()
