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
`report` compares every arm's generation and scoring with the teacher's (settings_differences),
`gate` every arm's with the baseline's (baseline_differences, which fails closed: a field,
dataset, config dump or digest one side lacks is a difference, never a pass), and each
difference is named with both values. The model part may differ (that is what is compared);
the gate names what changed in it.
"""

from __future__ import annotations

import hashlib
import json

COMPARED = ("generation", "scoring")


def data_digest(preds: list[dict] | None) -> dict | None:
    """{predictions, sha256, rows}: how many, 16 hex digits of sha256 over each prediction's
    (origin_prompt, gold), in order, and 12 hex digits of each one's own (so a sequential
    round's predictions, a part of the sample in another order, can be checked one by one
    against the baseline's)."""
    if preds is None:
        return None
    rows = [[p.get("origin_prompt"), p.get("gold")] for p in preds]
    text = json.dumps(rows, sort_keys=True, ensure_ascii=True, default=str)

    def one(row) -> str:
        text = json.dumps(row, sort_keys=True, ensure_ascii=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    return {
        "predictions": len(preds),
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "rows": [one(r) for r in rows],
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


def settings_differences(settings: dict, reference: str) -> list[str]:
    """Each generation or scoring field whose value differs between an arm and the
    `reference` arm of the same report, named with both values. A field one side does not
    record (no config dump: the report notes it) is not compared; data digests of different
    sizes are arms that scored different items (the report's items_mismatch), not a
    different data file."""
    problems = []
    ref = settings.get(reference)
    for arm, st in settings.items():
        if st is None or ref is None or arm == reference:
            continue
        mine, theirs = st.get("generation") or {}, ref.get("generation") or {}
        for key, value in mine.items():
            if key in theirs and theirs[key] != value:
                problems.append(f"{arm} {key} {value!r}, {reference} {theirs[key]!r}")
        for dataset, fields in (st.get("scoring") or {}).items():
            other_fields = (ref.get("scoring") or {}).get(dataset) or {}
            for key, value in fields.items():
                if (
                    key in other_fields
                    and other_fields[key] != value
                    and (key != "data" or _same_data_size(value, other_fields[key]))
                ):
                    problems.append(
                        f"{arm} {dataset} {key} {_shown(value)!r}, {reference} "
                        f"{_shown(other_fields[key])!r}"
                    )
    return problems


def _shown(value):
    """A settings value as named in a message (a data digest without its per-row hashes)."""
    if isinstance(value, dict) and "rows" in value:
        return {k: v for k, v in value.items() if k != "rows"}
    return value


def _data_difference(mine, base, order: list[int] | None) -> str | None:
    """Why a data digest does not match the baseline's; None when it does. order: for a
    sequential round, the baseline prediction each of this report's predictions is (its
    predictions are part of the sample, in the run's order); None: the whole sample, in the
    baseline's order."""
    if not isinstance(mine, dict) or not isinstance(base, dict):
        return f"data digest {_shown(mine)!r}, baseline {_shown(base)!r}"
    if order is None:
        if (mine.get("predictions"), mine.get("sha256")) == (
            base.get("predictions"),
            base.get("sha256"),
        ):
            return None
        return f"data {_shown(mine)!r}, baseline {_shown(base)!r}"
    rows, base_rows = mine.get("rows"), base.get("rows")
    if not isinstance(rows, list) or not isinstance(base_rows, list):
        return (
            "data digest without per-row hashes (a report made before they were "
            "recorded): a round's predictions cannot be checked against the baseline's; "
            "make both again with `edge0-eval report`"
        )
    if len(rows) > len(order) or any(
        j >= len(base_rows) or base_rows[j] != row for j, row in zip(order, rows)
    ):
        return (
            "data: this round's questions are not the baseline's (another data file, or "
            "not this gate run's order seed)"
        )
    return None


def baseline_differences(
    settings: dict, baseline: dict, orders: dict[str, list[int]] | None = None
) -> list[str]:
    """Each way an arm's generation or scoring settings differ from the baseline's same arm,
    for the arms and datasets both reports hold. Fails closed: settings not recorded on either
    side (a v1 report), no config dump on either side, a field only one side records, and data
    digests that do not match (another size included) are differences. orders: per
    dataset, the baseline prediction each of this report's predictions is (a sequential
    round; settings._data_difference)."""
    problems = []
    sides = ("this report", "the baseline")
    for arm in sorted(set(settings) & set(baseline)):
        pair = (settings[arm], baseline[arm])
        if any(st is None for st in pair):
            where = sides[pair.index(None)]
            problems.append(
                f"{arm}: {where} records no settings (a v1 report?), so nothing can be "
                f"compared"
            )
            continue
        generation = [st.get("generation") for st in pair]
        if any(g is None for g in generation):
            where = sides[generation.index(None)]
            problems.append(
                f"{arm}: {where} has no config dump, so its generation settings are "
                f"not recorded"
            )
        else:
            problems += _fields(arm, "", *generation)
        scoring = [st.get("scoring") or {} for st in pair]
        # A dataset one side did not score is the checks' (missing from the report: FAIL;
        # not in the baseline: new, not gated), not a setting.
        for dataset in sorted(set(scoring[0]) & set(scoring[1])):
            mine, base = dict(scoring[0][dataset]), dict(scoring[1][dataset])
            data = [mine.pop("data", None), base.pop("data", None)]
            problems += _fields(arm, f" {dataset}", mine, base)
            why = _data_difference(*data, (orders or {}).get(dataset))
            if why:
                problems.append(f"{arm} {dataset} {why}")
    return problems


def _fields(arm: str, where: str, mine: dict, base: dict) -> list[str]:
    problems = []
    for key in sorted(set(mine) | set(base)):
        if key not in mine or key not in base:
            side = "this report" if key not in mine else "the baseline"
            problems.append(f"{arm}{where} {key}: not recorded in {side}")
        elif mine[key] != base[key]:
            problems.append(f"{arm}{where} {key} {mine[key]!r}, baseline {base[key]!r}")
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
