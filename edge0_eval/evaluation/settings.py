"""Settings fingerprints: what two arms (or a run and its baseline) must share to be paired.

Per arm (report.json `arms.<arm>.settings`):
  generation  the model config's GENERATION_FIELDS (outputs.py), from the run's config dump
  scoring     per dataset its SCORING_FIELDS (evaluator and postprocessors are in eval_cfg) and
              `data`: a digest of the questions as prompted and their reference answers, read
              from the predictions file (every prediction's origin_prompt and gold, in order),
              so a different data file of the same size refuses to pair wherever the report
              is made (a different size shows as items that differ)
  model       the rest of the model config (class, engine options) and `identity`, from the
              engine stats (identity.py: config, expert index CRCs, adapter and heads hashes)
`report` compares every arm's generation and scoring with the teacher's, `gate` every arm's
with the baseline's, and each difference is named with both values. The model part may
differ (that is what is compared); the gate names what changed in it.
"""

from __future__ import annotations

import hashlib
import json

COMPARED = ("generation", "scoring")


def data_digest(preds: list[dict] | None) -> dict | None:
    """{predictions, sha256}: how many, and 16 hex digits of sha256 over each prediction's
    (origin_prompt, gold), in order."""
    if preds is None:
        return None
    rows = [[p.get("origin_prompt"), p.get("gold")] for p in preds]
    text = json.dumps(rows, sort_keys=True, ensure_ascii=True, default=str)
    return {
        "predictions": len(preds),
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def _same_data_size(a, b) -> bool:
    """Data digests are compared on equal prediction counts only: arms that scored different
    item sets are reported as such (items_mismatch), not as a different data file."""
    return (
        isinstance(a, dict)
        and isinstance(b, dict)
        and a.get("predictions") == b.get("predictions")
    )


def arm_settings(abbr: str, run, datasets: dict[str, dict | None], identity) -> dict:
    """{generation, scoring, model} of one arm: `datasets` maps its dataset abbrs to their
    data digests; generation is None (not compared) without a config dump."""
    dumped = (run.settings or {}).get(abbr)
    scoring = {
        d: {**((run.scoring or {}).get(d) or {}), "data": digest}
        for d, digest in datasets.items()
    }
    return {
        "generation": dumped["generation"] if dumped else None,
        "scoring": scoring,
        "model": {**(dumped["model"] if dumped else {}), "identity": identity},
    }


def settings_differences(
    settings: dict, reference: str, other: dict | None = None
) -> list[str]:
    """Each generation or scoring field whose value differs between an arm and `reference` (in
    `other`, e.g. the baseline's arms, when given; else among `settings` themselves), named
    with both values. A field one side does not record (an older report, no config dump) is
    not compared."""
    problems = []
    for arm, st in settings.items():
        ref = (other or settings).get(arm if other is not None else reference)
        if st is None or ref is None or (other is None and arm == reference):
            continue
        against = f"baseline {arm}" if other is not None else reference
        mine, theirs = st.get("generation") or {}, ref.get("generation") or {}
        for key, value in mine.items():
            if key in theirs and theirs[key] != value:
                problems.append(f"{arm} {key} {value!r}, {against} {theirs[key]!r}")
        for dataset, fields in (st.get("scoring") or {}).items():
            other_fields = (ref.get("scoring") or {}).get(dataset) or {}
            for key, value in fields.items():
                if (
                    key in other_fields
                    and other_fields[key] != value
                    and (key != "data" or _same_data_size(value, other_fields[key]))
                ):
                    problems.append(
                        f"{arm} {dataset} {key} {value!r}, {against} "
                        f"{other_fields[key]!r}"
                    )
    return problems


def model_changes(settings: dict, baseline: dict) -> list[str]:
    """What differs in each arm's model (class, engine options, identity) from the baseline's
    same arm: not a refusal, the change the gate is judging."""
    notes = []
    for arm, st in settings.items():
        base = (baseline.get(arm) or {}).get("model") if baseline.get(arm) else None
        mine = (st or {}).get("model")
        if not base or not mine:
            continue
        for key in sorted(set(mine) | set(base)):
            if key in mine and key in base and mine[key] != base[key]:
                notes.append(f"{arm} {key} {mine[key]!r}, baseline {base[key]!r}")
    return notes
