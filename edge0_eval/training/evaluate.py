"""Held-out evaluation after a stage: token-level KL(student || teacher) and top-1 agreement.

Held-out data: the teacher's greedy continuation of every held-out prompt (chat template
applied, at most --max-new-tokens, cut to --seq-len). At every position that predicts a
continuation token, the student's next-token distribution (the served path: int4 experts,
prerouted routing when trained that way, the LoRA variant under test) is compared with the
teacher's, teacher-forced on the same tokens:

    KL(student || teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v))     (full vocabulary)
    top-1 agreement        = [argmax p_s == argmax p_t]

Both are averaged over all such positions of all held-out prompts (token-level, not per prompt).
The teacher's log-probabilities are computed once per batch and every variant (no LoRA, the
starting adapter, the trained adapter as written to disk) is scored against them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from edge0_eval.engine.lora import lora_modules
from edge0_eval.formats.adapters import read_adapter_file
from edge0_eval.training.batches import Example, collate
from edge0_eval.training.state import report_paths, write_json
from edge0_eval.training.teacher import teacher_log_probs
from edge0_eval.training.trainer import lora_state, set_lora_state


def _set_variant(model, arrays: dict | None, saved_scales: dict) -> None:
    modules = lora_modules(model)
    if arrays is None:
        for m in modules.values():
            m.scale = 0.0  # the LoRA path adds exactly zero: the base model
        return
    for p, m in modules.items():
        m.scale = saved_scales[p]
    set_lora_state(model, arrays)


def evaluate(
    setup,
    examples: list[Example],
    variants: dict[str, dict | None],
    batch_size: int = 4,
    progress: bool = False,
) -> dict:
    """{variant: {kl, top1, nll, tokens, prompts}} over `examples` (see module docstring)."""
    model = setup.engine.model
    path = setup.path
    modules = lora_modules(model)
    saved_scales = {p: m.scale for p, m in modules.items()}
    current = dict(lora_state(model))
    sums = {name: np.zeros(3) for name in variants}
    n_tokens = 0
    try:
        starts = range(0, len(examples), batch_size)
        for i in tqdm(starts, desc="held-out eval", unit="batch", disable=not progress):
            batch = collate(examples[i : i + batch_size])
            mask = mx.array(batch.loss_mask)
            lt = teacher_log_probs(setup.teacher, batch.tokens)
            t_top = mx.argmax(lt, axis=-1)
            mx.eval(lt, t_top)
            n_tokens += batch.n_loss
            for name, arrays in variants.items():
                _set_variant(model, arrays, saved_scales)
                disc = path.discover(
                    batch.tokens, batch.valid, batch.n_true, keep_logits=True
                )
                logits = disc.logits.astype(mx.float32)
                ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                kl = (mx.exp(ls) * (ls - lt)).sum(axis=-1)
                top1 = (mx.argmax(ls, axis=-1) == t_top).astype(mx.float32)
                nll = -mx.take_along_axis(
                    ls, mx.array(batch.targets)[..., None], axis=-1
                )[..., 0]
                vals = mx.stack(
                    [(kl * mask).sum(), (top1 * mask).sum(), (nll * mask).sum()]
                )
                sums[name] += np.array(vals.astype(mx.float32))
    finally:
        for p, m in modules.items():
            m.scale = saved_scales[p]
        set_lora_state(model, current)
    denom, figures = max(1, n_tokens), ("kl", "top1", "nll")
    return {
        name: {k: float(v / denom) for k, v in zip(figures, s)}
        | {"tokens": int(n_tokens), "prompts": len(examples)}
        for name, s in sums.items()
    }


def adapter_arrays(path: str | Path) -> dict:
    """The LoRA matrices of an adapter file as float32 (what the engine will run)."""
    arrays, _ = read_adapter_file(path)
    return {k: v.astype(mx.float32) for k, v in arrays.items()}


# -- report ----------------------------------------------------------------------------------------


def write_report(out: Path, report: dict) -> tuple[Path, Path]:
    json_path, md_path = report_paths(out)
    write_json(json_path, report)
    md_path.write_text(markdown(report))
    return json_path, md_path


def verdict(report: dict) -> str:
    m = report["heldout"]["metrics"]
    base = m["no_lora"]["kl"]
    final = m["trained"]["kl"]
    lines = []
    if report["stage"] == "sft":
        lines.append(
            f"Stage 2 {'lowered' if final < base else 'did NOT lower'} held-out "
            f"KL(student||teacher): {base:.6f} without LoRA -> {final:.6f} with the "
            f"trained adapter ({_pct(final, base)})."
        )
    else:
        init = m.get("init", {}).get("kl")
        if init is None:
            lines.append(
                f"Stage 3 from a zero LoRA: {base:.6f} -> {final:.6f} "
                f"({_pct(final, base)})."
            )
        elif final < init:
            lines.append(
                f"Stage 3 lowered held-out KL again: {base:.6f} (no LoRA) -> "
                f"{init:.6f} (stage-2 adapter) -> {final:.6f} ({_pct(final, init)} vs "
                f"stage 2)."
            )
        else:
            lines.append(
                f"Stage 3 did NOT lower held-out KL below the stage-2 adapter: {base:.6f} (no "
                f"LoRA) -> {init:.6f} (stage 2) -> {final:.6f} ({_pct(final, init)}). Why it "
                f"can happen: stage 3 minimises a tail-aware top-{report['training'].get('kl_topk')}"
                f" reverse KL on the student's own samples (temperature "
                f"{report['training'].get('temperature')}), while this metric is the full-vocabulary"
                f" KL on the teacher's greedy continuations; with few steps/prompts the two can "
                f"disagree, and a stage-2 adapter already close to the int4 floor leaves little to "
                f"gain. Training loss went {report['training'].get('first_loss')} -> "
                f"{report['training'].get('last_loss')}."
            )
    if report.get("random_weights_note"):
        lines.append(report["random_weights_note"])
    return " ".join(lines)


def _pct(new: float, old: float) -> str:
    if old == 0:
        return "n/a"
    return f"{100 * (new - old) / old:+.1f}%"


VARIANT_LABELS = {
    "no_lora": "no LoRA",
    "init": "starting adapter",
    "trained": "trained adapter (as written)",
}


def markdown(r: dict) -> str:
    m = r["heldout"]["metrics"]
    t = r["training"]
    lines = [
        f"# {('Stage 2: LoRA SFT' if r['stage'] == 'sft' else 'Stage 3: on-policy distillation')}"
        f" - {Path(r['adapter']).name}",
        "",
        f"Student `{Path(r['student']).name}` ({r['model_type']}, K={r['top_k']}, mode "
        f"{r['mode']}), teacher `{Path(r['teacher']).name}`. LoRA r={r['lora']['r']}, "
        f"alpha={r['lora']['alpha']} on {len(r['lora']['targets'])} resident layers.",
        "",
        f"Held-out: {r['heldout']['prompts']} prompts, {r['heldout']['tokens']} positions "
        f"(teacher greedy continuations, teacher-forced).",
        "",
        "| variant | KL(student‖teacher) | top-1 agreement | NLL of teacher tokens |",
        "|---|---:|---:|---:|",
    ]
    for name, label in VARIANT_LABELS.items():
        if name in m:
            lines.append(
                f"| {label} | {m[name]['kl']:.6f} | {m[name]['top1']:.4f} | "
                f"{m[name]['nll']:.4f} |"
            )
    lines += [
        "",
        verdict(r),
        "",
        f"Training: {t['steps']} steps x {t['batch']} sequences, lr {t['lr']}, loss "
        f"{t['loss_name']}: {t['first_loss']} (step 1) -> {t['last_loss']} (last).",
        f"Memory bound: {t['slots_per_layer']} expert slots per MoE layer "
        f"({t['expert_buffer_mib']:.2f} MiB of int4 expert buffers); the most experts one "
        f"layer needed for a batch: {t['max_union']}; micro-batches per step: "
        f"max {t['max_micro_batches']}.",
    ]
    return "\n".join(lines) + "\n"
