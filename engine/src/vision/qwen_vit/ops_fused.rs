//! The tower's fused pieces as mlx-vlm runs them: the vision rotary's cos / sin,
//! `rotate_half`, the compiled `ensure_fused_sdpa` and the compiled exact gelu.

use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::model::layers::{compiled_shapeless, weak, CompiledFn};

type R<T> = Result<T, Exception>;

/// `apply_rotary_pos_emb_vision`'s cos and sin: `[1, n, 1, d]` (the angles tiled twice).
pub(super) fn vision_cos_sin(freqs: &Array) -> R<(Array, Array)> {
    let shape =
        |a: Array| -> R<Array> { ops::tile(&a.expand_dims(1)?, &[1, 1, 2])?.expand_dims(0) };
    Ok((shape(ops::cos(freqs)?)?, shape(ops::sin(freqs)?)?))
}

/// `rotate_half` (mlx-vlm's rope_utils): `[-x2, x1]` of the last axis' halves, by slices.
pub(crate) fn rotate_half(x: &Array) -> R<Array> {
    let d = *x.shape().last().unwrap();
    let x1 = x.index((Ellipsis, ..d / 2));
    let x2 = x.index((Ellipsis, d / 2..));
    ops::concatenate(&[x2.negative()?, x1], -1)
}

/// mlx-vlm's `ensure_fused_sdpa` (an `mx.compile`d function, compiled here too: compiled, the
/// SDPA's graph rounds differently by up to an ulp): the head dim zero-padded up to the first
/// of 64, 80, 128 it fits (unchanged past 128), the fused SDPA without a mask, the padding cut
/// off. `scale` is a constant of the compiled graph, as Python's float argument is.
pub(super) fn fused_sdpa(q: &Array, k: &Array, v: &Array, scale: f32) -> R<Array> {
    let d = *q.shape().last().unwrap();
    let key = (scale.to_bits(), d);
    FUSED_SDPA.with_borrow_mut(|cache| {
        let f = cache.entry(key).or_insert_with(|| {
            let mut compiled = compile(
                move |args: &[Array]| -> R<Vec<Array>> {
                    let (q, k, v) = (&args[0], &args[1], &args[2]);
                    let target = [64, 80, 128].into_iter().find(|&t| d <= t).unwrap_or(d);
                    if target == d {
                        return Ok(vec![fast::scaled_dot_product_attention(
                            q, k, v, scale, None, None,
                        )?]);
                    }
                    let mut widths = vec![(0, 0); q.ndim()];
                    *widths.last_mut().unwrap() = (0, target - d);
                    // The pad value as Python passes it (`mx.pad`'s default 0: an int the op casts).
                    let pad = |a: &Array| ops::pad(a, widths.as_slice(), Array::from_int(0), None);
                    let out = fast::scaled_dot_product_attention(
                        pad(q)?,
                        pad(k)?,
                        pad(v)?,
                        scale,
                        None,
                        None,
                    )?;
                    Ok(vec![out.index((.., .., .., ..d))])
                },
                false,
            );
            Box::new(move |args: &[Array]| compiled(args))
        });
        Ok(f(&[q.clone(), k.clone(), v.clone()])?.remove(0))
    })
}

/// `nn.gelu`'s graph: `x · (1 + erf(x / √2)) / 2`, its Python scalars weak.
fn gelu_graph(args: &[Array]) -> R<Vec<Array>> {
    let x = &args[0];
    let c = |v: f64| weak(v, x);
    let inner = ops::erf(&x.divide(c(std::f64::consts::SQRT_2)?)?)?;
    Ok(vec![x.multiply(&c(1.0)?.add(&inner)?)?.divide(c(2.0)?)?])
}

thread_local! {
    static FUSED_SDPA: std::cell::RefCell<HashMap<(u32, i32), CompiledFn>> = Default::default();
    static GELU: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new(compiled_shapeless(gelu_graph));
}

/// `nn.gelu` (exact, erf), compiled shapeless as MLX compiles it.
pub(super) fn gelu(x: &Array) -> R<Array> {
    GELU.with_borrow_mut(|f| Ok(f(std::slice::from_ref(x))?.remove(0)))
}
