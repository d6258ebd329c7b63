"""GenInferencer that writes the model's per-sample engine stats beside the predictions, and
stores each prediction as the whole assistant turn.

OpenCompass's inferencer, not the model, knows where a dataset's predictions go, so it is the
one place that can put `predictions/<model>/<dataset>.engine_stats.json` next to
`predictions/<model>/<dataset>.json`. The file is a JSON list with one dict per prediction
generated in this run (keys include index, tokens, prompt_tokens, decode_tok_s, prefill_tok_s,
peak_memory_gib, wall_s, finish_reason, cache, model_identity).

A thinking chat template opens the `<think>` block in the prompt, so the model's text alone
would not show that its thinking never closed. Such a prediction is stored with the opener
the prompt ended with ("<think>\\n" + output): the text the scorer's thinking rule reads
(edge0_eval/evaluation/thinking.py) is the assistant turn as the model continued it.
"""

from __future__ import annotations

import json
import os
import os.path as osp
from typing import Callable

from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.registry import ICL_INFERENCERS

from edge0_eval.evaluation.identity import model_identity
from edge0_eval.evaluation.thinking import prompt_opener


def stats_path(prediction_dir: str, prediction_file: str) -> str:
    stem = prediction_file[:-5] if prediction_file.endswith('.json') else prediction_file
    return osp.join(prediction_dir, f'{stem}.engine_stats.json')


def store_thinking_openers(path: str, chat_text: Callable) -> int:
    """Prefix each prediction in the predictions file at `path` whose chat-templated prompt
    left a thinking block open with that opener; returns how many were."""
    with open(path, encoding='utf-8') as f:
        preds = json.load(f)
    openers: dict[str, str] = {}
    changed = 0
    for item in preds.values():
        key = json.dumps(item.get('origin_prompt'), sort_keys=True)
        if key not in openers:
            openers[key] = prompt_opener(chat_text(item.get('origin_prompt')))
        opener, text = openers[key], item.get('prediction')
        if not opener:
            continue
        if isinstance(text, str):
            item['prediction'] = opener + text
        elif isinstance(text, list):   # num_return_sequences > 1
            item['prediction'] = [opener + t if isinstance(t, str) else t for t in text]
        changed += 1
    if changed:
        with open(path, 'w', encoding='utf-8') as f:
            json.dump(preds, f, indent=4, ensure_ascii=False)
    return changed


@ICL_INFERENCERS.register_module()
class Edge0GenInferencer(GenInferencer):

    def inference(self, retriever, ice_template=None, prompt_template=None,
                  output_json_filepath=None, output_json_filename=None):
        out_dir = output_json_filepath or self.output_json_filepath
        out_file = output_json_filename or self.output_json_filename
        pop = getattr(self.model, 'pop_sample_stats', None)
        if pop is not None:
            pop()  # drop anything recorded outside this dataset
        results = super().inference(retriever, ice_template=ice_template,
                                    prompt_template=prompt_template,
                                    output_json_filepath=output_json_filepath,
                                    output_json_filename=output_json_filename)
        if not self.is_main_process:
            return results
        chat_text = getattr(self.model, 'chat_text', None)
        if chat_text is not None and osp.isfile(osp.join(out_dir, out_file)):
            store_thinking_openers(osp.join(out_dir, out_file), chat_text)
        if pop is not None:
            stats = pop()
            total = len(results) if results else len(stats)
            # After a resumed run only the new samples have stats: they are the last ones.
            first = max(total - len(stats), 0)
            identity = model_identity(self.model.path,
                                      getattr(self.model, 'engine_options', None))
            for offset, item in enumerate(stats):
                item['index'] = first + offset
                item['model_identity'] = identity
            os.makedirs(out_dir, exist_ok=True)
            with open(stats_path(out_dir, out_file), 'w', encoding='utf-8') as f:
                json.dump(stats, f, indent=1)
        return results
