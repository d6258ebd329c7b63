"""Prerouted decode: prediction-as-routing with staged reads."""

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from perturbed_heads import perturbed_heads

from edge0_eval.engine import experts as experts_module
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.experts import StagedSet
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.routing import Plans, Route
from edge0_eval.engine.store import DEMAND, ExpertStore
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import unpack_bundle

PROMPT = "def add(a, b):\n    return a + b\n# The quick brown fox"


@pytest.fixture(scope="module", params=["qwen", "bailing", "qwen2"])
def model_and_heads(request, tmp_path_factory):
    converted = request.getfixturevalue(f"edge0_{request.param}")
    path, owners = perturbed_heads(converted, tmp_path_factory.mktemp("heads"))
    return converted, path, owners


def test_staged_set_equals_routed_set_every_step(model_and_heads):
    converted, heads_path, owners = model_and_heads
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted", prerouter_path=str(heads_path), slots_per_layer=None
        ),
    )
    consumers = engine.prerouter.consumers
    assert consumers == [o + 1 for o in owners]
    for layer in consumers:
        engine.blocks[layer].capture = True
    prompt = engine.tokenizer.encode(PROMPT)
    sequence = engine.sequence()
    logits = sequence.prefill(prompt)
    token = int(mx.argmax(logits).item())
    checked = 0
    for step in range(12):
        planned = {
            layer: sorted(staged.experts)
            for layer, (_, staged) in sequence.plans.layers.items()
        }
        logits = sequence.step(token)
        # Planned from the prompt's last token at step 0, from the previous step after that.
        assert set(planned) == set(consumers)
        for layer in consumers:
            executed = sorted(
                np.array(engine.blocks[layer].last[1]).reshape(-1).tolist()
            )
            assert executed == planned[layer]
            checked += 1
        token = int(mx.argmax(logits).item())
    stats = engine.stats()
    engine.close()
    assert checked == 12 * len(consumers)
    assert stats["dropped_experts"] == 0
    assert stats["prerouted_steps"] == 12
    assert stats["staged_experts"] == 13 * len(consumers) * engine.experts_per_token


def test_prerouted_blocks_on_fewer_loads_than_reactive(model_and_heads):
    converted, heads_path, _ = model_and_heads
    results = {}
    for mode in ("reactive", "prerouted"):
        engine = Engine.load(
            converted, EngineOptions(mode=mode, prerouter_path=str(heads_path))
        )
        k = engine.experts_per_token
        engine.close()
        engine = Engine.load(
            converted,
            EngineOptions(mode=mode, prerouter_path=str(heads_path), slots_per_layer=k),
        )
        engine.store.evict_page_cache()
        result = engine.generate(
            engine.tokenizer.encode(PROMPT), max_tokens=16, stop_token_ids=set()
        )
        results[mode] = result.stats
        engine.close()
    rea, pre = results["reactive"], results["prerouted"]
    assert pre["dropped_experts"] == 0
    # Both modes read about one bundle per routed expert (slots == K: almost no reuse) ...
    assert pre["bytes_per_token"] == pytest.approx(rea["bytes_per_token"], rel=0.5)
    # ... but prerouted blocks only on the layers before start_layer.
    assert pre["blocked_loads_per_step"] < rea["blocked_loads_per_step"]
    assert pre["staged_loads_per_step"] > 0


def test_no_prerouter_routes_like_reactive(model_and_heads):
    converted, heads_path, _ = model_and_heads
    outs = []
    for options in (
        EngineOptions(mode="reactive"),
        EngineOptions(mode="prerouted", no_prerouter=True),
    ):
        engine = Engine.load(converted, options)
        outs.append(
            engine.generate(engine.tokenizer.encode(PROMPT), max_tokens=8).tokens
        )
        engine.close()
    assert outs[0] == outs[1]


def test_online_recall(model_and_heads):
    converted, heads_path, _ = model_and_heads
    engine = Engine.load(
        converted,
        EngineOptions(
            mode="prerouted", prerouter_path=str(heads_path), measure_recall=True
        ),
    )
    result = engine.generate(
        engine.tokenizer.encode(PROMPT), max_tokens=8, stop_token_ids=set()
    )
    engine.close()
    assert 0.0 <= result.stats["online_recall"] <= 1.0


def test_missing_heads_fail_before_loading(edge0_qwen, tmp_path):
    with pytest.raises(CheckpointError, match="prerouter"):
        Engine.load(
            edge0_qwen,
            EngineOptions(
                mode="prerouted", prerouter_path=str(tmp_path / "nope.safetensors")
            ),
        )
    with pytest.raises(CheckpointError, match="prerouted mode needs prerouter heads"):
        Engine.load(edge0_qwen, EngineOptions(mode="prerouted"))


def test_first_decode_plan_does_not_depend_on_prefill_chunking(model_and_heads):
    """The first step's plan uses the prompt's last two tokens; a chunk size that would leave
    the last token alone must not lose the t-1 features."""
    converted, heads_path, _ = model_and_heads
    plans = []
    for chunk in (512, None):
        engine = Engine.load(
            converted, EngineOptions(mode="prerouted", prerouter_path=str(heads_path))
        )
        prompt = engine.tokenizer.encode(PROMPT)
        engine.options.prefill_chunk = chunk or len(prompt) - 1
        _, planned = engine.step.prefill(prompt, engine.step.new_cache())
        plans.append(
            {
                layer: np.array(inds).tolist()
                for layer, (inds, _) in planned.layers.items()
            }
        )
        engine.close()
    assert plans[0] and plans[0] == plans[1]


def test_planned_weights_are_the_routers_and_match_true_routing(model_and_heads):
    """A planned set is weighted by the layer's own router: a layer whose plan is its true set
    computes exactly what true routing does."""
    converted, heads_path, owners = model_and_heads
    # The block level, where a plan is installed (a reactive engine loads what a plan names;
    # a prerouted one trusts its staging to have done so).
    engine = Engine.load(converted, EngineOptions(mode="reactive"))
    try:
        block = engine.blocks[owners[0] + 1]
        x = mx.random.normal(
            (1, 3, engine.family.hidden_size(engine.config)), key=mx.random.key(3)
        )
        want = block(x)
        block.route = Route(block.select(x)[0])  # router weights at the true set
        assert mx.array_equal(block(x), want).item()
        block.route = None
    finally:
        engine.close()


def test_store_serves_queued_prefetches_in_layer_order(edge0_qwen):
    """A prefetch for an earlier layer, queued last, is read before queued later layers'
    (a draft hedge's sets queued before the routed sets' misses; a wrap head's first MoE layer),
    and DEMAND before all."""
    store = ExpertStore(edge0_qwen, io_workers=1)
    try:
        layers = list(store.index.moe_layers)
        assert len(layers) >= 3
        gate, order = threading.Event(), []

        def then(layer, fn):
            """A sink: the bundle into a scratch buffer, then fn on the I/O thread."""
            stride = store.index.layout(layer).bundle_stride
            return lambda m: ([[np.empty(stride, np.uint8)]] * m, fn)

        def note(layer, tag):
            return then(layer, lambda: order.append(tag))

        hold = store.submit(
            layers[0], 0, DEMAND, sink=then(layers[0], lambda: gate.wait(10))
        )
        futures = [
            store.submit(layers[2], 1, sink=note(layers[2], 2)),
            store.submit(layers[1], 1, sink=note(layers[1], 1)),
            store.submit(layers[0], 1, sink=note(layers[0], 0)),
            store.submit(layers[2], 2, DEMAND, sink=note(layers[2], "demand")),
        ]
        gate.set()
        for f in [hold] + futures:
            f.result(timeout=10)
        assert order == ["demand", 0, 1, 2]
    finally:
        store.close()


def test_a_staged_set_never_finished_is_dropped_when_its_layer_is_used_again(
    edge0_qwen,
):
    """A plan left in flight (a sequence's last step, a batch's end) reserved slots whose
    bundles were never written; the next use of the layer drops it first, so those experts
    are read for real instead of being trusted as hits."""
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="reactive", no_lora=True, slots_per_layer=4)
    )
    try:
        switch = engine.blocks[engine.moe_layers[0]].switch_mlp
        staged = switch.stage_begin([0, 1, 2, 3])  # never finished
        assert switch.load_experts([2, 3]) == 2  # read again, not trusted as hits
        assert all(f.done() for f, _ in staged.reads)
        assert sorted(switch.slots.resident_experts) == [2, 3]
        for e in (2, 3):
            want = unpack_bundle(
                switch._io.layout, engine.store.read(switch._io.layer, e)
            )
            slot = switch.slots.slot_of(e)
            assert mx.array_equal(
                switch.glu.gate_proj["weight"][slot], mx.array(want["gate_proj.weight"])
            ).item(), e
    finally:
        engine.close()


def _slots_hold(engine, switch, experts) -> None:
    """Each of `experts` sits in its slot whole: every tensor of its own bundle."""
    for e in experts:
        want = unpack_bundle(switch._io.layout, engine.store.read(switch._io.layer, e))
        slot = switch.slots.slot_of(e)
        for name, value in want.items():
            proj, part = name.split(".")
            got = getattr(switch.glu, proj)[part][slot]
            assert mx.array_equal(got, mx.array(value).astype(got.dtype)).item(), (
                e,
                name,
            )


def test_staged_bundles_land_intact_though_an_io_thread_reuses_its_buffer(edge0_qwen):
    """One I/O thread reads every bundle of a staged set into the same buffer: each slot must
    hold its own expert's tensors (copied out on the I/O thread), not the last bundle read."""
    engine = Engine.load(
        edge0_qwen,
        EngineOptions(mode="reactive", no_lora=True, slots_per_layer=8, io_workers=1),
    )
    try:
        switch = engine.blocks[engine.moe_layers[0]].switch_mlp
        experts = [5, 0, 3, 7, 1, 6]
        switch.stage_finish(switch.stage_begin(experts))
        _slots_hold(engine, switch, experts)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "io_workers, run_bundles, tasks",
    [
        (1, experts_module.RUN_BUNDLES, [4]),
        (2, experts_module.RUN_BUNDLES, [2, 2]),
        (1, 2, [2, 2]),
    ],
)
def test_a_run_of_slots_is_read_by_one_task_and_a_hedge_keeps_rows_of_it(
    edge0_qwen, monkeypatch, io_workers, run_bundles, tasks
):
    """A staged set's misses bound for consecutive slots are read by one task (at most an even
    share of the I/O threads' work, and RUN_BUNDLES) and written with one update per tensor;
    when a later set takes some of a task's slots, the task's other rows still land in theirs."""
    monkeypatch.setattr(experts_module, "RUN_BUNDLES", run_bundles)
    engine = Engine.load(
        edge0_qwen,
        EngineOptions(
            mode="reactive", no_lora=True, slots_per_layer=4, io_workers=io_workers
        ),
    )
    queued, submit_many = [], engine.store.submit_many

    def spy(layer, experts, priority=None, sink=None, chunks=None):
        queued.append(list(chunks or [1] * len(experts)))
        return submit_many(layer, experts, priority, sink, chunks)

    monkeypatch.setattr(engine.store, "submit_many", spy)
    try:
        switch = engine.blocks[engine.moe_layers[0]].switch_mlp
        first = switch.stage_begin([6, 0, 3, 5])  # four free slots: one run
        assert queued == [tasks]
        # Experts 0 and 3 stay; 6's and 5's slots go to 1 and 2, so each task of `first`
        # is written in part (rows 1-2 of one task, or row 1 of one and row 0 of the other).
        later = switch.stage_begin([0, 3, 1, 2], hedge=first)
        assert (later.hedge.hits, later.hedge.cancelled, later.hedge.wasted) == (
            2,
            0,
            2,
        )
        assert sum(len(rows) for _, rows in later.reads) == 4
        waited, dropped = switch.stage_finish(later)
        assert dropped == 0
        assert sorted(switch.slots.resident_experts) == [0, 1, 2, 3]
        _slots_hold(engine, switch, [0, 3, 1, 2])
    finally:
        engine.close()


class _Task:
    def __init__(self, done: bool):
        self._done = done

    def done(self) -> bool:
        return self._done


def _plans(done: dict) -> Plans:
    """Plans over layers `done` ({layer: None (not staged) or whether its reads are done})."""
    return Plans(
        layers={
            n: (None, None if d is None else StagedSet(reads=[(_Task(d), [])]))
            for n, d in done.items()
        }
    )


def test_a_layer_starts_the_compute_only_where_reads_are_in_flight():
    """The step's first staged layer after layer 0 starts the earlier layers' compute; a
    later one does only while reads of it or of a layer after it are still in flight."""
    assert _plans({1: True, 2: True, 3: True}).overlap(1)  # the first: always
    landed = _plans({1: True, 2: True, 3: True})
    assert not landed.overlap(2) and not landed.overlap(3)
    tail = _plans({1: True, 2: True, 3: None, 4: False})
    assert tail.overlap(2) and tail.overlap(4)
    early = _plans({1: None, 2: True, 3: False, 4: True})
    assert early.overlap(2)  # layer 1 is not staged: 2 is the first
    assert early.overlap(3) and not early.overlap(4)
    wrap = _plans({0: True, 1: True, 2: True})  # a wrap head's layer 0 starts nothing
    assert wrap.overlap(1) and not wrap.overlap(2)


def test_early_evaluations_follow_the_reads(model_and_heads):
    """Decode with every staged read landed before its step: one early evaluation a step,
    at its first staged layer. With one I/O thread and slow reads, a later layer finds its
    reads in flight and starts the compute too."""
    converted, heads_path, _ = model_and_heads
    probe = Engine.load(converted, EngineOptions(mode="reactive", no_lora=True))
    k = probe.experts_per_token  # K slots: a step's set is mostly read
    probe.close()
    counts = {}
    for case in ("landed", "slow"):
        engine = Engine.load(
            converted,
            EngineOptions(
                mode="prerouted",
                prerouter_path=str(heads_path),
                slots_per_layer=k,
                io_workers=1 if case == "slow" else 4,
            ),
        )
        if case == "slow":
            read = engine.store.read_into

            def slow_read(*args, **kwargs):
                time.sleep(0.02)
                return read(*args, **kwargs)

            engine.store.read_into = slow_read
        try:
            sequence = engine.sequence()
            token = int(mx.argmax(sequence.prefill(engine.tokenizer.encode(PROMPT))))
            before = engine.counters.early_evals
            for _ in range(4):
                if case == "landed":  # every staged read lands before the step
                    for _, staged in sequence.plans.layers.values():
                        for task, _ in staged.reads:
                            task.result(timeout=10)
                token = int(mx.argmax(sequence.step(token)))
            counts[case] = engine.counters.early_evals - before
        finally:
            engine.close()
    assert len(engine.prerouter.consumers) >= 2, counts
    assert counts["landed"] == 4, counts
    assert counts["slow"] > 4, counts
