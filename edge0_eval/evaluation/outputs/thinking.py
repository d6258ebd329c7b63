"""Thinking blocks in a model's output, and the rule for scoring an output whose block never
closed.

A thinking model writes `<think> ... </think>` before its answer. A thinking chat template
(Qwen3.5/3.6 with enable_thinking) opens the block in the prompt; the inferencer
(model_wrappers/inferencers/inferencer.py) then stores that opener at the start of the
prediction, so a prediction is the whole assistant turn and its text alone says whether
thinking closed.

An output cut at the length limit inside its block has no answer. OpenCompass's
`extract_non_reasoning_content` passes such text through whole, so "...the answer: D maybe, but
wait" can score as D. The default rule, "empty", scores it as an empty answer; "pass" restores
OpenCompass's pass-through. The rule is applied by one postprocessor
(model_wrappers.evaluators.benchmark_evaluators.edge0_answer_text) that every dataset of
configs/datasets/ runs first; the report reads which rule each dataset used from the run's
config dump.

The lowest layer of the evaluation package: it imports none of it.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OPEN_THINKING_RULES = ("empty", "pass")
DEFAULT_OPEN_THINKING = "empty"
# The postprocessor's registered name (model_wrappers/evaluators/benchmark_evaluators.py) and its
# option, as the report finds them in a dataset's eval_cfg.
POSTPROCESSOR = "edge0_answer_text"


def thinking_closed(text) -> bool | None:
    """True: the output's thinking closed; False: a block opened and never closed (the text is
    the middle of the reasoning); None: no thinking block (or no text)."""
    if not isinstance(text, str):
        return None
    opened, closed = text.rfind(THINK_OPEN), text.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return None
    return closed > opened


def prompt_opener(chat_text: str) -> str:
    """The thinking block a chat-templated prompt leaves open at its end ("<think>\\n"), which
    the model's turn continues; "" when the prompt ends outside one."""
    at = chat_text.rfind(THINK_OPEN)
    if (
        at < 0
        or THINK_CLOSE in chat_text[at:]
        or chat_text[at + len(THINK_OPEN) :].strip()
    ):
        return ""
    return chat_text[at:]


def check_rule(rule: str) -> str:
    if rule not in OPEN_THINKING_RULES:
        raise ValueError(
            f"open_thinking {rule!r} is not one of {', '.join(OPEN_THINKING_RULES)}"
            f" (EDGE0_OPEN_THINKING in configs/datasets/)"
        )
    return rule


def rule_of(eval_cfg) -> str:
    """The open-thinking rule a dataset's eval_cfg (from the config dump) scored with: the
    postprocessor's option, its default, or "pass" without the postprocessor (OpenCompass's
    own behaviour)."""
    post = eval_cfg.get("pred_postprocessor") if isinstance(eval_cfg, dict) else None
    kind = str(post.get("type", "")) if isinstance(post, dict) else ""
    if kind.rsplit(".", 1)[-1] != POSTPROCESSOR:
        return "pass"
    return str(post.get("open_thinking") or DEFAULT_OPEN_THINKING)
