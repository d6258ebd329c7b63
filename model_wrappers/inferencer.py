"""GenInferencer that writes the model's per-sample engine stats beside the predictions.

OpenCompass's inferencer, not the model, knows where a dataset's predictions go, so it is the
one place that can put `predictions/<model>/<dataset>.engine_stats.json` next to
`predictions/<model>/<dataset>.json`. The file is a JSON list with one dict per prediction
generated in this run (keys include index, tokens, prompt_tokens, decode_tok_s, prefill_tok_s,
peak_memory_gib, wall_s, finish_reason, cache).
"""

from __future__ import annotations

import json
import os
import os.path as osp

from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.registry import ICL_INFERENCERS


def stats_path(prediction_dir: str, prediction_file: str) -> str:
    stem = prediction_file[:-5] if prediction_file.endswith('.json') else prediction_file
    return osp.join(prediction_dir, f'{stem}.engine_stats.json')


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
        if pop is not None and self.is_main_process:
            stats = pop()
            total = len(results) if results else len(stats)
            # After a resumed run only the new samples have stats: they are the last ones.
            first = max(total - len(stats), 0)
            for offset, item in enumerate(stats):
                item['index'] = first + offset
            os.makedirs(out_dir, exist_ok=True)
            with open(stats_path(out_dir, out_file), 'w', encoding='utf-8') as f:
                json.dump(stats, f, indent=1)
        return results
