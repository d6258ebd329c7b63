"""The fidelity set file and the metrics on it (numpy only: configs and the report import this
without MLX). The set is made by edge0_eval/evaluation/fidelity/scoring.py (`edge0-eval
fidelity make`).

File (JSON, or gzipped JSON: written so for a .gz name, read by content), format
"edge0-eval/fidelity/v2":
  teacher   {name, fingerprint (sha256 of config, tokenizer, weight headers and bytes), model_type,
             compute_dtype (as asked), dtype (what it ran in there; absent in older sets),
             scorer (the teacher-forced scorer that made its log-probs: "layer-major";
             absent in older sets, whose rows came from "pieces")}
  max_new, min_new, top_k, thinking (asked), thinking_in_template (the chat template reads
  it), created, sources {source: {file, items, ...}}, left_out {shorter_than_min_new: [ids]}
  items     [{id, source, prompt (text), prompt_ids (chat template applied), tokens (the
             teacher's greedy continuation), topk_ids [P][K] (first = the token),
             topk_logprobs [P][K], rest [P] (1 - top-k mass), end ("stop", "length", or
             "near_tie": cut where decode and the teacher-forced pass round a tie apart),
             pieces {token id: its text} for the continuation's and the top-3 ids
             (optional: the report's page shows tokens by it)}]
v2's rows come from the teacher-forced pass every arm is scored with (fidelity.teacher_rows);
v1's (no min_new, left_out, end) were decoded one step at a time. Both read: the two are the
same bits where a piece computes the bits of single steps (qwen3_5_moe, qwen2_moe:
tests/test_fidelity.py); for bailing_hybrid a v1 set's teacher arm misses the exact sanity
check (KL 0, agreement 100) by rounding, and the fix is to make the set again.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from numbers import Real
from pathlib import Path

import numpy as np

from edge0_eval.errors import ConfigError

FORMAT = "edge0-eval/fidelity/v2"
READABLE = ("edge0-eval/fidelity/v1", FORMAT)
ENDS = ("stop", "length", "near_tie")
DTYPES = ("float16", "bfloat16", "float32")  # a teacher's activation dtype
# Teacher-forced scorers (scoring.py): every arm is scored by the one that made the set
# (`scorer_of`), so the teacher reproduces it exactly and no arm's KL holds the difference
# between scorers (in half precision they round apart; `fidelity bench` measures by how much).
LAYER_MAJOR = "layer-major"  # a batch, one layer at a time (engine/layer_major.py)
PIECES = "pieces"  # one sequence in pieces of positions (Sequence.forced)
SCORERS = (LAYER_MAJOR, PIECES)
# Where `data stage` lays a set and configs/datasets/edge0_fidelity.py looks (under the data root).
SET_PATH = "data/fidelity/fidelity_set.json"
# The dataset abbr of configs/datasets/edge0_fidelity.py; the report tells fidelity rows by it.
DATASET_ABBR = "edge0_fidelity"
# Tail masses below this are treated as this (log of zero); the same floor for both sides.
TAIL_FLOOR = 1e-12
METRICS = ("kl", "agreement", "nll", "greedy_match")
# The keys each format writes (fidelity.make_set); v2 added V2_KEYS and the items' `end`. Any
# other key is a newer or foreign writer's (a `format_version`, say): refused, not ignored.
V1_KEYS = (
    "format",
    "created",
    "teacher",
    "max_new",
    "top_k",
    "thinking",
    "sources",
    "items",
)
V2_KEYS = ("min_new", "thinking_in_template", "left_out")
ITEM_KEYS = (
    "id",
    "source",
    "prompt",
    "prompt_ids",
    "tokens",
    "topk_ids",
    "topk_logprobs",
    "rest",
)
# `scorer` is absent from sets made before the layer-major scorer (scorer_of: pieces).
TEACHER_KEYS = ("name", "fingerprint", "model_type", "compute_dtype", "dtype", "scorer")


def tail_mass(logprobs) -> np.ndarray:
    """1 - sum(exp(top-k log-probs)) per position, floored; computed identically for both sides."""
    lp = np.asarray(logprobs, dtype=np.float64)
    return np.maximum(1.0 - np.exp(lp).sum(axis=-1), TAIL_FLOOR)


# --------------------------------------------------------------------------- metrics


def score_item(item: dict, arm_logprobs, arm_argmax) -> dict:
    """Per-item fidelity of one arm against the set's teacher row `item`."""
    t_lp = np.asarray(item["topk_logprobs"], dtype=np.float32).astype(np.float64)
    a_lp = np.asarray(arm_logprobs, dtype=np.float32).astype(np.float64)
    argmax = np.asarray(arm_argmax, dtype=np.int64)
    tokens = np.asarray(item["tokens"], dtype=np.int64)
    if a_lp.shape != t_lp.shape or argmax.shape != tokens.shape:
        raise ConfigError(
            f"item {item['id']}: the arm returned log-probs {a_lp.shape} and "
            f"{argmax.shape} argmax for the set's {t_lp.shape} positions"
        )
    t_rest = np.maximum(np.asarray(item["rest"], dtype=np.float64), TAIL_FLOOR)
    a_rest = tail_mass(a_lp)
    kl = (np.exp(t_lp) * (t_lp - a_lp)).sum(axis=-1) + t_rest * (
        np.log(t_rest) - np.log(a_rest)
    )
    # The reverse direction, KL(arm || teacher), over the same top-k plus tail buckets.
    rkl = (np.exp(a_lp) * (a_lp - t_lp)).sum(axis=-1) + a_rest * (
        np.log(a_rest) - np.log(t_rest)
    )
    agree = argmax == tokens
    miss = np.flatnonzero(~agree)
    # tokens[i] is the teacher's argmax, the set's first top-k id: its arm log-prob is column 0.
    # Per position (positions.py): KL both ways and the change of the teacher token's
    # probability (arm - teacher) to 6 significant digits, agreement 0/1, and the arm's three
    # likeliest of the teacher's top-k ids with their probabilities (the report's page).
    top = np.argsort(-a_lp, axis=-1, kind="stable")[:, :3]
    ids = item.get("topk_ids")  # absent only from hand-made rows (tests)
    return {
        "kl": float(kl.mean()),
        "agreement": float(agree.mean()),
        "nll": float(-a_lp[:, 0].mean()),
        "greedy_match": int(miss[0]) if miss.size else int(tokens.size),
        "positions": int(tokens.size),
        "kl_positions": _sig(kl),
        "agree_positions": [int(a) for a in agree],
        "rkl_positions": _sig(rkl),
        "dp_positions": _sig(np.exp(a_lp[:, 0]) - np.exp(t_lp[:, 0])),
        "top_positions": None
        if ids is None
        else [
            [[int(ids[p][c]), round(float(np.exp(a_lp[p, c])), 4)] for c in cols]
            for p, cols in enumerate(top)
        ],
        "tokens": [int(t) for t in tokens],
        "prompt": item.get("prompt", ""),
        **({"pieces": item["pieces"]} if "pieces" in item else {}),
    }


def _sig(values) -> list[float]:
    return [float(f"{v:.6g}") for v in values]


def scorer_of(fset: dict) -> str:
    """The scorer that made a set's teacher log-probs, which every arm is scored with."""
    return fset["teacher"].get("scorer") or PIECES


def item_digest(item: dict) -> str:
    """What a prediction records of the set item it scored (its prompt, tokens and top-k ids),
    so the evaluator cannot pair it with another item: predictions reused by `-r` after another
    set was staged pair by position only."""
    key = json.dumps(
        [item["id"], item["prompt_ids"], item["tokens"], item["topk_ids"]],
        separators=(",", ":"),
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def mean_metrics(rows: list[dict]) -> dict:
    return {m: sum(r[m] for r in rows) / len(rows) for m in METRICS} if rows else {}


# --------------------------------------------------------------------------- the file


def write_set(fset: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(fset, separators=(",", ":")) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


GZIP_MAGIC = b"\x1f\x8b"


def read_set(path: str | Path) -> dict:
    """A fidelity set, validated; any problem is one ConfigError naming the file and the fix."""
    path = Path(path)
    fix = "make it with `edge0-eval fidelity make TEACHER --out FILE`"
    if not path.is_file():
        raise ConfigError(
            f"fidelity set {path} not found; {fix} (or `edge0-eval data stage "
            f"--fidelity FILE` to lay one there)"
        )
    try:
        raw = path.read_bytes()
        # By content, not by name: `data stage` lays a .json.gz set at a fixed .json path.
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
        fset = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"fidelity set {path} is unreadable ({exc}); {fix}") from None
    problem = _problem(fset)
    if problem:
        raise ConfigError(f"fidelity set {path}: {problem}; {fix}")
    return fset


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v)


def _is_real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


def _problem(fset) -> str | None:
    if not isinstance(fset, dict) or fset.get("format") not in READABLE:
        got = fset.get("format") if isinstance(fset, dict) else type(fset).__name__
        return f"format {got!r}, expected one of {READABLE}"
    v2 = fset["format"] == FORMAT
    known = V1_KEYS + (V2_KEYS if v2 else ())
    unknown = sorted(set(fset) - set(known))
    if unknown:
        newer = sorted(set(unknown) & set(V2_KEYS))
        return (
            f"format {fset['format']!r} but it holds {newer}, which v2 sets hold (a v2 set "
            f"relabelled? v1 rows were decoded step by step, not by v2's pass)"
            if newer
            else f"unknown key(s) {unknown} for format {fset['format']!r}: written by "
            f"another version of edge0-eval or another tool"
        )
    for key in ("teacher", "max_new", "top_k", "sources", "items"):
        if key not in fset:
            return f"no {key!r}"
    teacher = fset["teacher"]
    if not isinstance(teacher, dict) or not isinstance(teacher.get("fingerprint"), str):
        return "'teacher' must be an object with a string 'fingerprint'"
    if set(teacher) - set(TEACHER_KEYS):
        return (
            f"teacher has unknown key(s) {sorted(set(teacher) - set(TEACHER_KEYS))}; "
            f"it records {TEACHER_KEYS}"
        )
    if teacher.get("dtype") not in (None, *DTYPES):
        return f"teacher dtype {teacher['dtype']!r} is not one of {DTYPES}"
    if teacher.get("scorer") not in (None, *SCORERS):
        return f"teacher scorer {teacher['scorer']!r} is not one of {SCORERS}"
    for key in ("max_new", "top_k") + (("min_new",) if v2 else ()):
        if not _is_int(fset.get(key)) or fset[key] < 1:
            return f"{key!r} is {fset.get(key)!r}, expected a whole number >= 1"
    low = fset["min_new"] if v2 else 1
    if not isinstance(fset["items"], list) or not fset["items"]:
        return "no items"
    seen = set()
    for n, item in enumerate(fset["items"]):
        problem = _item_problem(fset, n, item, seen, v2, low)
        if problem:
            return problem
    return None


def _item_problem(
    fset: dict, n: int, item, seen: set, v2: bool, low: int
) -> str | None:
    """What is wrong with the set's item n (None: nothing)."""
    k = fset["top_k"]
    keys = (
        "id",
        "source",
        "prompt_ids",
        "tokens",
        "topk_ids",
        "topk_logprobs",
        "rest",
    )
    if not isinstance(item, dict) or any(key not in item for key in keys):
        return f"item {n} lacks one of {keys}"
    extra = set(item) - set(ITEM_KEYS) - ({"end", "pieces"} if v2 else set())
    if extra:
        return (
            f"item {n}: unknown key(s) {sorted(extra)} for format {fset['format']!r}"
            + (" ('end' is v2's: a v2 set relabelled?)" if "end" in extra else "")
        )
    pieces = item.get("pieces", {})
    if not isinstance(pieces, dict) or not all(
        isinstance(v, str) and k.isdigit() for k, v in pieces.items()
    ):
        return f"item {n}: 'pieces' must map token ids to their text"
    if not (isinstance(item["id"], str) or _is_int(item["id"])):
        return f"item {n}: id {item['id']!r} must be a string or a whole number"
    where = f"item {n} ({item['id']})"
    if item["id"] in seen:
        return f"{where}: duplicate id"
    seen.add(item["id"])
    if not isinstance(item["source"], str):
        return f"{where}: source must be a string"
    for key in ("prompt_ids", "tokens"):
        if not _is_ids(item[key]):
            return f"{where}: {key} must be a list of token ids (whole numbers >= 0)"
    p = len(item["tokens"])
    if not item["prompt_ids"] or not low <= p <= fset["max_new"]:
        return f"{where}: empty prompt, or not min_new..max_new continuation tokens"
    if v2 and item.get("end") not in ENDS:
        return f"{where}: end {item.get('end')!r}, expected one of {ENDS}"
    return _rows_problem(item, where, p, k)


def _rows_problem(item: dict, where: str, p: int, k: int) -> str | None:
    """Why an item's top-k rows do not fit its p tokens and top_k k (None: they do)."""
    rows = (item["topk_ids"], item["topk_logprobs"], item["rest"])
    if not all(isinstance(r, list) for r in rows) or not all(len(r) == p for r in rows):
        return f"{where}: top-k rows do not match its {p} tokens"
    for i, (ids, lps, rest) in enumerate(zip(*rows)):
        if not _is_ids(ids) or not isinstance(lps, list):
            return f"{where} position {i}: top-k ids must be a list of token ids"
        if len(ids) != len(lps) or not 1 <= len(ids) <= k or len(set(ids)) != len(ids):
            return (
                f"{where} position {i}: {len(ids)} ids (distinct?) and {len(lps)} "
                f"log-probs, top_k {k}"
            )
        if ids[0] != item["tokens"][i]:
            return (
                f"{where} position {i}: token {item['tokens'][i]} is not the top-1 id"
            )
        if any(not _is_real(v) or v > 0 for v in lps):
            return f"{where} position {i}: log-probs must be finite numbers <= 0"
        if not _is_real(rest) or not 0 <= rest <= 1:
            return (
                f"{where} position {i}: tail mass {rest!r} must be a number in [0, 1]"
            )
    return None


def max_token_id(fset: dict) -> int:
    """The largest token id a (validated) set holds: prompts, continuations and top-k rows."""
    return max(
        max(max(it["prompt_ids"]), max(max(ids) for ids in it["topk_ids"]))
        for it in fset["items"]
    )


def vocab_problem(fset: dict, vocab_size: int) -> str | None:
    """Why a model with `vocab_size` ids cannot score the set (ids beyond its embedding)."""
    top = max_token_id(fset)
    if top >= vocab_size:
        return (
            f"token id {top} is beyond the model's vocabulary of {vocab_size}: the set was "
            f"made with another tokenizer"
        )
    return None


# Beside a checkpoint: each weight file's sha256 by name, size and mtime, so a 70 GB teacher
# is read once (a read-only checkpoint is read on every fingerprint instead).
DIGEST_CACHE = ".edge0_weights_sha256.json"


def weights_sha256(path: Path, names: list[str]) -> list[str]:
    """The sha256 of each weight file's bytes, from DIGEST_CACHE while its size and mtime hold."""
    try:
        cache = json.loads((path / DIGEST_CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    cache, stale = cache if isinstance(cache, dict) else {}, False
    for name in names:
        st = (path / name).stat()
        stamp, entry = [st.st_size, st.st_mtime_ns], cache.get(name)
        if not (  # a corrupt or stale entry is recomputed, never trusted
            isinstance(entry, dict)
            and entry.get("stamp") == stamp
            and isinstance(entry.get("sha256"), str)
        ):
            h = (
                hashlib.sha256()
            )  # hashlib.file_digest is Python 3.11's; 3.10 is supported
            with open(path / name, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
            digest = h.hexdigest()
            cache[name], stale = {"stamp": stamp, "sha256": digest}, True
    if stale:
        try:
            (path / f"{DIGEST_CACHE}.tmp").write_text(
                json.dumps(cache), encoding="utf-8"
            )
            (path / f"{DIGEST_CACHE}.tmp").replace(path / DIGEST_CACHE)
        except OSError:
            pass
    return [cache[name]["sha256"] for name in names]


def fingerprint(
    path: str | Path,
    weight_files: list[str] | None = None,
    extra_files: tuple[str, ...] = (),
) -> str:
    """sha256 over config.json, the tokenizer files (and `extra_files`, whole) and every weight
    file's name, size, safetensors header and bytes (weights_sha256: hashed once, cached beside
    the checkpoint), so two teachers of one shape (a base and its fine-tune, two seeds) differ.
    weight_files: the names to include (default: every *.safetensors)."""
    path = Path(path)
    h = hashlib.sha256()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        *extra_files,
    ):
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes())
    names = (
        sorted(p.name for p in path.glob("*.safetensors"))
        if weight_files is None
        else sorted(n for n in weight_files if (path / n).is_file())
    )
    for name, digest in zip(names, weights_sha256(path, names)):
        weights = path / name
        h.update(f"{weights.name}\0{weights.stat().st_size}\0{digest}\0".encode())
        with open(weights, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(size, 1 << 26)))
    return h.hexdigest()


def source_counts(fset: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in fset["items"]:
        counts[item["source"]] = counts.get(item["source"], 0) + 1
    return counts
