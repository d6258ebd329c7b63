"""Edge0Partitioner for a gate config: its seeded benchmark sample, whole or in rounds.

A gate config samples each benchmark with an int `reader_cfg.test_range` (OpenCompass's seeded
draw). Round 0 runs that sample in one pass, as plain OpenCompass would. Round r > 0 (a
sequential gate run, `edge0-eval gate-run --sequential`, which sets EDGE0_GATE_ROUND) infers
only the items round r adds, as a chunk file, and evaluates the whole prefix so far
(edge0_eval/evaluation/gate/rounds.py says how, and why no partial file is ever scored as whole).
The config is parsed in mmengine's lazy-import mode, where project code cannot run, so the
draw is computed here, in the launching process, before any task starts.
"""

from __future__ import annotations

import copy
from pathlib import Path

from opencompass.registry import PARTITIONERS

from edge0_eval.errors import Edge0Error
from edge0_eval.evaluation.gate.rounds import check_rounds, round_datasets

from .partitioner import Edge0Partitioner


@PARTITIONERS.register_module()
class Edge0RoundPartitioner(Edge0Partitioner):
    """Args (besides Edge0Partitioner's):
    rounds: cumulative shares of each sampled dataset at the end of each round, ending at
        1.0 (e.g. [0.125, 0.25, 0.5, 1.0]).
    round: the round to run, 1-based; 0 runs the whole sample in one pass.
    stage: 'infer' or 'eval' (which of OpenCompass's stages this partitioner serves).
    seed: the gate run's order seed (EDGE0_GATE_SEED; rounds.run_order): the order the
        rounds take the sample in; "" the draw's own.
    """

    def __init__(
        self,
        out_dir: str,
        rounds=(1.0,),
        round: int = 0,
        stage: str = "infer",
        seed: str = "",
        **kwargs,
    ):
        super().__init__(out_dir=out_dir, **kwargs)
        try:
            self.rounds = check_rounds(rounds)
        except Edge0Error as exc:
            raise SystemExit(f"edge0-eval: {exc}") from None
        if stage not in ("infer", "eval"):
            raise SystemExit(
                f"edge0-eval: partitioner stage {stage!r} is not 'infer' or 'eval'"
            )
        if (
            isinstance(round, bool)
            or not isinstance(round, int)
            or not 0 <= round <= len(self.rounds)
        ):
            raise SystemExit(
                f"edge0-eval: gate round {round!r}: give 0 (the whole sample) or "
                f"1..{len(self.rounds)} (EDGE0_GATE_ROUND)"
            )
        if not isinstance(seed, str) or not all(c.isalnum() for c in seed):
            raise SystemExit(
                f"edge0-eval: gate order seed {seed!r} must be letters and digits "
                f"(EDGE0_GATE_SEED)"
            )
        self.round, self.stage, self.seed = round, stage, seed

    def __call__(self, cfg):
        if self.round:
            cfg = copy.deepcopy(cfg)
            try:
                cfg["datasets"] = round_datasets(
                    list(cfg["datasets"]),
                    self.rounds,
                    self.round,
                    self.stage,
                    Path(cfg["work_dir"]) / "predictions",
                    self.seed,
                )
            except Edge0Error as exc:
                raise SystemExit(f"edge0-eval: {exc}") from None
        return super().__call__(cfg)
