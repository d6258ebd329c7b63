"""Build OpenCompass-0.5.4-shaped output trees by hand, for the report and gate tests.

Shapes follow opencompass 0.5.4: BaseEvaluator.evaluate regroups an evaluator's details per
example ({"example_abbr": "<abbr>_<idx>", key: [value per replica]}); evaluators that return
no details (AccEvaluator) get OpenCompassEvalTask.format_details ({"type": "GEN", "0": {...}});
the summary csv is dataset,version,metric,mode,<model>... with '-' for a failed task; the
dumped config holds the dataset configs with types as dotted strings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PT = "opencompass.openicl.icl_prompt_template.PromptTemplate"
ZERO = "opencompass.openicl.icl_retriever.ZeroRetriever"
GEN = "opencompass.openicl.icl_inferencer.GenInferencer"

# evaluator kind per dataset abbr prefix (the configs under opencompass/configs/datasets)
KINDS = {
    "aime2026": "cascade",
    "openai_humaneval": "humaneval",
    "GPQA_diamond": "gpqa",
    "mmlu_pro_": "acc",
    "IFBench": "ifbench",
}
METRICS = {
    "cascade": ["accuracy"],
    "humaneval": ["humaneval_pass@1"],
    "gpqa": ["accuracy"],
    "acc": ["accuracy"],
    "mathverify": ["accuracy"],
    "ifbench": [
        "score",
        "Prompt-level-strict-accuracy",
        "Inst-level-strict-accuracy",
        "Prompt-level-loose-accuracy",
        "Inst-level-loose-accuracy",
    ],
}


def infer_cfg(prompt: str) -> dict:
    return {
        "prompt_template": {
            "type": PT,
            "template": {"round": [{"role": "HUMAN", "prompt": prompt}]},
        },
        "retriever": {"type": ZERO},
        "inferencer": {"type": GEN},
    }


def prompt_version(cfg: dict) -> str:
    """What opencompass.utils.prompt.get_prompt_hash gives (first 6) for an infer_cfg without
    reader_cfg: sha256 of its sorted-keys JSON. Written independently of opencompass on purpose."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:6]


def _kind(dataset: str) -> str:
    return next((k for p, k in KINDS.items() if dataset.startswith(p)), "gpqa")


def _replica_lists(correct) -> list[list[float]]:
    # each item: a value (one replica) or a list of per-replica values
    return [c if isinstance(c, list) else [c] for c in correct]


def _details(kind: str, dataset: str, correct, loose=None, judge=False, ids=None):
    reps = _replica_lists(correct)
    ids = ids or list(range(len(reps)))
    if kind == "acc":  # format_details: processed prediction vs reference, as strings
        out = {"type": "GEN"}
        for i, (c,) in enumerate(reps):
            pred = "A" if c else "B"
            out[str(i)] = {
                "prompt": f"q{i}",
                "origin_prediction": f"... ANSWER: {pred}",
                "predictions": pred,
                "references": "A",
            }
        return out
    details = []
    for i, rs in enumerate(reps):
        d = {"example_abbr": f"{dataset}_{ids[i]}"}
        if kind == "cascade":
            # judge=True: the rule said no and the LLM judge decided (cascade_correct).
            d["rule_evaluation"] = [
                {
                    "correct": bool(c) and not judge,
                    "pred": "1",
                    "answer": "1",
                    "evaluation_method": "rule",
                }
                for c in rs
            ]
            if judge:
                d["llm_evaluation"] = [
                    {"prediction": "A" if c else "B", "llm_correct": bool(c)}
                    for c in rs
                ]
                d["cascade_correct"] = [bool(c) for c in rs]
        elif kind == "humaneval":
            d.update(
                task_id=[f"HumanEval/{i}"] * len(rs),
                completion=["pass"] * len(rs),
                result=["passed" if c else "failed: AssertionError" for c in rs],
                passed=[bool(c) for c in rs],
                is_correct=[bool(c) for c in rs],
                prompt=["def f():"] * len(rs),
            )
        elif kind == "ifbench":
            ls = _replica_lists(loose)[i]
            d.update(
                prompt=["p"] * len(rs),
                pred=["r"] * len(rs),
                refer=[{"key": i, "instruction_id_list": ["x:y"], "kwargs": [{}]}]
                * len(rs),
                is_strict_correct=[bool(c) for c in rs],
                is_loose_correct=[bool(c) for c in ls],
                is_correct=[bool(c) for c in rs],
                grade=[
                    "strict" if c else "loose" if l else "none" for c, l in zip(rs, ls)
                ],
            )
        else:  # GPQAEvaluator / MATHVerifyEvaluator
            d.update(
                pred=["A" if c else "B" for c in rs],
                answer=["A"] * len(rs),
                correct=[bool(c) for c in rs],
            )
        details.append(d)
    return details


class OCRun:
    """One `outputs/<work_dir>/<timestamp>` folder. add() per model and dataset, then finish()."""

    def __init__(self, root: Path, ts: str = "20260301_120000"):
        self.ts = ts
        self.path = Path(root) / ts
        self.models: list[str] = []
        self.prompts: dict[str, dict] = {}  # dataset -> infer_cfg
        self.values: dict[
            tuple[str, str], dict | None
        ] = {}  # (model, dataset) -> metrics
        self.model_settings: dict[
            str, dict
        ] = {}  # model -> config keys (max_out_len, ...)
        self.evaluator = "opencompass.evaluator.MATHVerifyEvaluator"
        self.n: dict[str, int] = {}  # dataset -> replicas (the config's n)

    def add(
        self,
        model: str,
        dataset: str,
        correct,
        *,
        prompt: str = "{question}",
        loose=None,
        judge: bool = False,
        kind: str | None = None,
        failed: str | None = None,
        reported: float | None = None,
        engine: list[dict] | None = None,
        engine_file: list[dict] | None = None,
        shards: int = 1,
        details: bool = True,
        outputs: list[str] | None = None,
        gold: str = "A",
        questions: list[int] | None = None,
        ids: list[int] | None = None,
    ):
        """correct: per-item 0/1 (or per-replica lists). failed: 'missing' (no results file) or
        'error' (results file with an error). reported: override the metric (inconsistency).
        engine, outputs: per prediction, in OpenCompass's order (with n replicas, the dataset
        n times over: prediction r * items + k is replica r of item k). questions: which
        question each item is (its prompt 'q<number>'; default its position); ids: the idx
        OpenCompass gives each item, its row in the dataset (default its position)."""
        kind = kind or _kind(dataset)
        if model not in self.models:
            self.models.append(model)
        cfg = infer_cfg(prompt)
        assert self.prompts.setdefault(dataset, cfg) == cfg, (
            "one prompt per dataset per run"
        )
        reps = _replica_lists(correct)
        n_rep = len(reps[0])
        if n_rep > 1:
            self.n[dataset] = n_rep

        questions = questions or list(range(len(reps)))
        preds = [
            {"origin_prompt": f"q{questions[i]}", "prediction": "x", "gold": gold}
            for _ in range(n_rep)
            for i in range(len(reps))
        ]
        for p, stats in zip(preds, engine or []):
            p["engine_stats"] = stats
        for p, text in zip(preds, outputs or []):
            p["prediction"] = text
        pdir = self.path / "predictions" / model
        pdir.mkdir(parents=True, exist_ok=True)
        if shards == 1:
            _dump(pdir / f"{dataset}.json", {str(i): p for i, p in enumerate(preds)})
        else:
            size = -(-len(preds) // shards)
            for s in range(shards):
                part = preds[s * size : (s + 1) * size]
                _dump(
                    pdir / f"{dataset}_{s}.json",
                    {str(i): p for i, p in enumerate(part)},
                )
        if engine_file is not None:
            _dump(pdir / f"{dataset}.engine_stats.json", engine_file)

        if failed == "missing":
            self.values[(model, dataset)] = None
            return
        rdir = self.path / "results" / model
        rdir.mkdir(parents=True, exist_ok=True)
        if failed == "error":
            _dump(
                rdir / f"{dataset}.json",
                {"error": "preds and refrs have different length"},
            )
            self.values[(model, dataset)] = None
            return
        metrics = self._metrics(kind, reps, loose, n_rep)
        if reported is not None:
            metrics[next(iter(metrics))] = reported
        result = dict(metrics)
        if kind == "cascade":
            result["cascade_stats"] = {"total_samples": len(reps)}
        if details:
            result["details"] = _details(kind, dataset, correct, loose, judge, ids)
        _dump(rdir / f"{dataset}.json", result)
        self.values[(model, dataset)] = metrics

    @staticmethod
    def _metrics(kind, reps, loose, n_rep) -> dict:
        mean = 100.0 * sum(sum(r) for r in reps) / (len(reps) * n_rep)
        suffix = f" ({n_rep} runs average)" if n_rep > 1 else ""
        if kind == "ifbench":
            lmean = (
                100.0 * sum(sum(r) for r in _replica_lists(loose)) / (len(reps) * n_rep)
            )
            inst_s, inst_l = (
                mean + 1.0,
                lmean + 1.0,
            )  # instruction-level: not per prompt
            return {
                "score": (mean + inst_s + lmean + inst_l) / 4,
                "Prompt-level-strict-accuracy": mean,
                "Inst-level-strict-accuracy": inst_s,
                "Prompt-level-loose-accuracy": lmean,
                "Inst-level-loose-accuracy": inst_l,
            }
        return {METRICS[kind][0] + suffix: mean}

    def finish(
        self,
        summary: bool = True,
        config: bool = True,
        dataset_abbrs: list[str] | None = None,
        groups: dict | None = None,
    ) -> Path:
        """dataset_abbrs/groups: the summarizer's rows and summary groups (name -> subsets)."""
        groups = groups or {}
        if summary:
            rows = [["dataset", "version", "metric", "mode", *self.models]]
            for ds in dataset_abbrs or list(self.prompts):
                if (
                    ds in groups
                ):  # naive average; a group with a missing subset shows '-'
                    got = [
                        [
                            (self.values.get((m, s)) or {}).get("accuracy")
                            for s in groups[ds]
                        ]
                        for m in self.models
                    ]
                    cells = [
                        "-" if None in g else f"{sum(g) / len(g):.02f}" for g in got
                    ]
                    rows.append(
                        [ds, "-", "naive_average", "gen"] + cells
                        if any(c != "-" for c in cells)
                        else [ds, "-", "-", "-"] + cells
                    )
                    continue
                got = [self.values.get((m, ds)) for m in self.models]
                metrics = next((list(v) for v in got if v), None)
                if metrics is None:  # every model failed: OpenCompass shows all '-'
                    rows.append([ds, "-", "-", "-"] + ["-"] * len(self.models))
                    continue
                for metric in metrics:
                    rows.append(
                        [ds, prompt_version(self.prompts[ds]), metric, "gen"]
                        + [f"{v[metric]:.02f}" if v else "-" for v in got]
                    )
            sdir = self.path / "summary"
            sdir.mkdir(parents=True, exist_ok=True)
            (sdir / f"summary_{self.ts}.csv").write_text(
                "\n".join(",".join(r) for r in rows) + "\n", encoding="utf-8"
            )
        if config:
            datasets = [
                {
                    "abbr": ds,
                    "type": "opencompass.datasets.CustomDataset",
                    "path": f"opencompass/{ds}",
                    "infer_cfg": cfg,
                    "reader_cfg": {
                        "input_columns": ["question"],
                        "output_column": "answer",
                    },
                    "eval_cfg": {"evaluator": {"type": self.evaluator}},
                    **({"n": self.n[ds]} if ds in self.n else {}),
                }
                for ds, cfg in self.prompts.items()
            ]
            models = [
                {
                    "abbr": m,
                    "type": "edge0_eval.model.Edge0Model",
                    **self.model_settings.get(m, {}),
                }
                for m in self.models
            ]
            cdir = self.path / "configs"
            cdir.mkdir(parents=True, exist_ok=True)
            (cdir / f"{self.ts}_4242.py").write_text(
                f"datasets = {datasets!r}\nmodels = {models!r}\nwork_dir = {str(self.path)!r}\n",
                encoding="utf-8",
            )
        return self.path


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
