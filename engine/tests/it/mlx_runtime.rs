//! Model-free proof that MLX works from Rust through our mlx-sys: dtype round trips, matmul,
//! fast kernels, quantization, autodiff, compile and memory counters. Exact expectations
//! only; the bit-for-bit comparison with Python mlx is tests/it/runtime_golden.rs.
//! Run single-threaded (MLX is not thread-safe): `cargo test -- --test-threads=1`.

use half::{bf16, f16};
use mlx_rs::error::Exception;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::{dequantize, quantize, quantized_matmul, softmax_axis};
use mlx_rs::transforms::{compile::compile, value_and_grad};
use mlx_rs::{random, Array, Dtype};

type R = Result<(), Exception>;

#[test]
fn runtime_reports_version_backend_and_device() {
    assert_eq!(engine::runtime::mlx_version(), "0.32.2");
    assert_eq!(engine::runtime::BUILD_MLX_VERSION, "0.32.2");
    assert!(["cpu", "cuda", "metal"].contains(&engine::runtime::backend()));
    assert_ne!(engine::runtime::default_device(), "unknown");
    engine::runtime::self_check().unwrap();
}

#[test]
fn f32_f16_bf16_round_trips() -> R {
    let data = [0.5f32, -1.25, 3.0, 1024.0, -0.0, 65504.0];
    let a = Array::from_slice(&data, &[2, 3]);
    assert_eq!(a.shape(), &[2, 3]);
    assert_eq!(a.as_slice::<f32>(), &data);

    // All values are exact in f16 and bf16 except 65504 in bf16 (rounds to 65536).
    let h = a.as_dtype(Dtype::Float16)?;
    let want_h: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
    assert_eq!(h.as_slice::<f16>(), want_h.as_slice());
    assert_eq!(h.as_dtype(Dtype::Float32)?.as_slice::<f32>(), &data);

    let b = a.as_dtype(Dtype::Bfloat16)?;
    let want_b: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(b.as_slice::<bf16>(), want_b.as_slice());
    assert_eq!(b.as_dtype(Dtype::Float32)?.as_slice::<f32>()[5], 65536.0);

    let from_bf16 = Array::from_slice(&want_b, &[6]);
    assert_eq!(from_bf16.dtype(), Dtype::Bfloat16);
    assert_eq!(from_bf16.as_slice::<bf16>(), want_b.as_slice());
    Ok(())
}

#[test]
fn matmul_gives_exact_integer_products() -> R {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let b = Array::from_slice(&[7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0], &[3, 2]);
    let c = a.matmul(&b)?;
    assert_eq!(c.shape(), &[2, 2]);
    assert_eq!(c.as_slice::<f32>(), &[58.0, 64.0, 139.0, 154.0]);
    Ok(())
}

#[test]
fn rms_norm_of_a_constant_row_is_the_weight() -> R {
    // rms([c, c, c, c]) = |c|, so with eps = 0 the result is sign(c) * weight exactly.
    let x = Array::from_slice(&[2.0f32; 4], &[1, 4]);
    let w = Array::from_slice(&[1.0f32, -2.0, 0.5, 4.0], &[4]);
    let y = fast::rms_norm(&x, Some(&w), 0.0)?;
    assert_eq!(y.as_slice::<f32>(), &[1.0, -2.0, 0.5, 4.0]);
    Ok(())
}

#[test]
fn sdpa_with_one_key_returns_its_value_and_causal_masks_the_future() -> R {
    // One key: softmax over a single logit is 1, so the output is exactly v.
    let q = random::normal::<f32>(&[1, 2, 3, 8], None, None, &random::key(0)?)?;
    let k = random::normal::<f32>(&[1, 2, 1, 8], None, None, &random::key(1)?)?;
    let v = random::normal::<f32>(&[1, 2, 1, 8], None, None, &random::key(2)?)?;
    let y = fast::scaled_dot_product_attention(&q, &k, &v, 0.3, None, None)?;
    let (y, v) = (y.as_slice::<f32>(), v.as_slice::<f32>());
    for head in 0..2 {
        for row in 0..3 {
            let at = (head * 3 + row) * 8;
            assert_eq!(
                &y[at..at + 8],
                &v[head * 8..head * 8 + 8],
                "head {head} row {row}"
            );
        }
    }

    // Causal with equal lengths: the first query sees only the first key, so row 0 = v[0].
    let k3 = random::normal::<f32>(&[1, 2, 3, 8], None, None, &random::key(3)?)?;
    let v3 = random::normal::<f32>(&[1, 2, 3, 8], None, None, &random::key(4)?)?;
    let y = fast::scaled_dot_product_attention(
        &q,
        &k3,
        &v3,
        0.3,
        ScaledDotProductAttentionMask::Causal,
        None,
    )?;
    let y = y.as_slice::<f32>().to_vec();
    let v3 = v3.as_slice::<f32>().to_vec();
    for head in 0..2 {
        let row = head * 24;
        assert_eq!(&y[row..row + 8], &v3[row..row + 8], "head {head}");
    }
    Ok(())
}

#[test]
fn quantize_round_trip_error_is_within_one_step() -> R {
    let w = random::normal::<f32>(&[32, 64], None, None, &random::key(7)?)?;
    let (wq, scales, biases) = quantize(&w, 64, 4)?;
    assert_eq!(wq.dtype(), Dtype::Uint32);
    assert_eq!(wq.shape(), &[32, 8]); // 64 values × 4 bits / 32 bits
    let back = dequantize(&wq, &scales, &biases, 64, 4)?;
    let (w, back, scales) = (
        w.as_slice::<f32>(),
        back.as_slice::<f32>(),
        scales.as_slice::<f32>(),
    );
    for (i, (a, b)) in w.iter().zip(back).enumerate() {
        // MLX snaps one edge of each group onto the grid, so the other edge may clip: the
        // bound is one step, not half.
        let step = scales[i / 64].abs() * (1.0 + 1e-5);
        assert!((a - b).abs() <= step, "value {i}: {a} vs {b}, step {step}");
    }
    // quantized_matmul equals matmul with the dequantized weight on integer-valued inputs.
    let x = Array::from_slice(&[1.0f32; 64], &[1, 64]);
    let (wq, scales, biases) = quantize(
        Array::from_slice(&[0.0f32; 64 * 4], &[4, 64]).add(Array::from_f32(1.0))?,
        64,
        4,
    )?;
    let y = quantized_matmul(&x, &wq, &scales, &biases, true, 64, 4)?;
    assert_eq!(y.as_slice::<f32>(), &[64.0; 4]);
    Ok(())
}

#[test]
fn value_and_grad_of_sum_of_squares_is_two_x() -> R {
    let x = Array::from_slice(&[1.0f32, -2.0, 3.5], &[3]);
    let f = |args: &[Array]| -> Result<Vec<Array>, Exception> {
        Ok(vec![args[0].square()?.sum(None)?])
    };
    let (values, grads) = value_and_grad(f)(&[x])?;
    assert_eq!(values[0].as_slice::<f32>(), &[1.0 + 4.0 + 12.25]);
    assert_eq!(grads[0].as_slice::<f32>(), &[2.0, -4.0, 7.0]);
    Ok(())
}

#[test]
fn compiled_function_is_bit_exact_with_eager() -> R {
    fn step(args: &[Array]) -> Result<Vec<Array>, Exception> {
        let h = args[0].matmul(&args[1])?;
        let h = fast::rms_norm(&h, None, 1e-6)?;
        Ok(vec![softmax_axis(h, -1, None)?])
    }
    let a = random::normal::<f32>(&[4, 16], None, None, &random::key(11)?)?;
    let b = random::normal::<f32>(&[16, 32], None, None, &random::key(12)?)?;
    let eager = step(&[a.clone(), b.clone()])?;
    let mut compiled = compile(step, None);
    let once = compiled(&[a.clone(), b.clone()])?;
    let twice = compiled(&[a, b])?; // second call reuses the traced graph
    assert_eq!(once[0].as_slice::<f32>(), eager[0].as_slice::<f32>());
    assert_eq!(twice[0].as_slice::<f32>(), eager[0].as_slice::<f32>());
    Ok(())
}

#[test]
fn memory_counters_track_allocations_and_peak_resets() -> R {
    engine::runtime::reset_peak_memory().unwrap();
    let before = engine::runtime::memory().unwrap();
    let big = Array::from_slice(&vec![1.0f32; 1 << 20], &[1 << 20]).add(Array::from_f32(1.0))?;
    big.eval()?;
    let during = engine::runtime::memory().unwrap();
    assert!(
        during.active >= before.active + 4 * (1 << 20),
        "{before:?} -> {during:?}"
    );
    assert!(during.peak >= during.active);
    drop(big);
    let after = engine::runtime::memory().unwrap();
    assert!(
        after.active < during.active,
        "freed: {during:?} -> {after:?}"
    );
    engine::runtime::reset_peak_memory().unwrap();
    let reset = engine::runtime::memory().unwrap();
    assert!(
        reset.peak < during.peak,
        "peak reset: {during:?} -> {reset:?}"
    );
    Ok(())
}

/// Whether MLX kept the buffer it was given (no copy), as (same pointer, deleter not yet
/// called), for a managed f32 buffer of 1 Mi values.
fn managed_buffer_is_wrapped() -> (bool, bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FREED: AtomicBool = AtomicBool::new(false);
    extern "C" fn freed(_: *mut std::ffi::c_void) {
        FREED.store(true, Ordering::SeqCst);
    }
    // The buffer outlives the array: MLX may only borrow it until its deleter runs.
    let mut buf = vec![1.0f32; 1 << 20];
    let shape = [1i32 << 20];
    // SAFETY: `buf` holds shape's 1 Mi f32s and outlives the array, freed just below.
    unsafe {
        let a = mlx_sys::mlx_array_new_data_managed(
            buf.as_mut_ptr().cast(),
            shape.as_ptr(),
            1,
            mlx_sys::mlx_dtype__MLX_FLOAT32,
            Some(freed),
        );
        let kept_at_once = !FREED.load(Ordering::SeqCst);
        let data = mlx_sys::mlx_array_data_float32(a);
        let same = std::ptr::eq(data, buf.as_ptr());
        mlx_sys::mlx_array_free(a);
        (same, kept_at_once)
    }
}

/// The SSD tier copies an entry's mapped bytes into MLX arrays (`kvstore::read`) because
/// MLX 0.32.2's CPU backend copies any buffer it is given: `mlx_array_new_data_managed`
/// calls the deleter before it returns and the array's data lives elsewhere. Should a later
/// MLX wrap the buffer instead, this fails: a restore can then hand MLX the mapped bytes
/// and skip the copy (`ssd_restore/copy_into_mlx` in benches/engine.rs measures it).
#[test]
fn mlx_copies_every_buffer_it_is_given() {
    let (same, kept) = managed_buffer_is_wrapped();
    println!(
        "{} backend: managed buffer wrapped in place: {same}, deleter deferred: {kept}",
        engine::runtime::backend()
    );
    if engine::runtime::backend() == "cpu" {
        assert!(
            !same && !kept,
            "MLX's CPU backend now wraps a given buffer (same pointer: {same}, deleter \
             deferred: {kept}): restore SSD entries without the copy"
        );
    }
}
