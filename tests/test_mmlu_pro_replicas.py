"""MMLU-Pro with n > 1 samples per question, scored by OpenCompass's own eval task on the
bundles' eval_cfg: the dataset's score is the mean over replicas, and the report agrees.

OpenCompass 0.5.4's BaseEvaluator.evaluate scores each replica apart and averages them only
through per-prediction details; the shipped AccEvaluator returns none, and then the last
replica's accuracy came back as the dataset's score (the report refused it as inconsistent).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_eval.cli import main
from edge0_eval.evaluation.data.fixtures import write_fixtures

pytest.importorskip("opencompass")

REPO = Path(__file__).resolve().parents[1]

# Replica 0 answers every question right, replica 1 every one wrong: the mean is 50 points,
# the last replica alone 0.
RUN = """
import json, os, os.path as osp, sys
from mmengine.config import Config
from opencompass.tasks.openicl_eval import OpenICLEvalTask
from opencompass.utils import build_dataset_from_cfg

bundle, work = sys.argv[1], sys.argv[2]
cfg = Config.fromfile(bundle, format_python_code=False)
name = "edge0_datasets" if "edge0_datasets" in cfg else "edge0_raw_datasets"
(d,) = [d for d in cfg[name] if d["abbr"] == "mmlu_pro_math"]
d["n"] = 2
test = build_dataset_from_cfg(d).test
gold = list(test[d["reader_cfg"]["output_column"]])
items = len(gold) // 2
wrong = {g: next(c for c in "ABCD" if c != g) for g in set(gold)}
preds = {str(i): {"origin_prompt": f"q{i}", "gold": g,
                  "prediction": f"ANSWER: {g if i < items else wrong[g]}"}
         for i, g in enumerate(gold)}
models = [dict(abbr=abbr, type="x", path="x") for abbr in ("m-teacher", "m-student")]
os.makedirs(osp.join(work, "configs"))
Config(dict(models=models, datasets=[d], work_dir=work)).dump(
    osp.join(work, "configs", "20260301_000000_1.py"))
for m in models:
    abbr = m["abbr"]
    p = osp.join(work, "predictions", abbr)
    os.makedirs(p, exist_ok=True)
    with open(osp.join(p, "mmlu_pro_math.json"), "w") as f:
        json.dump(preds, f)
    OpenICLEvalTask(Config(dict(models=[m], datasets=[[d]],
                                work_dir=work, eval=dict(runner=dict(task=dict(dump_details=True))))
                           )).run()
print(json.dumps({"items": items}))
"""


@pytest.mark.parametrize("bundle", ["edge0_bundle.py", "edge0_bundle_rawprompt.py"])
def test_mmlu_pro_score_is_the_mean_over_samples(tmp_path, bundle):
    data = tmp_path / "data"
    write_fixtures(data)
    work = tmp_path / "outputs" / "20260301_000000"
    (tmp_path / "run.py").write_text(RUN)
    env = {
        "COMPASS_DATA_CACHE": str(data),
        "PATH": "/usr/bin:/bin",
        "HF_DATASETS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            str(REPO / "configs" / "datasets" / bundle),
            str(work),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    items = json.loads(proc.stdout.strip().splitlines()[-1])["items"]
    assert items >= 2
    result = json.loads(
        (work / "results" / "m-student" / "mmlu_pro_math.json").read_text()
    )
    assert result.get("accuracy (2 runs average)") == pytest.approx(50.0), {
        k: v for k, v in result.items() if k != "details"
    }
    out = tmp_path / "rep"
    main(
        [
            "report",
            str(work),
            "--out",
            str(out),
            "--arms",
            "teacher=m-teacher,student=m-student",
        ]
    )
    rep = json.loads((out / "report.json").read_text())
    (row,) = [r for r in rep["benchmarks"] if r["benchmark"] == "MMLU-Pro"]
    assert row["status"] == "ok" and row["items"] == items
    assert row["student"] == pytest.approx(50.0)
