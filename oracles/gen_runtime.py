"""Runtime golden: seeded MLX computations, bit for bit, for the Rust runtime tests.

Each case draws its inputs with explicit PRNG keys (so the Rust side regenerates them with
the same keys: the RNG is part of what is checked), runs a few ops, and stores inputs and
outputs as raw little-endian bytes in goldens/runtime/data.bin with an index.json.

    oracles/.venv/bin/python oracles/gen_runtime.py
"""

import mlx.core as mx

from provenance import TensorFile, golden_dir, provenance, write_json


def normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def main() -> None:
    mx.set_default_device(mx.cpu)
    out = TensorFile()
    cases = []

    # 1. seeded normal -> matmul -> softmax (the canonical cross-language check).
    a, b = normal((8, 32), 1), normal((32, 16), 2)
    y = mx.softmax(a @ b, axis=-1)
    cases.append({"name": "normal_matmul_softmax", "seeds": [1, 2],
                  "tensors": [out.add("a", a), out.add("b", b), out.add("y", y)]})

    # 2. fast.rms_norm with a weight.
    x, w = normal((4, 64), 3), normal((64,), 4)
    y = mx.fast.rms_norm(x, w, 1e-5)
    cases.append({"name": "rms_norm", "seeds": [3, 4], "eps": 1e-5,
                  "tensors": [out.add("x", x), out.add("w", w), out.add("y", y)]})

    # 3. fast.scaled_dot_product_attention, grouped-query, with and without a causal mask.
    q, k, v = normal((1, 4, 8, 16), 5), normal((1, 2, 12, 16), 6), normal((1, 2, 12, 16), 7)
    y_none = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)
    y_causal = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    cases.append({"name": "sdpa_gqa", "seeds": [5, 6, 7], "scale": 0.25,
                  "tensors": [out.add("y_none", y_none), out.add("y_causal", y_causal)]})

    # 4. affine 4-bit quantize + quantized_matmul (transposed weight, group 64).
    w, x = normal((64, 128), 8), normal((3, 128), 9)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    cases.append({"name": "quantized_matmul", "seeds": [8, 9], "group_size": 64, "bits": 4,
                  "tensors": [out.add("wq", wq), out.add("scales", scales), out.add("biases", biases), out.add("y", y)]})

    # 5. value_and_grad of sum(square(softmax(x @ w))) with respect to w.
    x, w = normal((5, 12), 10), normal((12, 7), 11)

    def loss(w):
        return mx.square(mx.softmax(x @ w, axis=-1)).sum()

    value, grad = mx.value_and_grad(loss)(w)
    cases.append({"name": "value_and_grad", "seeds": [10, 11],
                  "tensors": [out.add("value", value), out.add("grad", grad)]})

    # 6. half precision: bf16 and f16 matmul (inputs cast from f32 normals).
    a16, b16 = normal((6, 32), 12, mx.bfloat16), normal((32, 10), 13, mx.bfloat16)
    h16a, h16b = normal((6, 32), 12, mx.float16), normal((32, 10), 13, mx.float16)
    cases.append({"name": "half_matmul", "seeds": [12, 13],
                  "tensors": [out.add("a_bf16", a16), out.add("y_bf16", a16 @ b16),
                              out.add("a_f16", h16a), out.add("y_f16", h16a @ h16b)]})

    dest = golden_dir("runtime")
    out.write(dest / "data.bin")
    write_json(dest / "index.json", {
        "provenance": provenance("mlx", "mlx"),
        "generator": "oracles/gen_runtime.py",
        "data": "data.bin",
        "cases": cases,
    })
    print(f"wrote {dest}/index.json and data.bin ({out.offset} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
