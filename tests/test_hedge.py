"""Hedged staging: context heads stage sets for next-token heads' layers before the token
exists; routing stays the next-token heads', so logits never change, and the hedge only moves
reads earlier (and wastes those of its misses that had already run)."""

from __future__ import annotations

import re
import shutil
import time

import mlx.core as mx
import pytest

from decode_parity import assert_batch_rows_equal_solo

from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads_file import save_heads
from edge0_eval.engine.options import HEDGE_FILE, EngineOptions, MissingAdapterError
from edge0_eval.engine.prerouter import default_owners, init_heads_from_routers
from edge0_eval.errors import CheckpointError, ConfigError

from test_mixed_heads import mixed_heads
from test_next_token_heads import next_token_heads

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"


def context_heads(converted, path, start_layer=0, key: int | None = 3, owners=None):
    """Untrained context heads (= the next routers); `key`: a random fc2, so their sets differ
    from any other heads' (None keeps the routers' sets)."""
    engine = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    try:
        if owners is None:
            owners = default_owners(start_layer, len(engine.family.layers(engine.model)),
                                    engine.moe_layers)
        heads = init_heads_from_routers(engine, owners, width=32, seed=0)
        if key is not None:
            heads.fc2 = mx.random.normal(heads.fc2.shape, key=mx.random.key(key)) * 0.5
        return save_heads(path, heads)
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["qwen", "bailing"])
def hedged(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    tmp = tmp_path_factory.mktemp("hedge")
    heads, moe = next_token_heads(converted, tmp / "nt.safetensors")
    hedge = context_heads(converted, tmp / "hedge.safetensors")
    return converted, heads, hedge, moe


def _engine(converted, heads, hedge=None, **options):
    extra = {"hedge_path": str(hedge)} if hedge is not None else {"no_hedge": True}
    return Engine.load(converted, EngineOptions(mode="prerouted", prerouter_path=str(heads),
                                                no_lora=True, **extra, **options))


def _decode_logits(engine, steps: int = 10) -> tuple[list[mx.array], int]:
    """Greedy prefill + decode: every step's logits (the token fed back is the argmax), and
    the loads the decode steps blocked on."""
    engine.reset()
    logits = engine.prefill(engine.tokenizer.encode(PROMPT))
    out, blocked = [logits], engine.counters.blocked_loads
    for _ in range(steps):
        logits = engine.step(int(mx.argmax(logits).item()))
        out.append(logits)
    return out, engine.counters.blocked_loads - blocked


@pytest.mark.parametrize("slots", [None, "top_k"])
def test_hedge_changes_no_logit(hedged, slots):
    """With a hedge that often misses, every logit equals the unhedged engine's bit for bit,
    no planned expert is ever missing, and nothing is read on demand. At one slot per routed
    expert the routed set must take the hedge's slots back (a hedge bundle written into a
    slot that went to another expert would change the logits)."""
    converted, heads, hedge, moe = hedged
    plain = _engine(converted, heads)
    k = plain.top_k
    options = {} if slots is None else {"slots_per_layer": k}
    engine = _engine(converted, heads, hedge, **options)
    try:
        want, _ = _decode_logits(plain)
        got, blocked = _decode_logits(engine)
        for step, (a, b) in enumerate(zip(want, got)):
            assert mx.array_equal(a, b).item(), step
        stats = engine.stats()
        assert stats["dropped_experts"] == 0 and blocked == 0
        assert stats["hedge_layers"] == sorted(engine.prerouter.consumers)
        assert 0 < stats["hedge_precision"] < 1               # the hedge is really imprecise
        c = engine.prerouter.counters
        assert c.hedge_staged == len(moe) * k * 10            # one hedge consumed per step
        assert c.hedge_cancelled + c.hedge_wasted <= c.hedge_staged - c.hedge_hits
    finally:
        engine.close()
        plain.close()


@pytest.mark.parametrize("scale", [None, "4"])
def test_hedge_of_untrained_heads_from_init_prerouter(edge0_qwen, tmp_path, scale):
    """`init-prerouter` heads: untrained next-token heads ignore the token (zero embedding
    columns), so untrained context heads hedge them exactly: every bundle is queued before the
    token is known, none after, none in vain. `--embedding-scale` makes the next-token heads
    route by the token too: then the hedge misses, and the misses are read after the token."""
    from edge0_eval import cli
    from edge0_eval.engine.store import ExpertStore

    nt, hedge = tmp_path / "nt.safetensors", tmp_path / "hedge.safetensors"
    extra = ["--embedding-scale", scale] if scale else []
    for out, flags in ((nt, ["--next-token", *extra]), (hedge, [])):
        assert cli.main(["init-prerouter", str(edge0_qwen), "--start-layer", "0", "--width", "8",
                         *flags, "--out", str(out)]) == 0
    engine = _engine(edge0_qwen, nt, hedge, slots_per_layer=4)   # K slots: most plans read
    phase = {"now": "prefill", "reads": {"prefill": 0, "before": 0, "after": 0}}
    submit = ExpertStore.submit

    def counting(self, *args, **kwargs):
        phase["reads"][phase["now"]] += 1
        return submit(self, *args, **kwargs)

    pr = engine.prerouter
    plan_tokens = pr.plan_tokens

    def plan_then_mark(tokens):
        phase["now"] = "after"        # reads queued once the token is known
        plan_tokens(tokens)
        phase["now"] = "before"       # the step's layers, then its hedge

    try:
        ExpertStore.submit = counting
        pr.plan_tokens = plan_then_mark
        logits = engine.prefill(engine.tokenizer.encode(PROMPT))
        phase["now"] = "before"
        for _ in range(8):
            logits = engine.step(int(mx.argmax(logits).item()))
        stats = engine.stats()
    finally:
        ExpertStore.submit = submit
        engine.close()
    assert stats["dropped_experts"] == 0 and phase["reads"]["before"] > 0
    if scale is None:
        assert stats["hedge_precision"] == 1.0 and stats["hedge_wasted_loads_per_step"] == 0
        assert phase["reads"]["after"] == 0
    else:
        assert stats["hedge_precision"] < 0.9 and phase["reads"]["after"] > 0


def test_hedged_batch_rows_equal_solo(hedged):
    converted, heads, hedge, _ = hedged
    assert_batch_rows_equal_solo(converted, heads, hedge_path=str(hedge))


def test_hedge_file_found_beside_the_model_and_turned_off(edge0_qwen, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(edge0_qwen, model)
    heads, _ = next_token_heads(model, model / "prerouter.safetensors")
    context_heads(model, model / HEDGE_FILE)
    resolved = EngineOptions(mode="prerouted", no_lora=True).resolve(model)
    assert resolved.hedge_path == model / HEDGE_FILE
    assert EngineOptions(mode="prerouted", no_hedge=True).resolve(model).hedge_path is None
    assert EngineOptions(mode="reactive").resolve(model).hedge_path is None
    with pytest.raises(MissingAdapterError, match=r"nope.safetensors.*--no-hedge"):
        EngineOptions(mode="prerouted", hedge_path=str(tmp_path / "nope.safetensors")
                      ).resolve(model)
    with pytest.raises(ConfigError, match="hedge_layers 2 without hedge heads"):
        EngineOptions(mode="prerouted", no_hedge=True, hedge_layers=2).resolve(model)
    # another arm of the same command line (bench: reactive, compute-only) ignores it
    assert EngineOptions(mode="reactive", hedge_layers=2).resolve(model).hedge_path is None
    engine = Engine.load(model, EngineOptions(mode="prerouted", no_lora=True, hedge_layers=1))
    try:
        assert engine.prerouter.hedge.consumers == [engine.moe_layers[0]]   # the first in step order
    finally:
        engine.close()


def test_bad_hedges_are_refused_naming_the_file(edge0_qwen, tmp_path):
    nt, moe = next_token_heads(edge0_qwen, tmp_path / "nt.safetensors")
    ctx = context_heads(edge0_qwen, tmp_path / "ctx.safetensors")
    some = context_heads(edge0_qwen, tmp_path / "some.safetensors", owners=moe[:2])
    mixed, _, context = mixed_heads(edge0_qwen, tmp_path / "mixed.safetensors", context_layers=1)
    cases = [
        (nt, nt, {}, r"nt.safetensors: hedge heads must be context heads"),
        (ctx, ctx, {}, r"ctx.safetensors: a hedge serves next-token prerouter heads"),
        (mixed, ctx, {}, rf"ctx.safetensors: hedge heads for layer\(s\) {re.escape(str(context))}"),
        (nt, some, {"hedge_layers": 3}, r"some.safetensors: hedge_layers 3: the hedge has 2"),
    ]
    for heads, hedge, options, pattern in cases:
        with pytest.raises(CheckpointError, match=pattern):
            _engine(edge0_qwen, heads, hedge, **options)
    engine = _engine(edge0_qwen, nt, some, hedge_layers=1)      # a subset is fine
    try:
        assert engine.prerouter.hedge.consumers == [moe[1]]
    finally:
        engine.close()


def test_cli_flags_reach_the_options():
    import argparse

    from edge0_eval.cli_options import add_engine_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    opts = options_from_args(parser.parse_args(["--hedge", "h.safetensors", "--hedge-layers",
                                                "3"]))
    assert (opts.hedge_path, opts.hedge_layers, opts.no_hedge) == ("h.safetensors", 3, False)
    assert options_from_args(parser.parse_args(["--no-hedge"])).no_hedge


@pytest.mark.parametrize("slots", [4, 8])
def test_routed_set_takes_over_a_hedge_in_flight(edge0_qwen, slots):
    """Storage slowed so that the hedge's reads are still queued when the routed set arrives:
    queued reads of its misses are cancelled and their slots freed, a slot the routed set
    needs is taken back, and afterwards every resident expert's slot holds its own bundle
    (no slot is written twice, nothing unwritten is trusted)."""
    from edge0_eval.engine.layout import unpack_bundle

    index_stride = Engine.load(edge0_qwen, EngineOptions(mode="reactive", no_lora=True))
    stride = index_stride.index.bundle_stride
    index_stride.close()
    engine = Engine.load(edge0_qwen, EngineOptions(
        mode="reactive", no_lora=True, slots_per_layer=slots, io_workers=1,
        io_throttle_mbps=stride / 0.05 / 1e6))          # 50 ms a bundle, one at a time
    try:
        switch = engine.blocks[engine.moe_layers[1]].switch_mlp
        hedge = switch.stage_begin([1, 0, 2, 3])
        while not (hedge.futures[0].running() or hedge.futures[0].done()):
            time.sleep(0.001)               # expert 1's read has started: it cannot be cancelled
        routed = switch.stage_begin([0, 4, 5, 6], hedge=hedge)
        outcome = routed.hedge
        assert (outcome.staged, outcome.hits, outcome.cancelled) == (4, 1, 2)
        # expert 1 was read in vain; 4 slots: the routed set needs its slot, so its bundle is
        # never written; 8: it lands beside the routed set
        assert outcome.wasted == 1
        assert (1 in switch.slots.resident_experts) == (slots == 8)
        slots_written = [slot for _, slot in routed.loads]
        assert len(slots_written) == len(set(slots_written))
        assert all(switch.slots.slot_of(e) == slot for e, slot in routed.loads)
        waited, dropped = switch.stage_finish(routed)
        assert dropped == 0
        glu = switch.glu
        for e in switch.slots.resident_experts:
            want = unpack_bundle(switch._io.index, engine.store.read(switch._io.layer, e))
            slot = switch.slots.slot_of(e)
            assert mx.array_equal(glu.gate_proj["weight"][slot],
                                  mx.array(want["gate_proj.weight"])).item(), (e, slot)
        assert set(routed.experts) <= set(switch.slots.resident_experts)
    finally:
        engine.close()


def test_preflight_stops_a_truncated_hedge(edge0_qwen, tmp_path):
    from model_wrappers.partitioner import model_problems

    model = tmp_path / "model"
    shutil.copytree(edge0_qwen, model)
    next_token_heads(model, model / "prerouter.safetensors")
    hedge = context_heads(model, model / HEDGE_FILE)
    arm = {"abbr": "s", "path": str(model), "type": "Edge0Model", "mode": "prerouted",
           "no_lora": True}
    assert model_problems([arm]) == []
    hedge.write_bytes(hedge.read_bytes()[:100])
    problems = model_problems([arm])
    assert len(problems) == 1 and HEDGE_FILE in problems[0] and "hedge" in problems[0]
    assert model_problems([arm | {"no_hedge": True}]) == []
