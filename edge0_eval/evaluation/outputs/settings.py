"""Settings fingerprints: what two arms (or a run and its baseline) must share to be paired.

Per arm (report.json `arms.<arm>.settings`):
  generation  the model config's GENERATION_FIELDS (runs.py), from the run's config dump
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


def item_digests(preds: list[dict], ids: list[str]) -> dict[str, str]:
    """Per item id, 12 hex digits of sha256 over its predictions' (origin_prompt, gold), every
    replica (prediction r x items + k is replica r of item k): what each item asked, so a
    sequential round (a part of the sample, in another order) is checked item by item against
    the baseline's."""
    out = {}
    for k, item in enumerate(ids):
        rows = [[p.get("origin_prompt"), p.get("gold")] for p in preds[k :: len(ids)]]
        text = json.dumps(rows, sort_keys=True, ensure_ascii=True, default=str)
        out[item] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


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
                if key not in other_fields:
                    continue
                differs = (
                    other_fields[key] != value
                    if key != "data"
                    else _same_data_size(value, other_fields[key])
                    and _data_difference(value, other_fields[key], False) is not None
                )
                if differs:
                    problems.append(
                        f"{arm} {dataset} {key} {_shown(value)!r}, {reference} "
                        f"{_shown(other_fields[key])!r}"
                    )
    return problems


def _shown(value):
    """A settings value as named in a message (a data digest without its per-item hashes)."""
    if isinstance(value, dict) and "items" in value:
        return {k: v for k, v in value.items() if k != "items"}
    return value


def _data_difference(mine, base, part: bool) -> str | None:
    """Why a data digest does not match the baseline's; None when it does. part: this report
    is a sequential round (a part of the sample, in the run's order), checked item by item."""
    if not isinstance(mine, dict) or not isinstance(base, dict):
        return f"data digest {_shown(mine)!r}, baseline {_shown(base)!r}"
    if not part:
        if (mine.get("predictions"), mine.get("sha256")) == (
            base.get("predictions"),
            base.get("sha256"),
        ):
            return None
        return f"data {_shown(mine)!r}, baseline {_shown(base)!r}"
    items, base_items = mine.get("items"), base.get("items")
    if not isinstance(items, dict) or not isinstance(base_items, dict):
        return (
            "data digest without per-item hashes (a report made before they were "
            "recorded): a round's items cannot be checked against the baseline's; "
            "make both again with `edge0-eval report`"
        )
    other = [i for i, h in items.items() if base_items.get(i) != h]
    if other:
        return (
            f"data: {len(other)} of this round's items are not the baseline's questions "
            f"(e.g. item {sorted(other)[0]}): another data file or sample"
        )
    return None


def baseline_differences(
    settings: dict, baseline: dict, part: bool = False
) -> list[str]:
    """Each way an arm's generation or scoring settings differ from the baseline's same arm,
    for the arms and datasets both reports hold. Fails closed: settings not recorded on either
    side (a v1 report), no config dump on either side, a field only one side records, and data
    digests that do not match (another size included) are differences; a dataset without
    predictions has no digest, and its row (no_predictions) fails the check instead. part: this report is
    a sequential round, checked item by item (_data_difference)."""
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
            # No digest is no predictions: that row is no_predictions and its check fails.
            why = None if None in data else _data_difference(*data, part)
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
