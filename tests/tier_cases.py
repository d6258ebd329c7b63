"""What the tier configs build under each environment the tests run them in, recorded in
tests/tier_configs.json: per config and environment its models, datasets (abbr and sampled
test_range), partitioners, summarizer class and gate inputs, or the line it stops with.

The record was first made from the configs whose logic was written inline (before
edge0_eval/evaluation/plan/tiers.py), with each class named by its dotted path after the
model_wrappers moves; tests/test_tier_configs.py checks the configs still build exactly that.
After an intended change to the configs' data, record again from the repository root:

    python tests/tier_cases.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECORD = Path(__file__).resolve().parent / "tier_configs.json"
PATHS = {
    "EDGE0_35B_TEACHER": "/m/35b-teacher",
    "EDGE0_35B_STUDENT": "/m/35b-student",
    "EDGE0_8B_TEACHER": "/m/8b-teacher",
    "EDGE0_8B_STUDENT": "/m/8b-student",
}
SERVED = {
    "EDGE0_35B_STUDENT_API": "http://a:8001/v1,http://b:8001/v1",
    "EDGE0_8B_STUDENT_API": "http://a:8001/v1",
    "EDGE0_35B_TEACHER_API": "http://t:8080/v1",
}
# (name, environment): what the tests run the tier configs under, and the ways each can stop.
ENVIRONMENTS = {
    "default arms": PATHS,
    "three arms": {**PATHS, "EDGE0_ARMS": "teacher,student,int4_exact"},
    "card sampling": {
        **PATHS,
        "EDGE0_ARMS": "teacher,student,int4_exact",
        "EDGE0_SAMPLING": "card",
    },
    "empty sampling": {**PATHS, "EDGE0_SAMPLING": ""},
    "unknown sampling": {**PATHS, "EDGE0_SAMPLING": "vendor"},
    "nothing set": {},
    "8b paths only": {
        "EDGE0_8B_TEACHER": "/m/8b-teacher",
        "EDGE0_8B_STUDENT": "/m/8b-student",
        "EDGE0_ARMS": "teacher,student,prerouted_nolora",
    },
    "student without a teacher path": {
        "EDGE0_35B_STUDENT": "/m/35b-student",
        "EDGE0_8B_STUDENT": "/m/8b-student",
        "EDGE0_ARMS": "student",
    },
    "student unset": {
        "EDGE0_35B_TEACHER": "/m/35b-teacher",
        "EDGE0_8B_TEACHER": "/m/8b-teacher",
    },
    "served arms": {**PATHS, **SERVED, "EDGE0_ARMS": "teacher_api,student_api,student"},
    "served arm without its URL": {**PATHS, "EDGE0_ARMS": "teacher,student_api"},
    "unknown arm": {**PATHS, "EDGE0_ARMS": "teacher,bogus"},
    "empty arms": {**PATHS, "EDGE0_ARMS": ""},
    "gate round and seed": {
        **PATHS,
        "EDGE0_GATE_ROUND": "2",
        "EDGE0_GATE_SEED": "7f3a",
    },
    "empty gate round": {**PATHS, "EDGE0_GATE_ROUND": ""},
    "bad gate round": {**PATHS, "EDGE0_GATE_ROUND": "x"},
    "bad gate round, nothing else set": {"EDGE0_GATE_ROUND": "-1"},
}
CONFIG_NAMES = ("edge0_35b", "edge0_8b", "edge0_35b_gate", "edge0_8b_gate")
CASES = [(config, env) for config in CONFIG_NAMES for env in ENVIRONMENTS]
# Variables that change what the tier configs build, besides the ones above.
CLEARED = ("EDGE0_OPEN_THINKING", "OC_JUDGE_MODEL")


def plain(value):
    """A config value as JSON: classes and functions by their dotted path."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "__module__") and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


def build(config: str, env: dict[str, str]) -> dict:
    """What configs/CONFIG.py builds with exactly `env`'s EDGE0_* variables, as `opencompass`
    parses it: its parts the tier logic makes, or {"stop": the line it stops with}."""
    from mmengine.config import Config

    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("EDGE0_") or k in CLEARED]:
        del os.environ[key]
    os.environ.update(env)
    try:
        cfg = Config.fromfile(str(CONFIGS / f"{config}.py"), format_python_code=False)
    except SystemExit as exc:
        return {"stop": str(exc)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    built = {
        "models": plain(cfg["models"]),
        "datasets": [
            [d["abbr"], d["reader_cfg"].get("test_range")] for d in cfg["datasets"]
        ],
        "infer": plain(cfg["infer"]),
        "eval": plain(cfg["eval"]),
        "summarizer": plain(cfg["summarizer"]["type"]),
        "work_dir": cfg["work_dir"],
    }
    if "edge0_gate" in cfg:
        built["edge0_gate"] = plain(cfg["edge0_gate"])
        built["edge0_gate_sources"] = [d["abbr"] for d in cfg["edge0_gate_sources"]]
    return built


def record() -> dict[str, dict]:
    return {
        f"{config} / {env}": build(config, ENVIRONMENTS[env]) for config, env in CASES
    }


if __name__ == "__main__":
    sys.path.insert(0, str(CONFIGS.parent))
    RECORD.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {RECORD}")
