"""Repeats (OpenCompass's dataset `n`, avg@N): every copy of a prompt draws its own sample.

OpenCompass concatenates a dataset n times, so copy j of item i is the same prompt at position
j * N + i of the whole test set. The inferencer passes each prompt's copy index to `generate`
(`sample_indices`), which seeds copy j apart (`chat.row_seed`); a task may hold only a slice of
the test set, so the copy comes from the partitioner's layout, never from counting prompts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, concatenate_datasets
from mmengine.config import Config
from opencompass.datasets.base import BaseDataset
from opencompass.openicl.icl_dataset_reader import load_partial_dataset
from opencompass.utils import build_dataset_from_cfg
from opencompass.utils.build import build_model_from_cfg

from edge0_eval.checkpoints.tiny import TinyShape, write_tiny
from edge0_eval.demo import TINY_DATASETS, offline_env
from edge0_eval.engine.inputs import row_seed
from edge0_eval.errors import ConfigError
from edge0_eval.evaluation.data.fixtures import write_fixtures
from model_wrappers.inferencers.inferencer import sample_indices
from model_wrappers.models.edge0_model import Edge0Model
from model_wrappers.models.mlx_lm_model import MLXLMModel
from model_wrappers.partitioners.partitioner import Edge0NumWorkerPartitioner

REPO = Path(__file__).resolve().parent.parent
ITEMS = 5
CARD = dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, seed=0)


class _Items(BaseDataset):
    @staticmethod
    def load(**kwargs):
        return Dataset.from_dict(
            {"q": [f"q{i}" for i in range(ITEMS)], "a": ["x"] * ITEMS}
        )


def _truth(copies: int, test_range):
    """(idx, copy) of each row OpenCompass's BaseDataset puts in a test set sliced by
    test_range: a copy is position // items, the slices its evaluator scores as replicas."""
    base = Dataset.from_dict({"idx": list(range(ITEMS))})
    whole = concatenate_datasets([base] * copies)
    whole = whole.add_column("copy", [p // ITEMS for p in range(len(whole))])
    part = load_partial_dataset(whole, size=test_range)
    return list(part["idx"]), list(part["copy"])


@pytest.mark.parametrize(
    "test_range", [None, "[0:7]", "[7:14]", "[14:20]", "[3:18]", "[3:18][2:9]", 6, 0.5]
)
def test_sample_index_is_the_copy_in_every_slice(test_range):
    reader = dict(input_columns=["q"], output_column="a", test_range=test_range)
    test = _Items(reader_cfg=reader, n=4).test
    idx, copies = _truth(4, test_range)
    assert list(test["idx"]) == idx  # the truth is laid out as OpenCompass lays it out
    layout = dict(copies=4, items=ITEMS, test_range=test_range)
    assert sample_indices(len(test), idx, layout, "x") == copies


def test_sample_indices_refuse_what_they_cannot_place():
    idx, _ = _truth(4, "[3:18]")
    with pytest.raises(ConfigError, match="do not sit where 4 copies of 6 items"):
        sample_indices(len(idx), idx, dict(copies=4, items=6, test_range="[3:18]"), "x")
    # Repeated items and no layout: counting prompts in one slice would collide across slices.
    with pytest.raises(ConfigError, match="no layout to tell the copies apart"):
        sample_indices(len(idx), idx, None, "x")
    assert sample_indices(3, [0, 1, 2], None, "x") == [0, 0, 0]


def test_num_worker_slices_draw_every_item_and_copy_once(tmp_path, monkeypatch):
    """Edge0NumWorkerPartitioner splits an n = 4 dataset across workers; the layouts it hands
    the inferencers give each (item, copy) to exactly one row. Counting copies inside each
    slice (the design the layout replaces) collides."""
    data = tmp_path / "data"
    write_fixtures(data)
    for key, value in dict(
        COMPASS_DATA_CACHE=str(data),
        EDGE0_TINY_TEACHER="unused",
        EDGE0_TINY_STUDENT="unused",
        EDGE0_ARMS="teacher",
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile(str(REPO / "configs" / "edge0_tiny.py"))
    datasets = [d for d in cfg["datasets"] if d["abbr"] in ("aime2026", "GPQA_diamond")]
    for d in datasets:
        d["n"] = 4
    part = Edge0NumWorkerPartitioner(
        out_dir=str(tmp_path / "p"),
        num_worker=3,
        min_task_size=1,
        full_data=False,
        check_models=False,
        dataset_size_path=str(tmp_path / "sizes.json"),
    )
    tasks = part(
        Config(
            dict(models=cfg["models"], datasets=datasets, work_dir=str(tmp_path / "w"))
        )
    )
    drawn, counted = {}, {}
    for task in tasks:
        for d in task["datasets"][0]:
            name = d["abbr"].rsplit("_", 1)[0]
            idx = list(build_dataset_from_cfg(d).test["idx"])
            layout = d["infer_cfg"]["inferencer"]["repeats"]
            assert (
                layout["copies"] == 4
                and layout["test_range"] == d["reader_cfg"]["test_range"]
            )
            samples = sample_indices(len(idx), idx, layout, d["abbr"])
            drawn.setdefault(name, []).extend(zip(idx, samples))
            counted.setdefault(name, []).extend(
                (i, idx[:k].count(i)) for k, i in enumerate(idx)
            )
    assert set(drawn) == {"aime2026", "GPQA_diamond"}
    for name, pairs in drawn.items():
        n_items = len({i for i, _ in pairs})
        assert sorted(pairs) == [(i, j) for i in range(n_items) for j in range(4)]
        # the collision the layout prevents
        assert len(set(counted[name])) < 4 * n_items
    assert len(tasks) >= 3


@pytest.fixture(scope="module")
def arms(tiny_qwen, edge0_qwen):
    return [
        MLXLMModel(path=str(tiny_qwen), generation_kwargs=CARD),
        Edge0Model(
            path=str(edge0_qwen),
            mode="reactive",
            no_lora=True,
            no_prerouter=True,
            experts_per_token=2,
            slots_per_layer=4,
            generation_kwargs=CARD,
        ),
    ]


PROMPTS = ["What is 2 + 2?", "Name a colour.", "Hi"]


@pytest.mark.parametrize("arm", [0, 1], ids=["teacher", "student"])
def test_four_copies_draw_four_samples_the_same_at_any_batch_size(arms, arm):
    model = arms[arm]
    # As OpenCompass hands them: copy-major, the same prompts four times.
    prompts = PROMPTS * 4
    samples = [j for j in range(4) for _ in PROMPTS]

    def run(batch: int) -> list[str]:
        out = []
        for i in range(0, len(prompts), batch):
            out += model.generate(
                prompts[i : i + batch],
                max_out_len=12,
                sample_indices=samples[i : i + batch],
            )
        return out

    model.pop_sample_stats()
    whole = run(len(prompts))
    stats = model.pop_sample_stats()
    for i, prompt in enumerate(PROMPTS):
        copies = whole[i :: len(PROMPTS)]
        assert len(set(copies)) == 4, (prompt, copies)
    assert run(1) == whole and run(5) == whole and run(len(prompts)) == whole
    ids = [model.encode_prompt(p) for p in prompts]
    assert [s["sample"] for s in stats] == samples
    assert [s["seed"] for s in stats] == [
        row_seed(0, i, j) for i, j in zip(ids, samples)
    ]
    # Copy 0 keeps the seed (and so the sample) every run had before repeats existed.
    assert model.generate(PROMPTS, max_out_len=12) == whole[: len(PROMPTS)]
    assert row_seed(0, ids[0]) == row_seed(0, ids[0], 0) != row_seed(0, ids[0], 1)
    with pytest.raises(ConfigError, match="one whole number >= 0 per prompt"):
        model.generate(PROMPTS, max_out_len=4, sample_indices=[0, 1])
    # The check sees copies that draw alike (the old seeding: prompt only).
    alike = model.generate(prompts, max_out_len=12)
    assert len(set(alike[0 :: len(PROMPTS)])) == 1
    model.pop_sample_stats()


# -- avg@4 through the real `opencompass` command ---------------------------------------------


def test_avg_at_4_on_the_tiny_suite_through_opencompass(tmp_path, monkeypatch):
    """The tiny suite at n = 4 and the model card's sampling, inference only (`-m infer`; the
    evaluators' replica averaging is OpenCompass's), the teacher arm (the student's `generate`
    takes the same sample indices: the wrapper test above): four different predictions per item,
    each one regenerated alone (batch_size 1, a rerun) by the model OpenCompass built."""
    teacher, data = tmp_path / "teacher", tmp_path / "data"
    write_tiny(teacher, TinyShape(family="qwen3_5_moe"))
    write_fixtures(data)
    env = dict(
        COMPASS_DATA_CACHE=str(data),
        EDGE0_TINY_TEACHER=str(teacher),
        EDGE0_ARMS="teacher",
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = Config.fromfile(
        str(REPO / "configs" / "edge0_tiny.py"), format_python_code=False
    )
    cfg["datasets"] = [d for d in cfg["datasets"] if d["abbr"] in TINY_DATASETS]
    for d in cfg["datasets"]:
        d["n"] = 4
    for model in cfg["models"]:
        model["generation_kwargs"] = dict(CARD)
    config = tmp_path / "avg4.py"
    cfg.dump(str(config))
    script = Path(sys.executable).parent / "opencompass"
    cmd = [
        str(script) if script.exists() else shutil.which("opencompass"),
        str(config),
        "-w",
        str(tmp_path / "out"),
        "-m",
        "infer",
    ]
    proc = subprocess.run(
        cmd,
        env=offline_env(env),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    for model_cfg in cfg["models"]:
        model = build_model_from_cfg(model_cfg)
        for dataset in TINY_DATASETS:
            where = run / "predictions" / model_cfg["abbr"]
            preds = json.loads((where / f"{dataset}.json").read_text())
            stats = json.loads((where / f"{dataset}.engine_stats.json").read_text())
            items = len(preds) // 4
            assert len(preds) == 4 * items > 0
            assert [(s["item"], s["sample"]) for s in stats] == [
                (p % items, p // items) for p in range(len(preds))
            ]
            for i in range(items):
                copies = [preds[str(i + j * items)] for j in range(4)]
                assert (
                    len(
                        {
                            c["origin_prompt"]
                            if isinstance(c["origin_prompt"], str)
                            else json.dumps(c["origin_prompt"])
                            for c in copies
                        }
                    )
                    == 1
                )
                assert len({c["prediction"] for c in copies}) == 4, (
                    model_cfg["abbr"],
                    dataset,
                )
                for j, c in enumerate(copies):
                    alone = model.generate(
                        [c["origin_prompt"]],
                        max_out_len=model_cfg["max_out_len"],
                        sample_indices=[j],
                    )
                    assert alone == [c["prediction"]], (
                        model_cfg["abbr"],
                        dataset,
                        i,
                        j,
                    )
