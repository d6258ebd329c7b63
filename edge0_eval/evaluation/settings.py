"""Settings fingerprints: what two arms (or a run and its baseline) must share to be paired.

The values come from each run's config dump (outputs.load_run: GENERATION_FIELDS per model,
SCORING_FIELDS per dataset); `report` compares every arm with the teacher, `gate` every arm
with the baseline's, and each difference is named with both values.
"""

from __future__ import annotations


def arm_settings(abbr: str, run, benches: dict) -> dict | None:
    """{generation: the model's GENERATION_FIELDS, scoring: dataset -> SCORING_FIELDS} from
    the run's config dump; None without one."""
    if run.settings is None or abbr not in run.settings:
        return None
    datasets = [d for _, ab in benches.values() for d in ab.datasets]
    return {"generation": run.settings[abbr],
            "scoring": {d: run.scoring[d] for d in datasets if d in (run.scoring or {})}}


def settings_differences(settings: dict, reference: str, other: dict | None = None) -> list[str]:
    """Each field whose value differs between an arm and `reference` (in `other`, e.g. the
    baseline's arms, when given; else among `settings` themselves), named with both values."""
    problems = []
    for arm, st in settings.items():
        ref = (other or settings).get(arm if other is not None else reference)
        if st is None or ref is None or (other is None and arm == reference):
            continue
        against = f"baseline {arm}" if other is not None else reference
        for key, value in st["generation"].items():
            if key in ref["generation"] and ref["generation"][key] != value:
                problems.append(f"{arm} {key} {value!r}, {against} {ref['generation'][key]!r}")
        for dataset, fields in st["scoring"].items():
            theirs = ref["scoring"].get(dataset)
            for key, value in (fields.items() if theirs else ()):
                if key in theirs and theirs[key] != value:
                    problems.append(f"{arm} {dataset} {key} {value!r}, {against} "
                                    f"{theirs[key]!r}")
    return problems
