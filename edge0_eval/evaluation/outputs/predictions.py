"""Reading OpenCompass predictions and the engine stats beside them, and the strict JSON every
output file is read with (no NaN, no repeated key)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from edge0_eval.errors import Edge0Error


def load_predictions(pred_dir: Path, dataset: str) -> list[dict] | None:
    """Prediction items in order, from <dataset>.json or its shards _0, _1, ... (as OpenCompass)."""
    files = [pred_dir / f"{dataset}.json"]
    if not files[0].exists():
        files = []
        while (pred_dir / f"{dataset}_{len(files)}.json").exists():
            files.append(pred_dir / f"{dataset}_{len(files)}.json")
    if not files:
        return None
    preds = []
    for f in files:
        data = read_json(f, "predictions")
        if not isinstance(data, dict) or any(
            not isinstance(data.get(str(k)), dict) for k in range(len(data))
        ):
            raise Edge0Error(
                f'{f}: predictions must be an object of items keyed "0".."n-1" '
                f"(as OpenCompass writes them); the file is corrupt, re-run that "
                f"task (delete the file first)"
            )
        preds.extend(data[str(k)] for k in range(len(data)))
    return preds


def read_json(path: Path, what: str):
    """A JSON output file; one Edge0Error naming it when unreadable (NaN is not JSON)."""
    try:
        return strict_loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise Edge0Error(
            f"{path}: {what} file is not readable JSON ({exc}); re-run that task "
            f"(delete the file first)"
        ) from None


def unique_keys(pairs: list[tuple]) -> dict:
    """A JSON object, refusing a repeated key (json keeps the last one without a word)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def strict_loads(text: str):
    """JSON as the outputs must be: no NaN or Infinity, no key twice in one object."""
    return json.loads(
        text, parse_constant=reject_constant, object_pairs_hook=unique_keys
    )


def engine_samples(
    pred_dir: Path, dataset: str, preds: list[dict] | None
) -> list[dict]:
    # Prefer stats stored on each prediction; the side file is the fallback (both may hold
    # the same samples, so they are never added together).
    samples = [
        p["engine_stats"]
        for p in preds or []
        if isinstance(p.get("engine_stats"), dict)
    ]
    if samples:
        return samples
    # Shards in their number's order (as load_predictions reads them): _2 before _10.
    shards = pred_dir.glob(f"{_glob_escape(dataset)}_[0-9]*.engine_stats.json")
    shard_no = re.compile(re.escape(dataset) + r"_(\d+)\.engine_stats\.json")
    numbered = sorted(
        (int(m[1]), p) for p in shards if (m := shard_no.fullmatch(p.name))
    )
    for side in [pred_dir / f"{dataset}.engine_stats.json", *(p for _, p in numbered)]:
        if side.exists():
            data = read_json(side, "engine stats")
            if not isinstance(data, list) or not all(isinstance(s, dict) for s in data):
                raise Edge0Error(
                    f"{side}: engine stats must be a JSON list of objects; the file "
                    f"is corrupt, re-run that task (delete its predictions first)"
                )
            samples.extend(data)
    return samples


def engine_stats_problem(samples: list[dict], n_predictions: int | None) -> str | None:
    """Why a dataset's engine stats do not describe its predictions (None: they do, or none).

    A run killed and resumed with `-r` keeps the old predictions but only the new samples'
    stats; figures from such a subset would be reported as if they covered the dataset.
    """
    if not samples or n_predictions is None:
        return None
    # Counts, not indices: shards (<dataset>_<k>) number their samples from 0 each.
    if len(samples) != n_predictions:
        return (
            f"engine stats cover {len(samples)} of {n_predictions} predictions (a resumed "
            f"run?); re-run the dataset without -r (delete its predictions) for complete "
            f"engine figures"
        )
    return None


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def engine_summary(samples: list[dict]) -> dict | None:
    """The report's engine figures for one arm and benchmark, from its per-sample stats."""
    if not samples:
        return None

    def values(key):
        return [float(s[key]) for s in samples if isinstance(s.get(key), (int, float))]

    def mean_or_none(key):
        v = values(key)
        return sum(v) / len(v) if v else None

    cache: dict[str, int] = {}
    for s in samples:
        if s.get("cache") is not None:
            cache[str(s["cache"])] = cache.get(str(s["cache"]), 0) + 1
    peak = values("peak_memory_gib")
    tokens = values("tokens")
    batch = values("batch_size")
    # decode_tok_s is each row's own stream rate; with batch_size > 1 the throughput is the
    # batch's aggregate rate, which every row of a batch carries.
    return {
        "samples": len(samples),
        "decode_tok_s": mean_or_none("decode_tok_s"),
        "batch_size": int(max(batch)) if batch else 1,
        "batch_decode_tok_s": mean_or_none("batch_decode_tok_s"),
        "prefill_tok_s": mean_or_none("prefill_tok_s"),
        "peak_memory_gib": max(peak) if peak else None,
        "tokens": int(sum(tokens)) if tokens else None,
        "cache": cache,
    }
