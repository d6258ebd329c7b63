"""The tier configs' arms and gate rounds, from the environment.

configs/tiers/edge0_tier.py (what the 35B and 8B tiers share) and edge0_gate_tier.py (what
their gate configs change) hold the data: the arms, sampling settings, batch sizes and
generation settings. These functions read the variables below and put that data together:

  EDGE0_ARMS             the arms to run, comma-separated (default teacher,student)
  EDGE0_SAMPLING         the sampling setting, one the tier has (default opencompass)
  EDGE0_<TIER>_<ROLE>    the model directory each role's arms read (TEACHER, STUDENT)
  EDGE0_<TIER>_<ARM>     a served arm's server URL(s), comma-separated (TEACHER_API,
                         STUDENT_API)
  EDGE0_GATE_ROUND       the round of a sequential gate run (0 or unset: the whole sample)
  EDGE0_GATE_SEED        the order seed of a sequential gate run's rounds

A missing or bad variable is one ConfigError naming it and the fix. A config stops on it
through `for_config`, with the one line OpenCompass prints without a traceback; project code
that reads a config (run_config.load_config) names the config beside it.

mmengine parses the configs in lazy-import mode, where an imported name is a placeholder that
cannot be called, so the configs reach this module through importlib.
"""

from __future__ import annotations

from typing import Callable, Mapping

from edge0_eval.errors import ConfigError

Environ = Mapping[str, str]

DEFAULT_ARMS = "teacher,student"
DEFAULT_SAMPLING = "opencompass"


def for_config(build: Callable, *args):
    """build(*args) as a config runs it: a ConfigError stops the config with SystemExit
    ("edge0-eval: <the error>"), which OpenCompass prints as that one line."""
    try:
        return build(*args)
    except ConfigError as exc:
        raise SystemExit(f"edge0-eval: {exc}") from None


def selected_arms(environ: Environ) -> list[str]:
    """EDGE0_ARMS as a list of arm names, in its order."""
    return environ.get("EDGE0_ARMS", DEFAULT_ARMS).split(",")


def tier_datasets(
    environ: Environ, datasets: list, fidelity_datasets: list, api_arms: Mapping
) -> list:
    """The benchmarks, then teacher-forced fidelity unless a served arm runs (fidelity needs
    the model in the process)."""
    served = set(selected_arms(environ)) & set(api_arms)
    return datasets + ([] if served else fidelity_datasets)


def _check_arms(arms: list[str], roles_of: Mapping[str, str]) -> None:
    unknown = sorted(set(arms) - set(roles_of))
    if unknown:
        raise ConfigError(
            f"EDGE0_ARMS has unknown arms {unknown}; choose from {', '.join(roles_of)}"
        )


def _sampling(environ: Environ, tier: str, settings: Mapping) -> str:
    """EDGE0_SAMPLING, checked against the settings the tier has."""
    name = environ.get("EDGE0_SAMPLING") or DEFAULT_SAMPLING
    if tier not in settings.get(name, {}):
        offered = ", ".join(k for k, v in settings.items() if tier in v)
        raise ConfigError(
            f"EDGE0_SAMPLING={name!r} is not a sampling of the {tier} tier; "
            f"choose from {offered}"
        )
    return name


def _role_paths(
    environ: Environ, tier: str, roles: Mapping, arms: list[str], roles_of: Mapping
) -> dict:
    """Each role's model directory (None when unset), set wherever a selected arm reads it."""
    variables = {role: f"EDGE0_{tier.upper()}_{role.upper()}" for role in roles}
    paths = {role: environ.get(v) for role, v in variables.items()}
    for role, what in roles.items():
        if not paths[role] and any(roles_of[a] == role for a in arms):
            raise ConfigError(f"{variables[role]} is not set: export it to {what}")
    return paths


def _server_urls(
    environ: Environ, tier: str, api_arms: Mapping, arms: list[str]
) -> dict[str, list[str]]:
    """Each served arm's server URLs, set wherever that arm is selected."""
    urls = {
        arm: (environ.get(f"EDGE0_{tier.upper()}_{arm.upper()}") or "").split(",")
        for arm in api_arms
    }
    for arm in api_arms:
        if arm in arms and not urls[arm][0]:
            raise ConfigError(
                f"EDGE0_{tier.upper()}_{arm.upper()} is not set: export it to the "
                f"server URL(s), comma-separated (http://HOST:PORT/v1)"
            )
    return urls


def _local_arm(
    arm: str, tier: str, shared: Mapping, paths: dict, sampling: str
) -> dict:
    """An in-process arm's model config (configs/tiers/edge0_arms.py)."""
    return dict(
        abbr=f"edge0-{tier}-" + arm.replace("_", "-"),
        path=paths[shared["arm_paths"][arm]],
        **shared["arms"][arm],
        **({} if arm == "teacher" else shared["students"][tier]),
        **shared["generation"],
        generation_kwargs=dict(shared["sampling"][sampling][tier], seed=0),
        batch_size=shared["batch"][tier]["teacher" if arm == "teacher" else "student"],
    )


def _served_arm(
    arm: str, tier: str, shared: Mapping, paths: dict, urls: dict, sampling: str
) -> dict:
    """A served arm's model config (configs/tiers/edge0_api.py): batch_size is the role's
    rows per host times its hosts."""
    role = shared["api_paths"][arm]
    return dict(
        abbr=f"edge0-{tier}-" + arm.replace("_", "-"),
        **shared["api_arms"][arm],
        openai_api_base=urls[arm],
        tokenizer_path=paths[role],
        **shared["generation"],
        generation_kwargs=dict(shared["sampling"][sampling][tier], seed=0),
        batch_size=shared["batch"][tier][role] * len(urls[arm]),
    )


def tier_models(
    tier: str, environ: Environ, shared: Mapping, settings: Mapping | None = None
) -> list[dict]:
    """The model configs of the arms EDGE0_ARMS selects on `tier` ("35b", "8b"), in its order.
    shared: configs/tiers/edge0_tier.py's `edge0_tier` (arms, arm_paths, api_arms, api_paths,
    roles, sampling, students, batch, generation). settings: what a gate config sets over
    every arm's (its generation). Checked in this order, the first problem raised: unknown
    arms, the sampling, the model directories, the server URLs."""
    arms = selected_arms(environ)
    roles_of = {**shared["arm_paths"], **shared["api_paths"]}
    _check_arms(arms, roles_of)
    sampling = _sampling(environ, tier, shared["sampling"])
    paths = _role_paths(environ, tier, shared["roles"], arms, roles_of)
    urls = _server_urls(environ, tier, shared["api_arms"], arms)
    models = [
        _local_arm(arm, tier, shared, paths, sampling)
        if arm in shared["arms"]
        else _served_arm(arm, tier, shared, paths, urls, sampling)
        for arm in arms
    ]
    return models if settings is None else [dict(m, **settings) for m in models]


def gate_round(environ: Environ) -> int:
    """EDGE0_GATE_ROUND (set by `gate-run --sequential`): 0 runs the whole sample, r its
    round r."""
    value = environ.get("EDGE0_GATE_ROUND") or "0"
    if not value.isdigit():
        raise ConfigError(f"EDGE0_GATE_ROUND={value!r} is not a round number")
    return int(value)


def gate_seed(environ: Environ) -> str:
    """EDGE0_GATE_SEED (drawn by `gate-run --sequential` before round 1): the order the
    rounds take the sample in ("" outside a sequential run)."""
    return environ.get("EDGE0_GATE_SEED") or ""


def gate_datasets(
    gates: Mapping, sources: list, fidelity_datasets: list
) -> dict[str, list]:
    """Per tier, its gate's sample: each source dataset with a sample size in the gate's
    `samples`, drawn by OpenCompass's reader_cfg.test_range = K, then fidelity whole."""
    return {
        tier: [
            dict(
                d,
                reader_cfg=dict(d["reader_cfg"], test_range=gate["samples"][d["abbr"]]),
            )
            for d in sources
            if gate["samples"].get(d["abbr"])
        ]
        + fidelity_datasets
        for tier, gate in gates.items()
    }
