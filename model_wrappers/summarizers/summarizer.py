"""DefaultSummarizer that can weight a summary group by the number of scored items.

MMLU-Pro is 14 category datasets; OpenCompass's `mmlu_pro` group is the unweighted mean of the
categories, while the official MMLU-Pro figure is accuracy over all questions. A group with
`weights='num_items'` is weighted by each subset's item count (read from the per-item details
of the results files), which makes it exactly the per-question average for any data size.
"""

from __future__ import annotations

import os.path as osp

import mmengine
from opencompass.summarizers import DefaultSummarizer
from opencompass.utils import dataset_abbr_from_cfg, get_infer_output_path

NUM_ITEMS = "num_items"


def count_items(details) -> int:
    """Scored items in a results file's `details`: a list, or a dict keyed by item index
    (AccEvaluator-style details also carry a 'type' key)."""
    if isinstance(details, dict):
        return sum(1 for k in details if str(k).isdigit())
    return len(details)


class Edge0Summarizer(DefaultSummarizer):
    def _item_counts(self) -> dict:
        counts = {}
        for model in self.model_cfgs:
            for dataset in self.dataset_cfgs:
                abbr = dataset_abbr_from_cfg(dataset)
                if abbr in counts:
                    continue
                path = get_infer_output_path(
                    model, dataset, osp.join(self.work_dir, "results")
                )
                if osp.exists(path):
                    details = mmengine.load(path).get("details")
                    if details:
                        counts[abbr] = count_items(details)
        return counts

    def _calculate_group_metrics(
        self, raw_results, parsed_results, dataset_metrics, dataset_eval_mode
    ):
        if any(sg.get("weights") == NUM_ITEMS for sg in self.summary_groups):
            counts = self._item_counts()
            groups = []
            for sg in self.summary_groups:
                if sg.get("weights") == NUM_ITEMS:
                    sg = dict(sg)
                    if all(s in counts for s in sg["subsets"]):
                        sg["weights"] = {s: counts[s] for s in sg["subsets"]}
                    else:
                        # Some subset has no results: leave the group incomplete ('-').
                        sg["weights"] = {s: counts.get(s, 1) for s in sg["subsets"]}
                groups.append(sg)
            self.summary_groups = groups
        return super()._calculate_group_metrics(
            raw_results, parsed_results, dataset_metrics, dataset_eval_mode
        )
