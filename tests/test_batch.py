"""Batched decode (Engine.generate_batch): every row equals the same prompt run alone.

Tolerance. On the CPU every row's logits are bit-identical to its solo run (measured: max abs
diff 0.0, every family x mode, B = 1, 3, 8): the B = 1 prefill is the solo prefill, and in
decode the matmuls, gather_qmm, recurrent states and the masked attention over left-padded keys
compute each row as alone. Fused attention kernels on Metal/CUDA may reduce the padded, masked
axis in another order, so off the CPU the logits are allowed fp16 rounding (as
test_engine.py's parity). Greedy tokens are compared exactly everywhere.
"""

import json
import re
import time

import mlx.core as mx
import numpy as np
import pytest
from failing_step import FailingStep
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import BatchKVCache
from perturbed_heads import perturbed_heads

from edge0_eval.cli import main
from edge0_eval.engine import batch as batch_module
from edge0_eval.engine import step as step_module
from edge0_eval.engine.batch import StopRule
from edge0_eval.engine.engine import Engine, NonFiniteError
from edge0_eval.engine.experts import LayerSlots, StreamingSwitchGLU
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.store import results as read_results
from edge0_eval.errors import ConfigError
from edge0_eval.formats.layout import ExpertIndex, unpack_bundle

TOL = 0.0 if mx.default_device() == mx.cpu else 2e-2
MAX_TOKENS = 8
TEXTS = [
    "x",
    "The quick brown fox jumps over the lazy dog.",
    "hi there",
    "def add(a, b):\n    return a + b  # a longer prompt than the others, by far",
    "Once upon a time",
    "1 2 3 4 5 6 7",
    "lorem ipsum dolor sit amet",
    "ok",
]


@pytest.fixture(scope="module", params=["qwen", "bailing", "qwen2"])
def family(request, tmp_path_factory):
    """(converted model, prerouter heads file) per family."""
    converted = request.getfixturevalue(f"edge0_{request.param}")
    path, _ = perturbed_heads(converted, tmp_path_factory.mktemp("heads"))
    return converted, path


def _load(family, mode, **options):
    converted, heads = family
    return Engine.load(
        converted,
        EngineOptions(
            mode=mode,
            prerouter_path=str(heads) if mode == "prerouted" else None,
            **options,
        ),
    )


def _solo(engine, prompt, stop):
    """generate's own loop (prefill, step), keeping the logits each token came from."""
    sequence = engine.sequence()
    logits, tokens, trace = sequence.prefill(prompt), [], []
    while True:
        trace.append(logits)
        tokens.append(
            int(mx.argmax(logits - mx.logsumexp(logits, keepdims=True)).item())
        )
        if tokens[-1] in stop or len(tokens) >= MAX_TOKENS:
            return tokens, trace
        logits = sequence.step(tokens[-1])


def _mismatches(solo, results, trace, tol=TOL) -> list[int]:
    """Rows whose tokens differ from their solo run or whose logits differ by more than tol."""
    bad = []
    for i, ((tokens, solo_logits), result, logits) in enumerate(
        zip(solo, results, trace)
    ):
        diff = max(
            (float(mx.abs(a - b).max()) for a, b in zip(solo_logits, logits)),
            default=0.0,
        )
        if result.tokens != tokens or len(logits) != len(solo_logits) or diff > tol:
            bad.append(i)
    return bad


@pytest.mark.parametrize("mode", ["resident", "reactive", "prerouted"])
def test_every_row_equals_its_solo_run(family, mode):
    engine = _load(family, mode)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) >= 6  # different lengths: left padding
    # A stop token from one row's output: some rows finish early, the others run on.
    stop = {_solo(engine, prompts[1], set())[0][2]}
    solo = [_solo(engine, p, stop) for p in prompts]
    lengths = [len(t) for t, _ in solo]
    assert min(lengths) < MAX_TOKENS and max(lengths) == MAX_TOKENS
    assert (
        engine.generate(prompts[3], MAX_TOKENS, stop_token_ids=stop).tokens
        == solo[3][0]
    )
    for b in (1, 3, 8):
        trace = []
        results = engine.generate_batch(
            prompts, MAX_TOKENS, batch_size=b, stop_token_ids=stop, logits_trace=trace
        )
        assert _mismatches(solo, results, trace) == [], f"batch_size={b}"
        s = results[0].stats
        assert s["batch_size"] == b and s["batch_rows"] == len(prompts)
        if b == 3:
            assert s["batch_joined_running"] > 0  # rows joined while others ran
        for r, p in zip(results, prompts):
            assert r.prompt_tokens == len(p) == r.stats["prompt_tokens"]
            assert r.stats["generated_tokens"] == len(r.tokens)
        if mode == "resident":
            assert s["mean_union_per_layer"] is None  # nothing looked up
        elif b == 1:
            assert s["mean_union_per_layer"] == engine.experts_per_token
        else:
            assert (
                engine.experts_per_token
                < s["mean_union_per_layer"]
                <= min(b * engine.experts_per_token, engine.index.num_experts)
            )
    if mode == "prerouted":
        assert engine.stats()["dropped_experts"] == 0
    engine.close()


def test_wrap_around_heads_batch_equals_solo(edge0_qwen, tmp_path):
    """Start layer 0: the last MoE layer's head plans the first MoE layer of the next step,
    so every MoE layer of every batched step is prerouted (its plan is set before layer 0)."""
    path, _ = perturbed_heads(edge0_qwen, tmp_path, start_layer=0, key=2)
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="prerouted", prerouter_path=str(path))
    )
    assert engine.prerouter.consumers[-1] == engine.moe_layers[0]
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:5]]
    stop = {_solo(engine, prompts[1], set())[0][2]}
    solo = [_solo(engine, p, stop) for p in prompts]
    trace = []
    results = engine.generate_batch(
        prompts, MAX_TOKENS, batch_size=3, stop_token_ids=stop, logits_trace=trace
    )
    engine.close()
    assert _mismatches(solo, results, trace) == []
    assert results[0].stats["dropped_experts"] == 0
    assert results[0].stats["mean_union_per_layer"] > engine.experts_per_token


def test_fault_injection_the_equality_check_catches_a_changed_row(family, monkeypatch):
    """The check above can fail: a perturbed KV cache row, and rows swapped, are caught; the
    perturbation changes that row only (rows do not leak into each other)."""
    engine = _load(family, "reactive")
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:4]]
    solo = [_solo(engine, p, set()) for p in prompts]
    trace = []
    results = engine.generate_batch(
        prompts, MAX_TOKENS, stop_token_ids=set(), logits_trace=trace
    )
    assert _mismatches(solo, results, trace) == []
    assert _mismatches(solo[::-1], results, trace) != []  # swapped rows

    merge = batch_module.merge_caches

    def perturbed(caches):
        merged = merge(caches)
        kv = next(c for c in merged if isinstance(c, BatchKVCache))
        kv.keys[2] = kv.keys[2] * 3.0 + 1.0
        return merged

    monkeypatch.setattr(batch_module, "merge_caches", perturbed)
    trace = []
    results = engine.generate_batch(
        prompts, MAX_TOKENS, stop_token_ids=set(), logits_trace=trace
    )
    engine.close()
    assert _mismatches(solo, results, trace) == [2]


def test_prerouted_batch_stages_the_union_and_runs_each_rows_plan(family, monkeypatch):
    engine = _load(family, "prerouted", slots_per_layer=None)
    pr = engine.prerouter
    consumers = pr.consumers
    for layer in consumers:
        engine.blocks[layer].capture = True
    planned, checked = [], []
    plan, after_step = pr.plan, pr.after_step

    def recording_plan(*args, **kwargs):
        plans = plan(*args, **kwargs)
        planned.append(
            {l: (np.array(p[0]), sorted(p[1].experts)) for l, p in plans.layers.items()}
        )
        return plans

    def checking_after_step(*args, stage):
        for layer in (
            consumers if stage else ()
        ):  # a decode step, not a joiner's prefill:
            inds, staged = planned[-1][layer]  # what each row executed vs its own plan
            executed = np.array(engine.blocks[layer].last[1])
            assert (executed == inds).all()
            assert sorted(set(executed.reshape(-1).tolist())) == staged
            checked.append(len(staged))
        return after_step(*args, stage=stage)

    monkeypatch.setattr(pr, "plan", recording_plan)
    monkeypatch.setattr(pr, "after_step", checking_after_step)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:6]]
    before = engine.stats()["dropped_experts"]
    results = engine.generate_batch(
        prompts, MAX_TOKENS, batch_size=4, stop_token_ids=set()
    )
    s = results[0].stats
    after = engine.stats()
    engine.close()
    assert s["dropped_experts"] == before == 0
    # The batch held B x K slots per layer (the B = 1 default is 2K); then the pool went back.
    assert (
        s["slots_per_layer"]
        == min(4 * engine.experts_per_token, engine.index.num_experts)
        > after["slots_per_layer"]
        == 2 * engine.experts_per_token
    )
    assert s["expert_buffer_mib"] > after["expert_buffer_mib"]
    assert (
        checked and max(checked) > engine.experts_per_token
    )  # real unions were staged
    assert s["mean_union_per_layer"] > engine.experts_per_token
    assert s["batch_decode_tokens"] == sum(len(r.tokens) - 1 for r in results)


def test_slot_pool_resize_keeps_the_residents_below_the_cut():
    slots = LayerSlots(4)
    slots.assign([10, 11, 12, 13])
    assert slots.resize(6) == [] and slots.n_slots == 6
    mapping, loads = slots.assign([14, 15])
    assert sorted(mapping.values()) == [4, 5] and len(loads) == 2  # the new slots
    assert sorted(slots.resize(3)) == [13, 14, 15]  # slots 3..5 go
    assert [slots.slot_of(e) for e in (10, 11, 12)] == [0, 1, 2]
    mapping, loads = slots.assign([13])
    assert loads == [(13, mapping[13])] and mapping[13] < 3  # read again, in range


def test_a_staged_set_whose_slots_were_taken_counts_its_dropped_experts(edge0_qwen):
    """The check behind `dropped_experts == 0` elsewhere: a staged set whose expert lost
    its slot before the set ran counts it."""
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="reactive", no_lora=True, slots_per_layer=4)
    )
    try:
        switch = engine.blocks[engine.moe_layers[1]].switch_mlp
        staged = switch.stage_begin([0, 1, 2, 3])
        assert switch.stage_finish(staged)[1] == 0  # nothing took its slots
        staged = switch.stage_begin([4, 5])
        switch.slots.forget(4)  # as a failed load does
        assert switch.stage_finish(staged)[1] == 1
    finally:
        engine.close()


@pytest.mark.parametrize("landed", [True, False])
def test_a_set_finished_after_it_was_dropped_writes_no_slot_it_lost(edge0_qwen, landed):
    """A staged set dropped by a load on its layer (which gave its slots to other experts)
    and finished anyway, its reads landed or still queued (then cancelled): those experts
    keep their own bundles, nothing raises, and the set's experts count as dropped."""
    index = ExpertIndex.load(edge0_qwen)
    stride = index.layout(index.moe_layers[1]).bundle_stride
    slow = {} if landed else dict(io_workers=1, io_throttle_mbps=stride / 0.05 / 1e6)
    engine = Engine.load(
        edge0_qwen,
        EngineOptions(mode="reactive", no_lora=True, slots_per_layer=4, **slow),
    )
    try:
        switch = engine.blocks[engine.moe_layers[1]].switch_mlp
        switch.load_experts([0, 1, 2, 3])
        staged = switch.stage_begin([4, 5])
        if landed:
            read_results([task for task, _ in staged.reads])
        switch.load_experts([6, 7])  # drops the set: its slots go to 6 and 7
        assert switch.stage_finish(staged)[1] == 2
        for e in switch.slots.resident_experts:
            want = unpack_bundle(
                switch._io.layout, engine.store.read(switch._io.layer, e)
            )
            slot = switch.slots.slot_of(e)
            assert mx.array_equal(
                switch.glu.gate_proj["weight"][slot], mx.array(want["gate_proj.weight"])
            ).item(), (e, slot)
        assert sorted(switch.slots.resident_experts) == [2, 3, 6, 7]
    finally:
        engine.close()


def test_sampled_row_equals_its_solo_sample_and_follows_its_seed(edge0_qwen):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    prompts = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[0]]
    seeds = [5, 9, 6, 1, 5]
    kw = dict(temperature=0.9, top_p=0.95, stop_token_ids=set())
    results = engine.generate_batch(prompts, 12, batch_size=3, seeds=seeds, **kw)
    for p, s, r in zip(prompts, seeds, results):
        assert engine.generate(p, 12, seed=s, **kw).tokens == r.tokens
    assert results[0].tokens == results[4].tokens  # same prompt, same seed
    assert results[0].tokens != results[2].tokens  # same prompt, another seed
    greedy = engine.generate(prompts[0], 12, stop_token_ids=set()).tokens
    assert results[0].tokens != greedy  # it really sampled
    mx.random.seed(1234)  # the global RNG plays no part
    assert engine.generate(prompts[0], 12, seed=5, **kw).tokens == results[0].tokens
    # The default seed is options.seed for every row.
    default = engine.generate_batch(prompts[:2], 12, **kw)
    assert [r.tokens for r in default] == [
        engine.generate(p, 12, seed=0, **kw).tokens for p in prompts[:2]
    ]
    engine.close()


def test_a_greedy_row_beside_a_sampled_one_equals_both_solo_runs(edge0_qwen):
    """A step mixing a greedy row with a sampled one draws each by its own sampler (the
    greedy rows are drawn together only when every row is greedy): both rows are their solo
    runs."""
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    try:
        p, q = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
        kw = dict(temperature=0.9, top_p=0.95)
        decoder = batch_module.BatchDecoder(engine, 2)
        greedy, sampled = (
            decoder.add(
                k,
                prompt,
                stop=StopRule(engine.tokenizer, 12, set()),
                seed=5,
                sampling=sampling,
            )
            for k, prompt, sampling in [
                (0, p, dict(temperature=0.0, top_p=1.0)),
                (1, q, kw),
            ]
        )
        with engine.batch_pool(2):
            decoder.run()
        assert greedy.tokens == engine.generate(p, 12, stop_token_ids=set()).tokens
        solo = engine.generate(q, 12, seed=5, stop_token_ids=set(), **kw).tokens
        assert sampled.tokens == solo
    finally:
        engine.close()


def test_a_greedy_step_evaluates_once(edge0_qwen, monkeypatch):
    """Greedy rows are drawn in the step's own evaluation: a resident greedy decode step
    waits on one evaluation (no second one for the tokens); a sampled row still draws
    after it."""
    from edge0_eval.engine import experts

    engine = Engine.load(edge0_qwen, EngineOptions(mode="resident"))
    waits, evaluate = [], experts.evaluate

    def counted(counters, *arrays, wait=mx.eval):
        waits.append(wait)
        evaluate(counters, *arrays, wait=wait)

    try:
        prompt = engine.tokenizer.encode(TEXTS[0])
        for module in (batch_module, step_module):
            monkeypatch.setattr(module, "evaluate", counted)
        per_step = {}
        for name, kw in [("greedy", {}), ("sampled", dict(temperature=0.9, seed=5))]:
            waits.clear()
            engine.generate(prompt, 5, stop_token_ids=set(), **kw)
            # 5 tokens: the prefill's and 4 decode steps'
            per_step[name] = sum(w is mx.eval for w in waits) - 1
        assert per_step == {"greedy": 4, "sampled": 8}
    finally:
        engine.close()


def test_non_finite_batch_logits_are_an_error(edge0_qwen2, monkeypatch):
    """A NaN reaching the batch's logits raises, naming the rows, as a solo step does."""
    engine = Engine.load(edge0_qwen2, EngineOptions(mode="reactive", clip_hidden=None))
    merge = batch_module.merge_caches

    def poisoned(caches):  # after every row's (clean) prefill, before the first step
        name = next(
            k
            for k, _ in tree_flatten(engine.model.parameters())
            if re.search(r"layers\.0\..*norm.*weight$", k)
        )
        value = dict(tree_flatten(engine.model.parameters()))[name]
        engine.model.update(
            tree_unflatten([(name, mx.full(value.shape, mx.nan, value.dtype))])
        )
        return merge(caches)

    monkeypatch.setattr(batch_module, "merge_caches", poisoned)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    with pytest.raises(
        NonFiniteError, match=r"at batched decode step 1 \(prompt\(s\) \[0, 1, 2\]"
    ):
        engine.generate_batch(prompts, 4, stop_token_ids=set())
    assert engine.stats()["nonfinite_events"] == 1
    engine.close()


def test_bad_batch_input_is_one_clear_error(edge0_qwen):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    cases = [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 2]], batch_size=0), "batch_size"),
        (dict(prompts=[[1, 2]], seeds=[1, 2]), "seeds has 2 entries"),
        (dict(prompts=[[1, 2], [3]], seeds=[1, -1]), r"seeds\[1\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            engine.generate_batch(max_tokens=2, **kwargs)
    with pytest.raises(ConfigError, match="seed must be"):
        engine.generate([1, 2], 2, seed=1.5)
    engine.close()


def test_cli_generate_prompts_file_batch(edge0_qwen, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "hello"}\n\n{"prompt": "def f(x):", "seed": 3}\n'
        '{"prompt": "a longer one, with more words in it"}\n'
    )
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "generate",
                str(edge0_qwen),
                "--prompts",
                str(prompts),
                "--batch",
                "2",
                "--max-tokens",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "expert buffer" in printed and "batch 2" in printed
    entries = json.loads(out.read_text())
    assert [e["prompt"] for e in entries] == [
        "hello",
        "def f(x):",
        "a longer one, with more words in it",
    ]
    engine = Engine.load(edge0_qwen, EngineOptions())
    for e in entries:
        assert e["tokens"] == engine.generate(e["prompt_tokens"], 4).tokens
        assert e["stats"]["batch_size"] == 2
    engine.close()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    for argv, message in (
        (["--prompts", str(tmp_path / "missing.jsonl")], "file not found"),
        (["--prompts", str(bad)], "bad.jsonl:2"),
        (["--prompt", "x", "--batch", "2"], "--batch needs --prompts"),
    ):
        assert main(["generate", str(edge0_qwen), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_batch_end_abandons_no_plan(edge0_qwen, tmp_path):
    """Rows that end together leave the last step's plan to generate_batch's reset (cancelled,
    outside the decode figures, as in a solo run); only a row leaving mid-batch abandons one."""
    path, _ = perturbed_heads(edge0_qwen, tmp_path)
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="prerouted", prerouter_path=str(path))
    )
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    engine.generate_batch(prompts, MAX_TOKENS, stop_token_ids=set())
    assert engine.stats()["abandoned_plans"] == 0
    # Three prompts, two rows at once: the third joins when the first two leave.
    engine.generate_batch(prompts, MAX_TOKENS, batch_size=2, stop_token_ids=set())
    assert engine.stats()["abandoned_plans"] == len(engine.prerouter.consumers)
    engine.close()


def _decoder_rows(engine, decoder, prompts, keys, stop):
    return {
        k: decoder.add(
            k,
            prompts[k],
            stop=StopRule(engine.tokenizer, MAX_TOKENS, stop),
            seed=0,
            sampling=dict(temperature=0.0, top_p=1.0),
        )
        for k in keys
    }


@pytest.mark.parametrize("mode", ["reactive", "prerouted"])
def test_rows_join_and_leave_a_running_batch_and_equal_their_solo_runs(family, mode):
    """The server's use of the decoder: rows are added while others decode, one is cancelled
    mid-decode; every other row's logits are bit-identical to its solo run, and the cancelled
    one's tokens are its solo run's first tokens."""
    engine = _load(family, mode)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:6]]
    solo = [_solo(engine, p, set()) for p in prompts]
    trace = {}
    decoder = batch_module.BatchDecoder(engine, 3, trace)
    with engine.batch_pool(3):
        rows = _decoder_rows(engine, decoder, prompts, [0, 1], set())
        for _ in range(2):
            decoder.step()
        rows |= _decoder_rows(engine, decoder, prompts, [2, 3, 4], set())  # 4 waits
        decoder.step()
        assert [r.key for r in decoder.active] == [0, 1, 2] and len(
            decoder.waiting
        ) == 2
        decoder.cancel(rows[1])  # leaves before the next step
        decoder.cancel(rows[4])  # never joins
        cut = len(rows[1].tokens)
        decoder.step()
        assert [r.key for r in decoder.active] == [0, 2, 3]
        rows |= _decoder_rows(engine, decoder, prompts, [5], set())
        while decoder.pending:
            assert all(r.error is None for r in decoder.step())
    assert decoder.decode["batch_joined"] >= 2
    # A row's decode figures span the steps it took part in, a token each after its
    # prefill's; over the rows, each step's rows and the steps' time shared out.
    figures = [rows[k].figures.as_dict(len(rows[k].tokens)) for k in range(6)]
    steps = [f["decode_steps"] for f in figures]
    assert steps == [max(len(rows[k].tokens) - 1, 0) for k in range(6)]
    assert sum(steps) == decoder.decode["batch_tokens"]
    shares = sum(f["decode_s"] for f in figures)
    assert shares == pytest.approx(decoder.decode["step_wall_s"])
    assert rows[1].cancelled and rows[1].tokens == solo[1][0][:cut] and cut < MAX_TOKENS
    assert rows[4].tokens == [] and 4 not in [r.key for r in decoder.active]
    kept = [0, 2, 3, 5]
    assert (
        _mismatches(
            [solo[k] for k in kept], [rows[k] for k in kept], [trace[k] for k in kept]
        )
        == []
    )
    # The check sees a row that decoded with another row's cache (rows crossed).
    assert (
        _mismatches(
            [solo[k] for k in kept],
            [rows[k] for k in kept[::-1]],
            [trace[k] for k in kept[::-1]],
        )
        != []
    )
    engine.close()


def test_a_failed_step_fails_its_rows_and_the_next_rows_start_afresh(
    edge0_qwen, monkeypatch
):
    engine = Engine.load(edge0_qwen, EngineOptions(mode="reactive"))
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:4]]
    solo = [_solo(engine, p, set()) for p in prompts]
    failed = []

    def fails(where):
        if where == "at batched decode step 2" and not failed:  # rows 0 and 1 together
            failed.append(where)
            return OSError("injected read error")

    monkeypatch.setattr(engine, "step", FailingStep(engine.step, fails))
    decoder = batch_module.BatchDecoder(engine, 4, {})
    rows = _decoder_rows(engine, decoder, prompts, [0, 1], set())
    touched = []
    while decoder.pending:
        touched += decoder.step()
    assert {r.key for r in touched if r.error is not None} == {0, 1}
    assert [len(rows[k].tokens) for k in (0, 1)] == [2, 2]  # the prefill's and step 1's
    assert all(isinstance(rows[k].error, OSError) and rows[k].done for k in (0, 1))
    assert decoder.active == [] and decoder.cache is None
    # The decoder goes on: the next rows decode in a fresh batch, each as alone.
    later = _decoder_rows(engine, decoder, prompts, [2, 3], set())
    decoder.run()
    assert [later[k].tokens for k in (2, 3)] == [solo[2][0], solo[3][0]]
    engine.close()


def test_a_batched_step_reads_each_layers_union_once(family, monkeypatch):
    """Each step's plan queues every consuming layer's union of its rows' sets once: no
    (layer, expert) is queued twice for a step, and a layer's reads are its union's misses,
    so rows that share an expert share its read."""
    engine = _load(family, "prerouted", slots_per_layer=None)
    pr, store = engine.prerouter, engine.store
    plan_id, queued, staged, unions = [0], [], [], []
    submit_many, stage, stage_begin = (
        store.submit_many,
        pr._stage,
        StreamingSwitchGLU.stage_begin,
    )

    def spy_submit(layer, experts, *args, **kwargs):
        queued.append((plan_id[0], layer, list(experts)))
        return submit_many(layer, experts, *args, **kwargs)

    def spy_stage_begin(switch, experts, **kwargs):
        s = stage_begin(switch, experts, **kwargs)
        staged.append((plan_id[0], switch._io.layer, [e for e, _ in s.loads]))
        unions.append(len(s.experts))
        return s

    def counting_stage(*args, **kwargs):
        plan_id[0] += 1  # one plan: one step's staging of every consuming layer
        try:
            return stage(*args, **kwargs)
        finally:
            plan_id[0] += 1  # reads after it (demand, prefill) belong to no plan

    monkeypatch.setattr(store, "submit_many", spy_submit)
    monkeypatch.setattr(StreamingSwitchGLU, "stage_begin", spy_stage_begin)
    monkeypatch.setattr(pr, "_stage", counting_stage)
    # Two rows: the batch pool (B x K slots) holds half a tiny layer, so steps keep reading.
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[1:3]]
    engine.generate_batch(prompts, MAX_TOKENS, stop_token_ids=set())
    engine.close()
    per_plan: dict = {}
    for plan, layer, experts in queued:
        if plan % 2:  # inside a plan's staging
            per_plan.setdefault((plan, layer), []).append(experts)
    assert len({plan for plan, _ in per_plan}) >= MAX_TOKENS - 1
    assert (
        max(unions) > engine.experts_per_token
    )  # the rows' sets differ: real unions were staged
    for key, calls in per_plan.items():
        assert len(calls) == 1, key  # one queueing per layer per plan
        assert len(calls[0]) == len(set(calls[0])), key  # nothing queued twice
    # The reads queued are the staged sets' misses, set by set.
    assert {k: sorted(c[0]) for k, c in per_plan.items()} == {
        (plan, layer): sorted(loads) for plan, layer, loads in staged
    }


def test_host_work_leaves_out_read_waits(edge0_qwen, monkeypatch):
    """A decode step's host figure is its wall time outside MLX evaluation and read waits:
    reads slowed by 0.1 s each lengthen the step's read waits, not its host work."""
    engine = Engine.load(
        edge0_qwen, EngineOptions(mode="reactive", no_lora=True, slots_per_layer=4)
    )
    read = engine.store.read_into

    def slow_read(*args, **kwargs):
        time.sleep(0.1)
        return read(*args, **kwargs)

    monkeypatch.setattr(engine.store, "read_into", slow_read)
    prompt = engine.tokenizer.encode(TEXTS[1])
    s = engine.generate(prompt, max_tokens=4, stop_token_ids=set()).stats
    engine.close()
    profile = s["profile_ms_per_step"]
    assert s["blocked_load_ms_per_step"] >= 100  # every step read, slowly
    assert 0 < profile["host_ms"] < s["blocked_load_ms_per_step"] / 2
    assert 0 < profile["host_cpu_ms"] < s["blocked_load_ms_per_step"] / 2
