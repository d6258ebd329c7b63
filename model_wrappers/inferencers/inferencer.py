"""GenInferencer that tells the model which repeat each prompt is, writes the model's
per-sample engine stats beside the predictions, and stores each prediction as the whole
assistant turn.

Repeats: OpenCompass's dataset `n` concatenates the dataset n times (opencompass/datasets/
base.py), so copy j of item i arrives as the same prompt at position j * N + i of the whole
test set (N items; its evaluator scores the same slices as replicas). The model cannot tell
copies apart, so the inferencer passes each prompt's copy index (`sample_indices`) to
`generate`, which seeds copy j apart (`chat.row_seed`). A task may hold a slice of the test set
(`reader_cfg.test_range`, e.g. a NumWorkerPartitioner chunk), so positions come from the
layout the project's partitioners hand the inferencer (`repeats`, see
model_wrappers/partitioners/partitioner.py), never from counting prompts in one task.

Stats: OpenCompass's inferencer, not the model, knows where a dataset's predictions go, so it is
the one place that can put `predictions/<model>/<dataset>.engine_stats.json` next to
`predictions/<model>/<dataset>.json`. The file is a JSON list with one dict per prediction
generated in this run (keys include index, item — the dataset row's `idx` —, sample, seed,
tokens, prompt_tokens, decode_tok_s, prefill_tok_s, peak_memory_gib, wall_s, finish_reason,
cache, model_identity).

A thinking chat template opens the `<think>` block in the prompt, so the model's text alone
would not show that its thinking never closed. Such a prediction is stored with the opener
the prompt ended with ("<think>\\n" + output): the text the scorer's thinking rule reads
(edge0_eval/evaluation/outputs/thinking.py) is the assistant turn as the model continued it.
"""

from __future__ import annotations

import inspect
import json
import os
import os.path as osp
from collections import deque
from typing import Callable, List, Optional

from datasets import Dataset
from opencompass.openicl.icl_dataset_reader import load_partial_dataset
from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.registry import ICL_INFERENCERS
from opencompass.utils.logging import get_logger

from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.identity import model_identity
from edge0_eval.evaluation.outputs.thinking import prompt_opener
from edge0_eval.evaluation.plan.progress import Progress


def stats_path(prediction_dir: str, prediction_file: str) -> str:
    stem = (
        prediction_file[:-5] if prediction_file.endswith(".json") else prediction_file
    )
    return osp.join(prediction_dir, f"{stem}.engine_stats.json")


def sample_indices(
    count: int, items: Optional[List[int]], repeats: Optional[dict], where: str
) -> List[int]:
    """Each of the `count` test rows' copy index among the dataset's `n` copies.

    items: the rows' `idx` column (None if the dataset has none). repeats: the partitioner's
    layout, dict(copies=n, items=N, test_range=...) (None: no layout was given).
    """
    if not repeats or repeats.get("copies", 1) == 1:
        if repeats is None and items is not None and len(set(items)) < len(items):
            raise ConfigError(
                f"{where}: the test set repeats its items (dataset n > 1) but the inferencer "
                f"was given no layout to tell the copies apart; run it with the project's "
                f"partitioner (model_wrappers.partitioners.partitioner.Edge0Partitioner or "
                f"Edge0NumWorkerPartitioner), which passes each copy's position"
            )
        return [0] * count
    copies, size = int(repeats["copies"]), int(repeats["items"])
    whole = Dataset.from_dict({"position": list(range(copies * size))})
    positions = load_partial_dataset(whole, size=repeats.get("test_range"))["position"]
    if len(positions) != count or (
        items is not None and any(i != p % size for i, p in zip(items, positions))
    ):
        raise ConfigError(
            f"{where}: the test rows do not sit where {copies} copies of {size} "
            f"items sliced by test_range {repeats.get('test_range')!r} put them; "
            f"the dataset changed since partitioning: run it again"
        )
    return [p // size for p in positions]


class _Sampled:
    """The model as GenInferencer calls it: each batch's `generate` gets its prompts' sample
    indices, in the order the inferencer's dataloader hands out the batches; each finished
    batch counts toward the arm's progress."""

    def __init__(self, model, batches: deque, progress: Optional[Progress] = None):
        self._model, self._batches, self._progress = model, batches, progress

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate_from_template(self, templates, max_out_len: int, **kwargs):
        samples = self._batches.popleft()
        if len(samples) != len(templates):
            raise RuntimeError(
                f"{len(templates)} prompts for {len(samples)} sample indices"
            )
        out = self._model.generate_from_template(
            templates, max_out_len=max_out_len, sample_indices=samples, **kwargs
        )
        if self._progress is not None:
            self._progress.add(len(templates))
        return out


def store_thinking_openers(path: str, chat_text: Callable) -> int:
    """Prefix each prediction in the predictions file at `path` whose chat-templated prompt
    left a thinking block open with that opener; returns how many were."""
    with open(path, encoding="utf-8") as f:
        preds = json.load(f)
    openers: dict[str, str] = {}
    changed = 0
    for item in preds.values():
        key = json.dumps(item.get("origin_prompt"), sort_keys=True)
        if key not in openers:
            openers[key] = prompt_opener(chat_text(item.get("origin_prompt")))
        opener, text = openers[key], item.get("prediction")
        if not opener:
            continue
        if isinstance(text, str):
            item["prediction"] = opener + text
        elif isinstance(text, list):  # num_return_sequences > 1
            item["prediction"] = [opener + t if isinstance(t, str) else t for t in text]
        changed += 1
    if changed:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(preds, f, indent=4, ensure_ascii=False)
    return changed


@ICL_INFERENCERS.register_module()
class Edge0GenInferencer(GenInferencer):
    """GenInferencer + sample indices for repeats + per-sample engine stats.

    repeats: how this task's test rows sit among the dataset's `n` copies, set by the project's
    partitioners (dict(copies, items, test_range)); not a key to write in a config.
    progress: the arm's progress spec (edge0_eval/evaluation/plan/progress.py), set by the project's
    partitioners; None: no progress file or ETA lines.
    """

    def __init__(
        self,
        *args,
        repeats: Optional[dict] = None,
        progress: Optional[dict] = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.repeats = repeats
        self.progress = progress
        self._progress: Optional[Progress] = None
        self._samples: Optional[List[int]] = None
        self._batches: deque = deque()

    def get_dataloader(self, datalist, batch_size):
        """GenInferencer's dataloader over the prompts left (after a resume: the last ones);
        queues their sample indices batch by batch."""
        if self._progress is not None:  # a resumed dataset: the rows before are done
            self._progress.done = max(self._progress.row["items"] - len(datalist), 0)
        if self._samples is not None:
            left = self._samples[len(self._samples) - len(datalist) :]
            size = batch_size or 1
            self._batches.extend(left[i : i + size] for i in range(0, len(left), size))
        return GenInferencer.get_dataloader(datalist, batch_size)

    def inference(
        self,
        retriever,
        ice_template=None,
        prompt_template=None,
        output_json_filepath=None,
        output_json_filename=None,
    ):
        out_dir = output_json_filepath or self.output_json_filepath
        out_file = output_json_filename or self.output_json_filename
        test = retriever.test_ds
        items = list(test["idx"]) if "idx" in test.column_names else None
        samples = sample_indices(
            len(test), items, self.repeats, osp.join(out_dir, out_file)
        )
        model = self.model
        # A multi-round chat calls generate once per round: its batches carry no sample index.
        takes_samples = (
            not self.multiround
            and "sample_indices" in inspect.signature(model.generate).parameters
        )
        pop = getattr(model, "pop_sample_stats", None)
        if pop is not None:
            pop()  # drop anything recorded outside this dataset
        progress = (
            Progress(self.progress, get_logger().info)
            if self.progress and self.is_main_process
            else None
        )
        if progress is not None and self.multiround:
            progress = None  # batches are rounds there, not items
        self._progress = progress if takes_samples else None
        if takes_samples:
            self._samples, self._batches = samples, deque()
            self.model = _Sampled(model, self._batches, progress)
        elif any(samples):
            get_logger().warning(
                f"{out_file}: no sample indices reach {type(model).__name__} "
                f"(multi-round, or its generate takes none): its repeats are "
                f"drawn as it draws them"
            )
        try:
            results = super().inference(
                retriever,
                ice_template=ice_template,
                prompt_template=prompt_template,
                output_json_filepath=output_json_filepath,
                output_json_filename=output_json_filename,
            )
        finally:
            self.model, self._samples, self._progress = model, None, None
        if not self.is_main_process:
            return results
        chat_text = getattr(self.model, "chat_text", None)
        if chat_text is not None and osp.isfile(osp.join(out_dir, out_file)):
            store_thinking_openers(osp.join(out_dir, out_file), chat_text)
        if pop is not None:
            stats = pop()
            total = len(results) if results else len(stats)
            # After a resumed run only the new samples have stats: they are the last ones.
            first = max(total - len(stats), 0)
            identity = None
            for offset, item in enumerate(stats):
                item["index"] = first + offset
                if items is not None and item["index"] < len(items):
                    item["item"] = items[item["index"]]
                if "model_identity" not in item:  # a server's sample carries its host's
                    identity = identity or model_identity(
                        self.model.path, getattr(self.model, "engine_options", None)
                    )
                    item["model_identity"] = identity
            os.makedirs(out_dir, exist_ok=True)
            with open(stats_path(out_dir, out_file), "w", encoding="utf-8") as f:
                json.dump(stats, f, indent=1)
        return results
