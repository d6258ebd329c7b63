"""Checkpoints quantized as the low-bit uploads for 16-24 GB Macs are, built by mlx-lm's own
`mlx_lm.convert` from one fp16 tiny source: per-layer bits, per-projection bits inside a bundle
(2/3-bit experts), Config-I style boundary layers with float routers, mxfp4, mxfp8, nvfp4 and
mlx-lm's mixed_4_6. Each converts bit for bit (nothing requantized) and the engine decodes
mlx-lm's own greedy tokens from it, reactive and prerouted (float32 activations on the CPU, as
the other parity tests); a quantization MLX cannot run on this backend is refused naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import convert as mlx_lm_convert
from mlx_lm import load
from mlx_lm.generate import generate_step
from perturbed_heads import perturbed_heads
from test_convert import assert_same_tensors, load_converted

from edge0_eval.checkpoints.conversion import convert
from edge0_eval.checkpoints.conversion_plan import build_lazy_model
from edge0_eval.checkpoints.recipes import recipe_predicate
from edge0_eval.checkpoints.reference import set_experts_per_token
from edge0_eval.engine.engine import Engine
from edge0_eval.engine.heads import default_owners, init_heads_from_routers, save_heads
from edge0_eval.engine.mlx_compat import cast_floating, resolve_compute_dtype
from edge0_eval.engine.options import EngineOptions
from edge0_eval.errors import CheckpointError
from edge0_eval.formats.layout import INDEX_NAME, ExpertIndex

PROMPT = [5, 17, 42, 99, 3, 250, 7]
TOKENS = 10


def _layers_1_2_at_3_bits(path, _module):
    """Per-layer bits: layers 1 and 2's experts 3-bit, everything else the default."""
    if ".switch_mlp." in path and (".layers.1." in path or ".layers.2." in path):
        return {"group_size": 64, "bits": 3, "mode": "affine"}
    return True


# case -> (mlx_lm.convert keyword arguments; a recipe name is built for the source's model,
# the experts' quantization as ExpertIndex.describe_quant gives it)
CASES = {
    "per_layer": (
        {"q_bits": 4, "q_group_size": 64, "quant_predicate": _layers_1_2_at_3_bits},
        "layer(s) 0, 3: 4-bit group 64 affine; layer(s) 1, 2: 3-bit group 64 affine",
    ),
    "per_part": (
        {"quant_predicate": "experts_2_3"},
        "gate_proj 2-bit group 64 affine, up_proj 2-bit group 64 affine, "
        "down_proj 3-bit group 64 affine",
    ),
    "config_i": (
        {"quant_predicate": "config_i"},
        "layer(s) 0, 3: 8-bit group 64 affine; layer(s) 1, 2: gate_proj 2-bit group 64 "
        "affine, up_proj 2-bit group 64 affine, down_proj 3-bit group 64 affine",
    ),
    "mxfp4": ({"q_mode": "mxfp4"}, "4-bit group 32 mxfp4"),
    "mxfp8": ({"q_mode": "mxfp8"}, "8-bit group 32 mxfp8"),
    "nvfp4": ({"q_mode": "nvfp4"}, "4-bit group 16 nvfp4"),
    # mlx-lm's own recipe: down_proj 6-bit in layers 2 and 3 of 4, the rest 4-bit
    "mixed_4_6": (
        {"quant_predicate": "mixed_4_6"},
        "layer(s) 0, 1: 4-bit group 64 affine; layer(s) 2, 3: gate_proj 4-bit group 64 "
        "affine, up_proj 4-bit group 64 affine, down_proj 6-bit group 64 affine",
    ),
}
_OURS = ("experts_2_3", "config_i")  # recipes.py's, passed to mlx-lm as callables


@pytest.fixture(scope="module")
def built(tiny_qwen, tmp_path_factory):
    """case -> (mlx-lm checkpoint, converted directory), each made once on first use."""
    made = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            kwargs = dict(CASES[case][0])
            if kwargs.get("quant_predicate") in _OURS:
                config = json.loads((tiny_qwen / "config.json").read_text())
                kwargs["quant_predicate"] = recipe_predicate(
                    kwargs["quant_predicate"], build_lazy_model(config)
                )
            root = tmp_path_factory.mktemp(case)
            mlx_lm_convert(str(tiny_qwen), str(root / "src"), quantize=True, **kwargs)
            made[case] = (
                root / "src",
                convert(root / "src", root / "out", progress=False),
            )
        return made[case]

    return get


def _reference(src: Path, experts_per_token: int | None = None):
    model, _ = load(str(src))
    # The engine's dtype policy (float32 activations on the CPU), applied to mlx-lm's too.
    cast_floating(model, resolve_compute_dtype("auto"))
    if experts_per_token is not None:
        set_experts_per_token(model, experts_per_token)
    return model


def _greedy(model, n: int = TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def _decode(engine, n: int = TOKENS) -> list[int]:
    return engine.generate(PROMPT, max_tokens=n, stop_token_ids=set()).tokens


@pytest.mark.parametrize("case", CASES)
def test_repacked_bit_for_bit(case, built):
    """Every tensor mlx-lm loads from the source, from the converted files: nothing was
    requantized, each projection kept its bits, group size and mode."""
    src, out = built(case)
    reference, _ = load(str(src))
    ours = load_converted(out)
    assert_same_tensors(
        dict(tree_flatten(ours.parameters())),
        dict(tree_flatten(reference.parameters())),
    )
    index = ExpertIndex.load(out)
    assert index.describe_quant() == CASES[case][1]
    # Version 1 describes one affine quantization only: these need version 2.
    assert json.loads((out / INDEX_NAME).read_text())["format_version"] == 2
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.parametrize("case", CASES)
def test_reactive_decodes_mlx_lm_greedy_tokens(case, built):
    """Slots = K: nearly every routed expert is read from the expert file as it is needed."""
    src, out = built(case)
    want = _greedy(_reference(src))
    engine = Engine.load(out, EngineOptions(mode="reactive", no_lora=True))
    k = engine.experts_per_token
    engine.close()
    engine = Engine.load(
        out, EngineOptions(mode="reactive", no_lora=True, slots_per_layer=k)
    )
    try:
        assert _decode(engine) == want
        assert engine.stats()["evictions"] > 0
    finally:
        engine.close()


def _heads(out: Path, tmp: Path, top_k: int) -> Path:
    engine = Engine.load(
        out, EngineOptions(mode="reactive", no_lora=True, experts_per_token=top_k)
    )
    try:
        owners = default_owners(
            engine.moe_layers[0] + 1, len(engine.model.layers), engine.moe_layers
        )
        heads = init_heads_from_routers(engine, owners, width=32, seed=0)
        return save_heads(tmp / "prerouter.safetensors", heads)
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES)
def test_prerouted_decodes_mlx_lm_greedy_tokens(case, built, tmp_path):
    """Routing every expert (top-k = all 16), the prediction is the routing: a prerouted
    engine decodes mlx-lm's own greedy tokens at that width."""
    src, out = built(case)
    experts = ExpertIndex.load(out).num_experts
    want = _greedy(_reference(src, experts_per_token=experts))
    engine = Engine.load(
        out,
        EngineOptions(
            mode="prerouted",
            no_lora=True,
            experts_per_token=experts,
            prerouter_path=str(_heads(out, tmp_path, experts)),
        ),
    )
    try:
        assert _decode(engine) == want
        stats = engine.stats()
        assert stats["prerouted_steps"] == TOKENS - 1 and stats["dropped_experts"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES)
def test_prerouted_staged_experts_compute_what_mlx_lm_does(case, built, tmp_path):
    """At the native top-k with slots = K and heads that plan other sets than the router
    would, every planned layer reads its experts through staging at every step; what each
    executes from its slots equals mlx-lm's own experts on the same inputs and ids, bit for
    bit."""
    src, out = built(case)
    reference = _reference(src)
    heads, _ = perturbed_heads(out, tmp_path)
    probe = Engine.load(out, EngineOptions(mode="reactive", no_lora=True))
    k = probe.experts_per_token
    probe.close()
    engine = Engine.load(
        out,
        EngineOptions(
            mode="prerouted",
            no_lora=True,
            prerouter_path=str(heads),
            slots_per_layer=k,
        ),
    )
    try:
        consumers = engine.prerouter.consumers
        for layer in consumers:
            engine.blocks[layer].capture = True
        sequence = engine.sequence()
        token = int(mx.argmax(sequence.prefill(PROMPT)).item())
        checked = 0
        for _ in range(6):
            token = int(mx.argmax(sequence.step(token)).item())
            for layer in consumers:
                x, inds = engine.blocks[layer].last
                ours = engine.blocks[layer].switch_mlp(x, inds, pinned=True)
                mlx_lm_experts = reference.layers[layer].mlp.switch_mlp
                assert mx.array_equal(ours, mlx_lm_experts(x, inds)).item(), layer
                checked += 1
        assert checked == 6 * len(consumers)
        assert engine.counters.staged_loads > 0
    finally:
        engine.close()


def test_a_mode_this_backend_cannot_run_is_refused_naming_it(tiny_qwen, tmp_path):
    """nvfp4 with one global scale per expert (mlx-lm's quantize_model(global_scale=True)):
    MLX runs it on the GPU only; elsewhere loading refuses, naming the mode and the backend.
    Conversion repacks it all the same (the global scale travels in each bundle)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(tiny_qwen)
    model, config = quantize_model(
        model, config, None, None, mode="nvfp4", global_scale=True
    )
    src = tmp_path / "src"
    shutil.copytree(tiny_qwen, src)
    save_model(src, model)
    save_config(config, src / "config.json")
    out = convert(src, tmp_path / "out", progress=False)
    index = ExpertIndex.load(out)
    assert index.describe_quant() == "4-bit group 16 nvfp4 with a global scale"
    reference, _ = load(str(src))
    assert_same_tensors(
        dict(tree_flatten(load_converted(out).parameters())),
        dict(tree_flatten(reference.parameters())),
    )
    if mx.default_device() != mx.cpu:
        pytest.skip("the GPU runs nvfp4 global scales: nothing to refuse")
    with pytest.raises(CheckpointError) as raised:
        Engine.load(out, EngineOptions(mode="reactive", no_lora=True))
    message = str(raised.value)
    assert str(out / INDEX_NAME) in message
    assert (
        "layer(s) 0, 1, 2, 3 are quantized 4-bit group 16 nvfp4 with a global scale"
        in (message)
    )
    assert "cpu backend" in message and "only supported on the GPU" in message


# -- the student's stages ----------------------------------------------------------------------

FIDELITY_TEXTS = ["What is 2 + 2?", "def fib(n):", "Name three primary colours."]
STUDENT_ARMS = {
    "int4_exact": dict(mode="reactive", no_lora=True, no_prerouter=True),
    "prerouted_nolora": dict(mode="prerouted", no_lora=True),
    "student": dict(mode="prerouted"),
}


@pytest.mark.parametrize("case", ["config_i", "mxfp4"])
def test_training_stages_and_fidelity_on_such_a_student(
    case, built, tiny_qwen, tmp_path
):
    """Config-I (2/3-bit experts, 8-bit boundary layers, float routers) and mxfp4 (every
    resident linear mxfp4 too, LoRA on them): stage 1 trains prerouter heads, stage 2 LoRA
    against the fp16 teacher and stage 3 distils from it, as on an int4 student; the trained
    adapter loads and changes decoding, and fidelity scores every arm against the teacher."""
    from test_train_prerouter import options
    from test_training import DISTILL_ARGS, SFT_ARGS, WORDS

    from edge0_eval import cli
    from edge0_eval.evaluation.fidelity import report as fr
    from edge0_eval.evaluation.fidelity import scoring as fid
    from edge0_eval.training.prerouter_fit import train_prerouter

    student = tmp_path / "student"
    shutil.copytree(built(case)[1], student)
    heads = student / "prerouter.safetensors"
    report = train_prerouter(options(student, heads, steps=10, ckpt_every=5))
    assert heads.is_file() and np.isfinite(report["mean"]["recall_heads"])

    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join(rng.choice(WORDS, size=6))}) + "\n"
            for _ in range(12)
        )
    )
    lora, distilled = tmp_path / "lora.safetensors", tmp_path / "distill.safetensors"
    common = ["--teacher", tiny_qwen, "--prompts", prompts]
    argv = ["train-lora", student, *common, "--out", lora, *SFT_ARGS]
    assert cli.main([str(a) for a in argv]) == 0
    argv = ["distill", student, *common, "--out", distilled, "--init-adapter", lora]
    assert cli.main([str(a) for a in argv + DISTILL_ARGS]) == 0
    for out in (lora, distilled):
        losses = json.loads(
            out.with_name(out.name.replace(".safetensors", ".report.json")).read_text()
        )["training"]["loss_history"]
        assert losses and all(np.isfinite(losses))
    shutil.copy(distilled, student / "lora.safetensors")

    decoded = {}
    for no_lora in (True, False):
        engine = Engine.load(student, EngineOptions(mode="prerouted", no_lora=no_lora))
        decoded[no_lora] = _decode(engine)
        engine.close()
    assert decoded[True] != decoded[False]

    prompts = [fid.Prompt(f"t/{i}", "ifbench", t) for i, t in enumerate(FIDELITY_TEXTS)]
    fset = fid.make_set(
        tiny_qwen, prompts, {"test": {"items": len(prompts)}}, max_new=8, top_k=8
    )
    teacher = fid.load_teacher(tiny_qwen)[0]
    loaded = {"teacher": fr.arm_items("teacher", fid.score_model(teacher, fset))}
    for arm, arm_options in STUDENT_ARMS.items():
        engine = Engine.load(student, EngineOptions(slots_per_layer=8, **arm_options))
        loaded[arm] = fr.arm_items(arm, fid.score_model(engine, fset))
        engine.close()
    summary = fr.summarize(loaded)
    assert summary["teacher_sanity"]["ok"]
    for arm in STUDENT_ARMS:
        assert 0 < summary["arms"][arm]["kl"] < 10, arm


# -- the version 2 index -----------------------------------------------------------------------


def _v2_case(name):
    def change(d):
        layouts = d["layouts"]
        quant = layouts[1]["quant"]
        tensors = {t["name"]: t for t in layouts[1]["tensors"]}
        if name == "format_version 3":
            d["format_version"] = 3
        elif name == "layer out of range":
            d["layer_layouts"][1] = 5
        elif name == "layer missing":
            d["layer_layouts"].pop()
        elif name == "layout unused":
            d["layer_layouts"] = [0] * len(d["layer_layouts"])
        elif name == "bits 7":
            quant["down_proj"]["bits"] = 7
        elif name == "bits string":
            quant["down_proj"]["bits"] = "3"
        elif name == "mode mxfp4 on affine tensors":
            quant["gate_proj"].update(mode="mxfp4", bits=4, group_size=32)
        elif name == "global scale on affine":
            quant["up_proj"]["global_scale"] = True
        elif name == "projection missing":
            del quant["up_proj"]
        elif name == "biases dropped":
            layouts[1]["tensors"] = [
                t for t in layouts[1]["tensors"] if t["name"] != "down_proj.biases"
            ]
        elif name == "uint8 affine scales":
            tensors["gate_proj.scales"]["dtype"] = "uint8"
        elif name == "gate/up swapped":
            a, b = tensors["gate_proj.weight"], tensors["up_proj.weight"]
            a["offset"], b["offset"] = b["offset"], a["offset"]
        elif name == "scalar weight":
            tensors["gate_proj.weight"]["shape"] = []
        elif name == "no layouts":
            d["layouts"] = []
        elif name == "layouts object":
            d["layouts"] = {"0": layouts[0]}
        elif name == "version 1 field":
            d["bits"] = 4
        elif name == "stride":
            layouts[0]["bundle_stride"] += 4096

    return change


V2_CASES = [
    "format_version 3",
    "layer out of range",
    "layer missing",
    "layout unused",
    "bits 7",
    "bits string",
    "mode mxfp4 on affine tensors",
    "global scale on affine",
    "projection missing",
    "biases dropped",
    "uint8 affine scales",
    "gate/up swapped",
    "scalar weight",
    "no layouts",
    "layouts object",
    "version 1 field",
    "stride",
]


@pytest.mark.parametrize("case", V2_CASES)
def test_version_2_index_lies_refused(case, built, tmp_path):
    from bad_inputs import copy_model, edit_json, expect_clear_error

    model = copy_model(built("config_i")[1], tmp_path / "m")
    edit_json(model / INDEX_NAME, _v2_case(case))
    expect_clear_error(lambda: ExpertIndex.load(model), INDEX_NAME)


def test_version_2_index_round_trips(built):
    out = built("config_i")[1]
    text = (out / INDEX_NAME).read_text()
    index = ExpertIndex.load(out)
    assert len(index.layouts) == 2 and index.layer_layouts == [0, 1, 1, 0]
    assert json.dumps(index.to_json(), indent=1) == text


def test_bench_runs_two_quantizations_of_one_model_side_by_side(built, tmp_path):
    """`bench A --compare B`: every arm on each model in turn (cache evicted before each),
    rows labelled by model, bytes per token against the ratio of their bundle bytes."""
    from edge0_eval.cli import main

    a, b = built("mixed_4_6")[1], built("per_part")[1]
    report_path = tmp_path / "bench.json"
    argv = ["bench", a, "--compare", b, "--arms", "reactive,prerouted", "--no-lora"]
    argv += ["--experts-per-token", "4", "--slots-per-layer", "4", "--tokens", "6"]
    argv += ["--prompt-tokens", "6", "--raw-reads", "16", "--json", report_path]
    heads = [_heads(m, tmp_path / m.parent.name, 4) for m in (a, b)]
    for model, path in zip((a, b), heads):
        path.rename(model / "prerouter.safetensors")
    assert main([str(x) for x in argv]) == 0
    report = json.loads(report_path.read_text())
    labels = list(report["models"])
    assert labels == ["out", "out#1"]
    runs = [(r["arm"], r["model"]) for r in report["runs"]]
    assert runs == [(arm, m) for arm in ("reactive", "prerouted") for m in labels]
    slot_bytes = [ExpertIndex.load(m).slot_bytes for m in (a, b)]
    assert report["models"]["out#1"]["slot_bytes"] == slot_bytes[1]
    targets = report["targets"]
    assert targets["bundle_bytes out#1 over out"] == round(
        slot_bytes[1] / slot_bytes[0], 4
    )
    for arm in ("reactive", "prerouted"):
        rows = {r["model"]: r for r in report["runs"] if r["arm"] == arm}
        ratio = rows["out#1"]["bytes_per_token"] / rows["out"]["bytes_per_token"]
        assert targets[f"{arm} bytes_per_token out#1 over out"] == round(ratio, 4)
        assert "out#1: decode_prerouted_over_reactive" in targets


@pytest.mark.parametrize("case", ["config_i", "nvfp4"])
def test_batched_rows_equal_solo_runs(case, built, tmp_path):
    """Batched prerouted decode resizes each layer's slot buffers, part by part, to the rows'
    union and back: every row decodes what it decodes alone."""
    from decode_parity import assert_batch_rows_equal_solo

    out = built(case)[1]
    heads, _ = perturbed_heads(out, tmp_path)
    assert_batch_rows_equal_solo(out, heads, slots_per_layer=4)
