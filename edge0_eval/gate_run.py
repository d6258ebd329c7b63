"""`edge0-eval gate-run CONFIG --baseline BASELINE.json`: run a gate config and gate it.

It composes the verbs as a user would: OpenCompass on the config
(evaluation/plan/opencompass_run.py), then `edge0-eval report` and `edge0-eval gate` through the
command line (cli.main), so each report records the command that made it.

Whole (default): one OpenCompass run of the config's sample, its results checked (OpenCompass
exits 0 when tasks fail), its report written, the gate run against the baseline.

--sequential: the sample in the config's rounds (evaluation/gate/rounds.py), all in one run folder,
in an order drawn for this run: an order seed drawn before round 1 (or --order-seed, to redo a
run), written to WORK/order_seed.txt and printed, passed to every round (EDGE0_GATE_SEED) and to
`gate --order-seed`. Round 1 starts the folder; each later round deletes the sampled datasets' results (so
OpenCompass scores the grown prefix again) and resumes the folder with `-r`, where the round
partitioner infers only the new items. After every round its report is written and
`gate --sequential` judges the reports so far; the run stops at the first round where every
benchmark is decided (or one regressed), and says which rule stopped it.

The baseline is a whole run of the same config (`gate-run --baseline none`, then its report).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import time
from pathlib import Path

from edge0_eval.cli import main as cli_main
from edge0_eval.errors import ConfigError, Edge0Error
from edge0_eval.evaluation.gate.checks import BLIND_EXIT
from edge0_eval.evaluation.gate.rounds import check_rounds, sample_size
from edge0_eval.evaluation.gate.sequential_checks import UNDECIDED_EXIT
from edge0_eval.evaluation.plan.opencompass_run import (
    check_run,
    load_config_with,
    run_opencompass,
)
from edge0_eval.evaluation.report.arms import ARM_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", type=Path, help="a gate config, e.g. configs/edge0_35b_gate.py"
    )
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="BASELINE.json",
        help="report.json of a whole run of this config ('none': run and "
        "report only, e.g. to make the baseline)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("outputs/gate"),
        help="OpenCompass outputs go to WORK/opencompass, reports to "
        "WORK/report* (default outputs/gate)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run the sample in the config's rounds and stop when decided",
    )
    parser.add_argument(
        "--teacher-from",
        type=Path,
        default=None,
        metavar="RUN",
        help="whole mode: the teacher arm's outputs from this earlier run "
        "folder of the same config (run it once with EDGE0_ARMS=teacher; "
        "the config's arms then leave it out)",
    )
    parser.add_argument(
        "--order-seed",
        default=None,
        metavar="SEED",
        help="--sequential: take the sample in this order (letters and digits; "
        "default: a fresh one, drawn before round 1 and written to "
        "WORK/order_seed.txt)",
    )
    parser.add_argument(
        "--accept-blind",
        action="store_true",
        help="passed to `gate`: a check that cannot see the drop asked about "
        "passes (saying so) instead of exiting 4",
    )


def arm_spec(models: list[str]) -> str:
    """`report --arms`: each model abbr (edge0-TIER-ARM) under its arm name."""
    spec = []
    for abbr in models:
        arm = next((a for a in ARM_NAMES if abbr.endswith(a.replace("_", "-"))), None)
        if arm is None:
            raise ConfigError(
                f"model {abbr!r}: its abbr names none of the arms {ARM_NAMES}"
            )
        spec.append(f"{arm}={abbr}")
    return ",".join(spec)


def _teacher_run(run: Path, datasets: list[str]) -> tuple[str, Path]:
    teachers = sorted(
        p.name for p in (run / "predictions").glob("*teacher") if p.is_dir()
    )
    if len(teachers) != 1:
        raise ConfigError(
            f"--teacher-from {run}: expected one teacher arm's predictions, "
            f"found {teachers or 'none'}"
        )
    problems = check_run(run, teachers, datasets)
    if problems:
        raise Edge0Error(
            f"--teacher-from {run} is incomplete:\n  - " + "\n  - ".join(problems)
        )
    return teachers[0], run


def _order_seed(work: Path, sequential: bool, order_seed: str | None) -> str:
    """The run's order seed: drawn before anything is scored, so no outcome can choose it, and
    recorded to redo a run ("" for a whole run: the draw's own order)."""
    if order_seed is not None and not (sequential and order_seed.isalnum()):
        raise ConfigError(
            "--order-seed: letters and digits, for a --sequential run (a whole run takes "
            "its sample in the draw's order)"
        )
    if not sequential:
        return ""
    seed = order_seed or secrets.token_hex(8)
    (work / "order_seed.txt").write_text(seed + "\n", encoding="utf-8")
    print(f"gate-run: order seed {seed} (written to {work / 'order_seed.txt'})")
    return seed


def _teacher(cfg: dict, teacher_from: Path | None, sequential: bool):
    """(teacher arm name, run) from --teacher-from, or None; checked against the config."""
    models = [m["abbr"] for m in cfg["models"]]
    if teacher_from is not None and sequential:
        raise ConfigError(
            "--teacher-from: a sequential run scores every arm in each round; "
            "run the teacher in the config's arms"
        )
    datasets = [d["abbr"] for d in cfg["datasets"]]
    teacher = _teacher_run(teacher_from, datasets) if teacher_from is not None else None
    if teacher and any(m.endswith("teacher") for m in models):
        raise ConfigError(
            "--teacher-from: the config runs a teacher arm too; leave it out of "
            "EDGE0_ARMS"
        )
    return teacher


def _score_round(config, work, env, cfg, number, tag, run_dir) -> Path:
    """One OpenCompass run of round `number` (later rounds score the grown prefix afresh in
    the same folder), its results checked; returns the run folder."""
    models = [m["abbr"] for m in cfg["models"]]
    if run_dir is not None:
        for model in models:
            for d in cfg["datasets"]:
                if sample_size(d) is not None:
                    (run_dir / "results" / model / f"{d['abbr']}.json").unlink(
                        missing_ok=True
                    )
        shutil.rmtree(run_dir / "summary", ignore_errors=True)
    run_dir = run_opencompass(
        config,
        work / "opencompass",
        env,
        work / f"opencompass_{number}.log",
        reuse=run_dir.name if run_dir else None,
    )
    problems = check_run(run_dir, models, [d["abbr"] for d in cfg["datasets"]])
    if problems:
        raise Edge0Error(
            f"the OpenCompass run in {run_dir} ({tag}) is incomplete:\n  - "
            + "\n  - ".join(problems)
        )
    return run_dir


def _report(run_dir: Path, teacher, models: list[str], out: Path, tag: str) -> str:
    runs = [run_dir] + ([teacher[1]] if teacher else [])
    arms = models + ([teacher[0]] if teacher else [])
    # Relative paths: the report records its command, and reports get committed.
    command = ["report", *(os.path.relpath(r) for r in runs), "--out"]
    if cli_main(command + [os.path.relpath(out), "--arms", arm_spec(arms)]) != 0:
        raise Edge0Error(f"`edge0-eval report` failed on {run_dir} ({tag})")
    return str(out / "report.json")


def _gate_args(reports, baseline, seed, rounds, gate, accept_blind) -> list[str]:
    """`gate` on the reports so far (a sequential run's rounds, or the whole run's one)."""
    args = ["gate", *(reports if seed else reports[-1:]), "--baseline", baseline]
    if seed:
        # repr: the gate recomputes each round's items from the shares, so no digit may go
        shares = ",".join(repr(float(f)) for f in rounds)
        args += ["--sequential", "--order-seed", seed, "--rounds", shares]
    for bench, drop in (gate.get("drops") or {}).items():
        args += ["--benchmark-drop", f"{bench}={drop}"]
    return args + (["--accept-blind"] if accept_blind else [])


def gate_run(
    config: Path,
    baseline: str,
    work: Path,
    env: dict[str, str],
    sequential: bool = False,
    teacher_from: Path | None = None,
    order_seed: str | None = None,
    accept_blind: bool = False,
) -> int:
    """Run the gate config (whole, or in rounds) and gate it; returns the gate's exit status
    (0 also when baseline is 'none': run and report only)."""
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    seed = _order_seed(work, sequential, order_seed)
    cfg = load_config_with(config, {**env, "EDGE0_GATE_ROUND": "0"})
    gate = cfg.get("edge0_gate") or {}
    models = [m["abbr"] for m in cfg["models"]]
    teacher = _teacher(cfg, teacher_from, sequential)
    reporting = (
        teacher is not None
        or any(m.endswith("teacher") for m in models)
        and any(not m.endswith("teacher") for m in models)
    )
    rounds = check_rounds(gate.get("rounds")) if sequential else [1.0]
    reports, run_dir, start = [], None, time.perf_counter()
    for number in range(1, len(rounds) + 1):
        tag = f"round {number} of {len(rounds)}" if sequential else "whole sample"
        round_env = {
            **env,
            "EDGE0_GATE_ROUND": str(number if sequential else 0),
            "EDGE0_GATE_SEED": seed,
        }
        run_dir = _score_round(config, work, round_env, cfg, number, tag, run_dir)
        if not reporting:  # one arm alone (e.g. the teacher, for --teacher-from)
            print(
                f"gate-run: {', '.join(models)} scored in {run_dir}: no teacher and student "
                f"to report (use it with --teacher-from)"
            )
            return 0
        out = work / (f"report_round{number}" if sequential else "report")
        reports.append(_report(run_dir, teacher, models, out, tag))
        print(
            f"{tag}: scored in {time.perf_counter() - start:.0f} s; report {reports[-1]}",
            flush=True,
        )
        if baseline == "none":
            continue
        args = _gate_args(reports, baseline, seed, rounds, gate, accept_blind)
        code = cli_main(args)
        if code != UNDECIDED_EXIT or not sequential:
            verdict = {0: "pass", 1: "FAIL", BLIND_EXIT: "BLIND"}.get(
                code, f"exit {code}"
            )
            print(
                f"gate-run: {'stopped after' if sequential else 'gated'} {tag}: "
                f"{verdict} ({time.perf_counter() - start:.0f} s)"
            )
            return code
    if sequential and baseline != "none":
        # Undecided after the last round means items left: the baseline holds items this
        # config's sample never reaches, so no round could decide.
        raise Edge0Error(
            f"the gate was still undecided after the last round ({len(rounds)}): "
            f"{baseline} holds items this config's sample never reaches; make the "
            f"baseline with this gate config (`gate-run CONFIG --baseline none`)"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.config.is_file():
        raise ConfigError(f"{args.config}: config not found")
    return gate_run(
        args.config,
        args.baseline,
        args.work_dir,
        {},
        args.sequential,
        args.teacher_from,
        args.order_seed,
        args.accept_blind,
    )
