"""Streaming engine core: parity with mlx-lm, bounded memory, clear errors."""

import json
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from edge0_eval.cli import main
from edge0_eval.engine.engine import Engine, NonFiniteError
from edge0_eval.engine.options import EngineOptions
from edge0_eval.engine.store import FileGuard
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.formats.layout import EXPERTS_NAME, INDEX_NAME

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"

# Same int4 weights through the same MLX kernels: on the CPU the logits are bit-identical.
# Other backends may tile gather_qmm differently when the batch differs (sorted prefill rows),
# so allow fp16 rounding there.
TOL = 0.0 if mx.default_device() == mx.cpu else 2e-2


def _max_diff(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def _parity(src, converted, steps=64, **options):
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from edge0_eval.engine.mlx_compat import cast_floating, resolve_compute_dtype

    ref, tok = load(str(src))
    # The engine's dtype policy (float32 activations on CPU), applied to mlx-lm's model too.
    cast_floating(ref, resolve_compute_dtype("auto"))
    engine = Engine.load(converted, EngineOptions(mode="reactive", **options))
    prompt = tok.encode(PROMPT)
    cache = make_prompt_cache(ref)
    ref_logits = ref(mx.array(prompt)[None], cache=cache)[0, -1]
    sequence = engine.sequence()
    eng_logits = sequence.prefill(prompt)
    worst = _max_diff(ref_logits, eng_logits)
    token = int(mx.argmax(ref_logits).item())
    for _ in range(steps):
        ref_logits = ref(mx.array([[token]]), cache=cache)[0, -1]
        eng_logits = sequence.step(token)
        worst = max(worst, _max_diff(ref_logits, eng_logits))
        assert int(mx.argmax(eng_logits).item()) == int(mx.argmax(ref_logits).item())
        token = int(mx.argmax(ref_logits).item())
    stats = engine.stats()
    engine.close()
    return worst, stats


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2", "qwen64"])
def test_reactive_matches_mlx_lm(family, request):
    src = request.getfixturevalue(f"tiny_{family}_q4")
    converted = request.getfixturevalue(f"edge0_{family}")
    worst, stats = _parity(src, converted)
    assert worst <= TOL
    assert stats["bytes_read"] > 0 and stats["guard_events"] == 0
    # family default
    assert stats["guard_clip"] == (1000.0 if family == "bailing" else None)


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2", "qwen64"])
def test_parity_holds_when_nearly_every_expert_misses(family, request):
    src = request.getfixturevalue(f"tiny_{family}_q4")
    converted = request.getfixturevalue(f"edge0_{family}")
    with open(converted / "config.json") as f:
        cfg = json.load(f)
    k = cfg.get("text_config", cfg)["num_experts_per_tok"]
    worst, stats = _parity(src, converted, steps=24, slots_per_layer=k)
    assert worst <= TOL
    # Greedy decode of the random attention-only qwen2 model soon repeats tokens, and a repeated
    # token re-hits its experts (0.54 measured), so its bound is looser.
    assert stats["cache_hit_rate"] < (0.6 if family == "qwen2" else 0.5)
    assert stats["evictions"] > 0


def test_top_k_override_changes_routing_width(edge0_qwen64):
    engine = Engine.load(
        edge0_qwen64, EngineOptions(mode="reactive", experts_per_token=4)
    )
    result = engine.generate(engine.tokenizer.encode(PROMPT), max_tokens=4)
    engine.close()
    assert result.stats["top_k"] == 4
    # Each decode step reads at most K bundles per MoE layer.
    assert result.stats["reads_per_token"] <= 4 * 4


def test_generate_is_deterministic_and_stops(edge0_qwen):
    engine = Engine.load(edge0_qwen, EngineOptions())
    prompt = engine.tokenizer.encode(PROMPT)
    a = engine.generate(prompt, max_tokens=12)
    b = engine.generate(prompt, max_tokens=12)
    assert a.tokens == b.tokens and len(a.tokens) <= 12
    c = engine.generate(prompt, max_tokens=12, temperature=0.8, top_p=0.9)
    assert len(c.tokens) >= 1
    stop = {a.tokens[1]}
    d = engine.generate(prompt, max_tokens=12, stop_token_ids=stop)
    assert d.tokens == a.tokens[:2]
    engine.close()


def test_small_budget_peak_memory_below_resident(edge0_qwen64):
    from edge0_eval.formats.layout import ExpertIndex

    index = ExpertIndex.load(edge0_qwen64)
    peaks = {}
    for mode, slots in (("resident", None), ("reactive", 8)):
        engine = Engine.load(
            edge0_qwen64, EngineOptions(mode=mode, slots_per_layer=slots)
        )
        engine.generate(engine.tokenizer.encode(PROMPT), max_tokens=8)
        peaks[mode] = engine.stats()["peak_memory_gib"] * 2**30
        engine.close()
        del engine
    not_held = (index.num_experts - 8) * index.slot_bytes
    assert peaks["resident"] - peaks["reactive"] >= 0.8 * not_held


def test_budget_below_one_layer_topk_is_refused(edge0_qwen):
    with pytest.raises(ConfigError, match="expert_budget_mib"):
        Engine.load(edge0_qwen, EngineOptions(expert_budget_mib=0.01))


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_truncated_expert_file(edge0_qwen, tmp_path):
    model = _copy(edge0_qwen, tmp_path)
    path = model / EXPERTS_NAME
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        Engine.load(model)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: d.update(num_experts=d["num_experts"] * 2), "file_size|experts"),
        (lambda d: d.update(moe_layers=d["moe_layers"][:-1]), "file_size|MoE layers"),
    ],
)
def test_index_that_does_not_match(edge0_qwen, tmp_path, edit, message):
    model = _copy(edge0_qwen, tmp_path)
    data = json.loads((model / INDEX_NAME).read_text())
    edit(data)
    (model / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        Engine.load(model)


def test_unsupported_model_type(edge0_qwen, tmp_path):
    model = _copy(edge0_qwen, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not supported"):
        Engine.load(model)


def test_read_error_during_decode_raises(edge0_qwen, tmp_path):
    model = _copy(edge0_qwen, tmp_path)
    engine = Engine.load(model, EngineOptions(slots_per_layer=4))
    with open(model / EXPERTS_NAME, "r+b") as f:
        f.truncate(0)  # the open file now ends early: every miss is a short read
    with pytest.raises(CheckpointError, match="changed while .*size"):
        engine.generate(engine.tokenizer.encode(PROMPT), max_tokens=16)
    engine.close()


def test_cli_generate_json_and_bench(edge0_qwen, tmp_path):
    out = tmp_path / "gen.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "generate",
            str(edge0_qwen),
            "--prompt",
            "hi",
            "--max-tokens",
            "5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert 1 <= len(data["tokens"]) <= 5 and data["stats"]["decode_tok_s"] >= 0
    bench = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "bench",
            str(edge0_qwen),
            "--arms",
            "mlx-lm,resident,reactive",
            "--cache",
            "cold",
            "--tokens",
            "4",
            "--raw-reads",
            "16",
            "--json",
            str(bench),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(bench.read_text())
    assert [r["arm"] for r in report["runs"]] == ["mlx-lm", "resident", "reactive"]
    assert report["raw_reads"]["gbps"] > 0 and report["cache"] == "cold"
    reactive = report["runs"][2]
    assert report["targets"]["peak_reactive_over_checkpoint"] == pytest.approx(
        reactive["peak_memory_gib"] * 2**30 / report["checkpoint_bytes"], rel=1e-3
    )
    assert report["checkpoint_bytes"] > (edge0_qwen / "experts.bin").stat().st_size


def test_cli_bad_budget_is_one_line(edge0_qwen):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0_eval",
            "generate",
            str(edge0_qwen),
            "--prompt",
            "hi",
            "--expert-budget-mib",
            "0.001",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "expert_budget_mib" in proc.stderr


def test_hidden_clipping_defaults_to_bailing_only():
    """Clipping at +-1000 is the reference's fix for the 8B tier; on other models it would cut
    legitimate activations (SmolLM2's reach ~25,000 and its int4 student then babbled)."""
    from edge0_eval.engine.families import FAMILIES

    auto = EngineOptions()
    assert auto.resolved_clip(FAMILIES["bailing_hybrid"]) == 1000.0
    assert auto.resolved_clip(FAMILIES["qwen3_5_moe"]) is None
    assert auto.resolved_clip(FAMILIES["qwen2_moe"]) is None
    assert EngineOptions(clip_hidden=50.0).resolved_clip(FAMILIES["qwen2_moe"]) == 50.0
    assert (
        EngineOptions(clip_hidden=None).resolved_clip(FAMILIES["bailing_hybrid"])
        is None
    )
    for bad in (0, -1.0, "big"):
        with pytest.raises(ConfigError, match="clip_hidden"):
            EngineOptions(clip_hidden=bad).validate()


def test_load_in_expert_order_makes_a_pass_independent_of_pool_history(edge0_qwen64):
    """Training loads each layer's union this way: the same set must compute the same bits
    whatever the pool held before (slot order follows expert order)."""
    union = [40, 2, 17, 33, 9, 60]
    x = mx.random.normal((1, 16, 128), key=mx.random.key(0))
    # 64 rows
    inds = mx.array([[[union[(t + j) % 6] for j in range(4)] for t in range(16)]])
    outs = []
    for history in ([], [60, 40, 33], [9, 61, 2, 5, 40, 17, 12]):
        engine = Engine.load(
            edge0_qwen64, EngineOptions(mode="reactive", slots_per_layer=12)
        )
        switch = engine.blocks[engine.moe_layers[0]].switch_mlp
        x = x.astype(switch.glu.gate_proj.scales.dtype)
        if history:
            switch.load_experts(history)
        switch.load_in_expert_order(union)
        slots = [switch.slots.slot_of(e) for e in sorted(union)]
        assert slots == sorted(slots)
        assert mx.array_equal(
            switch._io.lut[mx.array(sorted(union))], mx.array(slots)
        ).item()
        outs.append(switch(x, inds, pinned=True))
        mx.eval(outs[-1])
        engine.close()
    assert all(mx.array_equal(o, outs[0]).item() for o in outs[1:])


def test_a_graph_keeps_the_slot_table_it_was_built_with(edge0_qwen64):
    """The slot table is published as a new array whenever loads change it (no scatter into
    the device table): a graph built before a later load still maps its experts to the
    slots they had then, as MLX's update in place would; the table now maps them to where
    they are now."""
    engine = Engine.load(
        edge0_qwen64, EngineOptions(mode="reactive", slots_per_layer=8)
    )
    switch = engine.blocks[engine.moe_layers[0]].switch_mlp
    first = list(range(1, 9))
    switch.load_experts(first)
    built = switch._io.lut[mx.array(first)]  # lazy: evaluated after the loads below
    then = [switch.slots.slot_of(e) for e in first]
    switch.load_experts(list(range(16, 8, -1)))  # every slot changes hands
    switch.load_experts(first[::-1])  # and back, in other slots
    now = [switch.slots.slot_of(e) for e in first]
    assert now != then
    assert built.tolist() == then
    assert switch._io.lut[mx.array(first)].tolist() == now
    engine.close()


def _poison(model, pattern: str) -> str:
    """Set the first resident norm weight whose name matches `pattern` to NaN; its name."""
    name = next(k for k, _ in tree_flatten(model.parameters()) if re.search(pattern, k))
    value = dict(tree_flatten(model.parameters()))[name]
    model.update(tree_unflatten([(name, mx.full(value.shape, mx.nan, value.dtype))]))
    return name


@pytest.mark.parametrize("family", ["qwen", "bailing", "qwen2"])
def test_non_finite_hidden_states_are_an_error(family, request):
    """A NaN resident weight must end in one clear error, not in end-of-text tokens."""
    converted = request.getfixturevalue(f"edge0_{family}")
    # Unclipped (every family's default but bailing's): a NaN in a layer's norm reaches the
    # logits; found at the decode step it first appears in.
    engine = Engine.load(converted, EngineOptions(mode="reactive", clip_hidden=None))
    prompt = engine.tokenizer.encode(PROMPT)
    sequence = engine.sequence()
    token = int(mx.argmax(sequence.prefill(prompt)).item())
    _poison(engine.model, r"layers\.0\..*norm.*weight$")
    with pytest.raises(NonFiniteError, match="non-finite logits at decode step 1"):
        sequence.step(token)
    assert engine.stats()["nonfinite_events"] == 1
    engine.close()
    # With the family's default clipping, a NaN after the last layer (the final norm) still
    # cannot decode silently: generate raises in the prefill.
    engine = Engine.load(converted, EngineOptions(mode="reactive"))
    _poison(engine.model, r"(^|\.)model\.norm\.weight$")
    with pytest.raises(NonFiniteError, match="in the prefill"):
        engine.generate(prompt, max_tokens=4)
    assert engine.stats()["nonfinite_events"] == 1
    engine.close()


def test_bench_states_the_file_guards_cost(edge0_qwen, tmp_path, monkeypatch, capsys):
    """--compare-file-guard: each guarded arm runs again without the check, the order
    alternating by round; the check runs once per read in the guarded runs only."""
    calls = [0]
    check = FileGuard.check

    def counted(guard):
        calls[0] += 1
        check(guard)

    monkeypatch.setattr(FileGuard, "check", counted)
    out = tmp_path / "bench.json"
    argv = ["bench", str(edge0_qwen), "--arms", "reactive", "--repeats", "2"]
    argv += ["--tokens", "4", "--cache", "warm", "--raw-reads", "0"]
    assert main(argv + ["--compare-file-guard", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    arms = [r["arm"] for r in report["runs"]]
    assert arms == ["reactive", "reactive no-file-guard"] + [
        "reactive no-file-guard",
        "reactive",
    ]
    guarded = sum(r["reads"] for r in report["runs"] if r["arm"] == "reactive")
    assert guarded > 0
    assert calls[0] == report["file_guard"]["checks"] + guarded
    targets = report["targets"]
    assert targets["file_guard_us_per_check"] > 0
    assert "file_guard_reactive_decode_over_unguarded" in targets
    assert "file_guard_reactive_ms_per_token" in capsys.readouterr().out


def test_public_api_names_and_docs_example(edge0_qwen, capsys):
    """Every exported name is the defining module's object, and docs/engine.md's example
    runs as written (on the tiny model; reactive, as it has no heads)."""
    import importlib
    from pathlib import Path

    import edge0_eval

    for name, module in edge0_eval._API.items():
        assert getattr(edge0_eval, name) is getattr(
            importlib.import_module(module), name
        )
    doc = (Path(__file__).parent.parent / "docs" / "engine.md").read_text()
    (code,) = re.findall(r"## From Python.*?```python\n(.*?)```", doc, re.S)
    assert "from edge0_eval import Engine, EngineOptions" in code
    code = code.replace("path/to/converted", str(edge0_qwen))
    exec(code.replace('mode="prerouted"', 'mode="reactive"'), {})
    assert capsys.readouterr().out.strip()
