"""A benchmark the tiny models can pass: agreement with the teacher's greedy answer.

The tiny random-weight models answer (almost) no benchmark item correctly, so on them the
gate's benchmark part would test 0 against 0 and could never fail. This set gives every item a
reference the tiny teacher produces itself: each prompt is a line of the HumanEval and IFBench
prompts (the pinned wheels of the eval extra), and its reference is the teacher arm's greedy
answer under the gate config's generation settings. An arm passes an item when its answer is
exactly that text. The teacher passes every item (a sanity check of the set); the tiny student
passes about half. So it measures how often an arm answers as the teacher does, through the
whole OpenCompass path (prompting, generation, scoring, per-item records), and a change of the
student shows as lost items: what the gate's benchmark part needs to prove it can fail. It is
not a quality benchmark, and says nothing about task accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge0_eval.errors import ConfigError

DATASET_ABBR = "edge0_agreement"
SET_PATH = "data/agreement/agreement.jsonl"  # under the data root
LINE_CHARS = (20, 80)  # prompt lines kept: short, so prefill is cheap
POPULATION = 400  # lines kept: the teacher answers each once


def prompts() -> list[str]:
    """The first POPULATION distinct lines of 20 to 80 characters of the HumanEval and IFBench
    prompts, in file order (of 1,059 with the pinned wheels)."""
    # The fidelity module loads MLX and the engine: imported only when prompts are read, so
    # the planner and the OpenCompass loader do not pay for it.
    from edge0_eval.evaluation.fidelity.scoring import gather_prompts

    got, _ = gather_prompts(["humaneval", "ifbench"], [], None)
    lines: dict[str, None] = {}
    for prompt in got:
        for line in prompt.text.splitlines():
            line = line.strip()
            if LINE_CHARS[0] <= len(line) <= LINE_CHARS[1]:
                lines.setdefault(line)
    return list(lines)[:POPULATION]


def write_set(path: Path, rows: list[dict], teacher: dict) -> Path:
    """rows: {prompt, reference} each; teacher: what made the references (fingerprint and
    settings), on the first line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"teacher": teacher}) + "\n")
        for i, row in enumerate(rows):
            f.write(
                json.dumps(
                    {"id": i, "prompt": row["prompt"], "reference": row["reference"]},
                    ensure_ascii=False,
                )
                + "\n"
            )
    tmp.replace(path)
    return path


def read_set(path: Path) -> tuple[dict, list[dict]]:
    """(teacher header, rows); a missing or malformed file is one error naming it."""
    fix = "make it with `edge0-eval demo --gate` (the tiny gate's preparation)"
    try:
        lines = [
            json.loads(line)
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path}: cannot read the agreement set ({exc}); {fix}"
        ) from None
    if not lines or not isinstance(lines[0], dict) or "teacher" not in lines[0]:
        raise ConfigError(f"{path}: no teacher header on the first line; {fix}")
    rows = lines[1:]
    for i, row in enumerate(rows):
        if not (
            isinstance(row, dict)
            and row.get("id") == i
            and isinstance(row.get("prompt"), str)
            and isinstance(row.get("reference"), str)
        ):
            raise ConfigError(
                f"{path}: line {i + 2} is not {{id: {i}, prompt, reference}}; {fix}"
            )
    if not rows:
        raise ConfigError(f"{path}: no items; {fix}")
    return lines[0]["teacher"], rows


def agrees(prediction, reference: str) -> bool:
    return isinstance(prediction, str) and prediction == reference
