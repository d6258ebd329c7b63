"""Which expert quantizations MLX runs on the current backend (reports/quant/README.md).

For each mode and a few bit widths: mx.gather_qmm (the routed experts) and mx.quantized_matmul
(resident linears) on a 2-expert 32x128 weight, activations float32/float16/bfloat16. Prints
"ok" or MLX's own error. Run: python docs/device/backend_probe.py
"""

import mlx.core as mx

CASES = [
    ("affine", 32, 1),
    ("affine", 64, 2),
    ("affine", 64, 3),
    ("affine", 64, 4),
    ("affine", 128, 5),
    ("affine", 64, 6),
    ("affine", 64, 8),
    ("mxfp4", 32, 4),
    ("mxfp8", 32, 8),
    ("nvfp4", 16, 4),
]


def run(op, mode, group, bits, dtype, global_scale):
    w = mx.random.normal((2, 32, 128)) / 10
    x = mx.random.normal((1, 1, 128)).astype(dtype)
    wq, scales, *biases = mx.quantize(w, group, bits, mode=mode)
    if mode == "affine":
        scales, biases = scales.astype(dtype), biases[0].astype(dtype)
    else:
        biases = None
    kw = dict(transpose=True, group_size=group, bits=bits, mode=mode)
    if op == "gather_qmm":
        gs = mx.ones((2,)) if global_scale else None
        ids = mx.array([[1]], dtype=mx.uint32)
        y = mx.gather_qmm(x, wq, scales, biases, rhs_indices=ids, global_scale=gs, **kw)
    else:  # MLX 0.32's quantized_matmul takes no global scale
        y = mx.quantized_matmul(
            x, wq[1], scales[1], None if biases is None else biases[1], **kw
        )
    mx.eval(y)


print(f"MLX {mx.__version__} on {mx.default_device()}")
for mode, group, bits in CASES:
    for global_scale in [False, True] if mode == "nvfp4" else [False]:
        for op in ("gather_qmm",) + (() if global_scale else ("quantized_matmul",)):
            answers = set()
            for dtype in (mx.float32, mx.float16, mx.bfloat16):
                try:
                    run(op, mode, group, bits, dtype, global_scale)
                    answers.add("ok")
                except Exception as exc:
                    answers.add(str(exc))
            name = f"{mode} {bits}-bit group {group}" + (
                " global scale" if global_scale else ""
            )
            print(f"{op:16s} {name:34s} {' | '.join(sorted(answers))}")
