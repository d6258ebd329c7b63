"""The engine's counters: `Counters`, everything an engine counts, shared by its switches,
prerouter and step. Plain fields, written in place: a decode step calls nothing here. What an
answer's stats carry is built from them by the engine (engine.py: `Figures`) and the batch
(batch.py: `snapshot`, the rows' figures).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """Everything an engine counts, shared by its switches, prerouter and step; a phase's
    figures are the difference of two snapshots (batch.py: `snapshot`)."""

    blocked_seconds: float = 0.0  # the decode path waiting for demand reads
    blocked_loads: int = 0
    demand_read_seconds: float = 0.0
    demand_read_bytes: int = 0
    union_experts: int = 0  # distinct experts per reactive layer call (rows' union)
    union_calls: int = 0
    steps: int = 0  # step calls (DecodeStep), and their time split:
    # Python building the graph, blocking reads and stage waits
    build_seconds: float = 0.0
    eval_seconds: float = 0.0  # compute left at the end
    guard_events: int = 0  # hidden values clipped or NaN zeroed
    nonfinite_events: int = 0
    prerouted_steps: int = 0  # steps that executed staged plans
    staged_experts: int = 0  # per consuming layer per step, the union of the rows' sets
    staged_layers: int = 0  # (step, consuming layer) stagings
    staged_loads: int = 0  # of those experts, bundles read (misses)
    abandoned_plans: int = 0  # batched decode: layer plans dropped as rows left/joined
    dropped_experts: int = 0  # planned experts absent from the slots at execution: 0
    stage_wait_seconds: float = 0.0
    # Staged layers whose wait first started the earlier layers' compute (Plans.overlap).
    early_evals: int = 0
    # The heads' (and a hedge's) host time: building their graphs and reading the selection,
    # outside evaluation: their inputs are the step's layers, so waiting for the selection
    # is waiting for the step's compute (counted in eval_wait_seconds).
    head_host_seconds: float = 0.0
    hedge_host_seconds: float = 0.0
    hedge_staged: int = 0  # experts the hedge staged (per hedged layer per step)
    hedge_hits: int = 0  # of those, in the routed set
    hedge_cancelled: int = 0  # misses whose reads never started
    hedge_wasted: int = 0  # misses read anyway (bundles read in vain)
    draft_rows: int = 0  # draft hedge: rows whose token was drafted
    draft_matches: int = 0  # of those, served the drafted token
    wrap_chunks: int = 0  # chunks run to a fixed point under a wrap-around head
    wrap_passes: int = 0  # and the passes they took
    # The stepping thread blocked in MLX evaluation (eval, async_eval's back-pressure, item):
    # with the read waits (demand reads, stage waits) what a decode step's wall time less
    # its host work is. Host figures are counted per decode step by the batch decoder:
    # host, its wall time outside evaluation and read waits; host_cpu, the thread's CPU
    # time outside evaluation.
    eval_wait_seconds: float = 0.0
    eval_wait_cpu_seconds: float = 0.0  # the thread's CPU time inside those calls
    host_seconds: float = 0.0
    host_cpu_seconds: float = 0.0
