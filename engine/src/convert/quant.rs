//! Quantization as mlx_lm.convert does it: the modes and their default (group size, bits),
//! mlx-lm's mixed-bit recipes (`mixed_quant_predicate_builder`), and MLX's own
//! `mx.quantize` reached through mlx-c (mlx-rs's wrapper fixes the mode to affine).

use std::ffi::CString;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};
use serde_json::{json, Value};

/// `--q-mode` choices.
pub const MODES: &[&str] = &["affine", "mxfp4", "nvfp4", "mxfp8"];

/// `--quant-predicate` choices.
pub const RECIPES: &[&str] = &["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"];

/// `quantize_model`'s defaults for a mode: (group size, bits).
pub fn mode_defaults(mode: &str) -> (i32, i32) {
    match mode {
        "mxfp4" => (32, 4),
        "nvfp4" => (16, 4),
        "mxfp8" => (32, 8),
        _ => (64, 4),
    }
}

/// How one module is quantized: `group_size` None is mlx-lm's `None` (the recipe got no
/// `--q-group-size`): the config says `null` and MLX uses the mode's default.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub group_size: Option<i32>,
    pub bits: i32,
    pub mode: String,
}

impl Params {
    /// The config entry: `{"group_size": .., "bits": .., "mode": ..}`.
    pub fn to_json(&self) -> Value {
        json!({"group_size": self.group_size, "bits": self.bits, "mode": self.mode})
    }
}

/// A mixed recipe (`mixed_quant_predicate_builder`): more bits for the first and last
/// eighth of the layers and every third in between, on `v_proj` and `down_proj`, and on
/// `lm_head`; the low bits elsewhere.
pub struct Recipe {
    low_bits: i32,
    high_bits: i32,
    group_size: Option<i32>,
    /// Which path segment holds the layer index (from the first `down_proj` path).
    layer_location: usize,
    num_layers: usize,
}

impl Recipe {
    /// `module_paths`: the model's module paths in order (to find the layer index).
    pub fn new(
        name: &str,
        group_size: Option<i32>,
        module_paths: &[String],
        num_layers: usize,
    ) -> anyhow::Result<Self> {
        let (low_bits, high_bits) = match name {
            "mixed_2_6" => (2, 6),
            "mixed_3_4" => (3, 4),
            "mixed_3_6" => (3, 6),
            "mixed_4_6" => (4, 6),
            _ => anyhow::bail!("Invalid quant recipe {name}"),
        };
        let Some(down) = module_paths.iter().find(|p| p.contains("down_proj")) else {
            anyhow::bail!("Model does not have expected keys for mixed quant.");
        };
        let segs: Vec<&str> = down.split('.').collect();
        // Python's loop leaves the index of the first digit, or the last one if none.
        let layer_location = segs
            .iter()
            .position(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .unwrap_or(segs.len() - 1);
        Ok(Recipe {
            low_bits,
            high_bits,
            group_size,
            layer_location,
            num_layers,
        })
    }

    /// The parameters for the module at `path`.
    pub fn params(&self, path: &str) -> Params {
        let segs: Vec<&str> = path.split('.').collect();
        let index: i64 = if segs.len() > self.layer_location {
            segs[self.layer_location].parse().unwrap_or(0)
        } else {
            0
        };
        let n = self.num_layers as i64;
        let more = index < n / 8 || index >= 7 * n / 8 || (index - n / 8).rem_euclid(3) == 2;
        let v = path.contains("v_proj") || path.contains("v_a_proj") || path.contains("v_b_proj");
        let high = ((v || path.contains("down_proj")) && more) || path.contains("lm_head");
        Params {
            group_size: self.group_size,
            bits: if high { self.high_bits } else { self.low_bits },
            mode: "affine".into(),
        }
    }
}

/// `mx.quantize(w, group_size, bits, mode)`: (packed weight, scales, biases) — biases only
/// for affine.
pub fn quantize(
    w: &Array,
    group_size: Option<i32>,
    bits: i32,
    mode: &str,
) -> Result<(Array, Array, Option<Array>), Exception> {
    let stream = Stream::thread_local_or_default();
    let mode_c = CString::new(mode).map_err(|e| Exception::custom(e.to_string()))?;
    let opt = |v: Option<i32>| mlx_sys::mlx_optional_int {
        value: v.unwrap_or(0),
        has_value: v.is_some(),
    };
    // SAFETY: every handle passed is live for the call; the result vector is read and
    // freed here, each array taken over by `Array::from_ptr` after a copy of its handle.
    unsafe {
        let mut res = mlx_sys::mlx_vector_array_new();
        let none = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_quantize(
            &mut res,
            w.as_ptr(),
            opt(group_size),
            opt(Some(bits)),
            mode_c.as_ptr(),
            none,
            stream.as_ptr(),
        );
        mlx_sys::mlx_array_free(none);
        if status != 0 {
            mlx_sys::mlx_vector_array_free(res);
            return Err(Exception::custom(format!(
                "mx.quantize failed (mode {mode})"
            )));
        }
        let n = mlx_sys::mlx_vector_array_size(res);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut a = mlx_sys::mlx_array_new();
            mlx_sys::mlx_vector_array_get(&mut a, res, i);
            out.push(Array::from_ptr(a));
        }
        mlx_sys::mlx_vector_array_free(res);
        let mut it = out.into_iter();
        match (it.next(), it.next(), it.next()) {
            (Some(q), Some(s), b) => Ok((q, s, b)),
            _ => Err(Exception::custom(
                "mx.quantize returned fewer than 2 arrays",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_recipe_picks_bits_as_mlx_lm() {
        let paths: Vec<String> = (0..16)
            .map(|i| format!("model.layers.{i}.mlp.down_proj"))
            .collect();
        let r = Recipe::new("mixed_3_6", Some(64), &paths, 16).unwrap();
        let bits = |p: &str| r.params(p).bits;
        assert_eq!(bits("model.layers.0.self_attn.v_proj"), 6);
        assert_eq!(bits("model.layers.2.self_attn.v_proj"), 3);
        assert_eq!(bits("model.layers.4.mlp.down_proj"), 6); // (4 - 2) % 3 == 2
        assert_eq!(bits("model.layers.14.mlp.down_proj"), 6);
        assert_eq!(bits("model.layers.4.self_attn.q_proj"), 3);
        assert_eq!(bits("lm_head"), 6);
        assert_eq!(bits("model.embed_tokens"), 3);
        assert!(Recipe::new("mixed_3_6", None, &[], 2).is_err());
    }
}
