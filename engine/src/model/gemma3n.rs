//! `gemma3n` (Gemma 3n) read for text as mlx-lm 0.32.2's `gemma3n.Model` runs it: the text
//! model is `text_config`, its tensors under `model.language_model.` (the vision and audio
//! towers and embedders dropped, as its sanitize pops them).
//!
//!   h0 = embed(ids) · √H;  pli = (norm(proj(h0) · H^-½) + embed_pl(ids) · √Hpl) · 2^-½
//!   x = [h0, altup_proj_k(h0) …], streams 1.. rescaled to h0's RMS      (AltUp, K streams)
//!   for each layer i:  x = layer_i(x, pli[:, :, i])          (gemma3n/layer.rs)
//!   x[1..] = unembed_k(x[k]), rescaled to x[0]'s RMS;  h = mean over the streams
//!   logits = softcap(embed.T · norm(h))
//!
//! Sliding layers attend within `sliding_window` (a rotating cache), full ones fully; the
//! last `num_kv_shared_layers` keep no cache and read the K/V of the last earlier layer of
//! their kind. All layers rotate from the offset of the first cache before the step.
//! Without a cache (training's pass-through caches: mlx-lm's `model(inputs)`, cache None)
//! nothing is shared: every layer projects its own K/V, as mlx-lm's attention does there.
//! LoRA attaches to every linear of a block but AltUp's coefficients (plain arrays here; mlx-lm
//! reads their weights); segmented training carries the streams and reads the per-layer
//! inputs made once from the ids.

mod layer;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, maximum, select, stack};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::layers::{softcap, Embedding, Linear, RmsNorm};
use super::{Carried, LanguageModel, Layered};
use crate::cache::none::PassThrough;
use crate::cache::{kv_of, Cache, Kv};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// `gemma3n.TextConfig` (every field required, as mlx-lm's dataclass has them).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma3nArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    /// One width, or one per layer.
    pub intermediate_size: Value,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub num_kv_shared_layers: i32,
    pub vocab_size_per_layer_input: i32,
    pub sliding_window: i32,
    pub rope_local_base_freq: f32,
    pub rope_theta: f32,
    pub final_logit_softcapping: Option<f32>,
    pub layer_types: Vec<String>,
    pub activation_sparsity_pattern: Option<Vec<f64>>,
    pub hidden_size_per_layer_input: i32,
    pub altup_num_inputs: i32,
    pub altup_coef_clip: Option<f32>,
    pub altup_correct_scale: bool,
    pub altup_active_idx: i32,
    pub laurel_rank: i32,
}

impl Gemma3nArgs {
    fn intermediate(&self, i: usize) -> Result<i32, LoadError> {
        let v = match &self.intermediate_size {
            Value::Array(per_layer) => per_layer.get(i),
            one => Some(one),
        };
        v.and_then(Value::as_i64).map(|n| n as i32).ok_or_else(|| {
            LoadError::Unsupported(format!("gemma3n: no intermediate_size for layer {i}"))
        })
    }
}

pub struct Gemma3n {
    a: Gemma3nArgs,
    embed: Embedding,
    embed_per_layer: Embedding,
    per_layer_model_projection: Linear,
    per_layer_projection_norm: RmsNorm,
    altup_projections: Vec<Linear>,
    altup_unembed_projections: Vec<Linear>,
    norm: RmsNorm,
    layers: Vec<layer::Layer>,
    /// The cache (and so the K/V) each layer reads: its own, or its owner's.
    cache_of: Vec<usize>,
    first_shared: usize,
}

/// The RMS over the last axis, as mlx-lm writes it: `mean(x**2, -1, keepdims) ** 0.5`.
fn rms(x: &Array) -> R<Array> {
    x.power(weak(2.0, x)?)?
        .mean_axis(-1, true)?
        .power(weak(0.5, x)?)
}

/// `h[1:] = h[1:] * (target / maximum(mags, finfo(dtype).min))`.
fn rescale(h: &Array, target: &Array, dtype: Dtype) -> R<Array> {
    let rest = h.index(1..);
    let floor = match dtype {
        Dtype::Bfloat16 => -3.3895313892515355e38,
        Dtype::Float16 => -65504.0,
        _ => f32::MIN as f64,
    };
    let mags = rms(&rest)?;
    let scaled = rest.multiply(target.divide(maximum(&mags, weak(floor, &mags)?)?)?)?;
    concatenate(&[h.index(0..1), scaled], 0)
}

impl Gemma3n {
    fn per_layer_inputs(&self, ids: &Array, h: &Array) -> R<Array> {
        let (a, shape) = (&self.a, ids.shape().to_vec());
        let n = a.num_hidden_layers;
        let hpl = a.hidden_size_per_layer_input;
        let known = ids.lt(Array::from_int(a.vocab_size_per_layer_input))?;
        let tokens = select(&known, ids, Array::from_int(0).as_dtype(ids.dtype())?)?;
        let rows = self.embed_per_layer.forward(&tokens)?;
        let rows = rows.multiply(weak((hpl as f64).sqrt(), &rows)?)?;
        let rows = rows.reshape(&[shape[0], shape[1], n, hpl])?;
        let proj = self.per_layer_model_projection.forward(h)?;
        let proj = proj.multiply(weak((a.hidden_size as f64).powf(-0.5), &proj)?)?;
        let proj = proj.reshape(&[shape[0], shape[1], n, hpl])?;
        let proj = self.per_layer_projection_norm.forward(&proj)?;
        let sum = proj.add(&rows)?;
        sum.multiply(weak(2f64.powf(-0.5), &sum)?)
    }

    /// The scaled embedding h0 = embed(ids) · √H.
    fn embed_scaled(&self, ids: &Array) -> R<Array> {
        let h0 = self.embed.forward(ids)?;
        h0.multiply(weak((self.a.hidden_size as f64).sqrt(), &h0)?)
    }

    /// The AltUp streams [K, B, L, H] from h0 (stream 0 is h0 itself).
    fn streams(&self, h0: &Array) -> R<Array> {
        let target = rms(h0)?;
        let mut streams = vec![h0.clone()];
        for p in &self.altup_projections {
            streams.push(p.forward(h0)?);
        }
        rescale(&stack(&streams, 0)?, &target, h0.dtype())
    }

    /// The streams unembedded, averaged, normed → logits (softcapped).
    fn head(&self, x: &Array) -> R<Array> {
        let target = rms(&x.index(0))?;
        let mut streams = vec![x.index(0)];
        for (k, p) in self.altup_unembed_projections.iter().enumerate() {
            streams.push(p.forward(&x.index(k as i32 + 1))?);
        }
        let x = rescale(&stack(&streams, 0)?, &target, x.dtype())?;
        let h = x.mean_axis(0, None)?;
        let out = self.embed.as_linear(&self.norm.forward(&h)?)?;
        match self.a.final_logit_softcapping {
            Some(cap) => softcap(&out, cap),
            None => Ok(out),
        }
    }

    /// Blocks `range` of the cache-less forward (mlx-lm's `model(inputs)`: no layer shares,
    /// each projects its own K/V), over the streams `x` and the per-layer inputs `pli`.
    fn run_cacheless(&self, x: &Array, pli: &Array, range: std::ops::Range<usize>) -> R<Array> {
        let none = PassThrough;
        let l = x.shape()[2];
        let (global, local) = (
            none.make_mask(l, None)?,
            none.make_mask(l, Some(self.a.sliding_window))?,
        );
        let offset = none.rope_offset();
        let mut x = x.clone();
        for i in range {
            let layer = &self.layers[i];
            let step = layer::Step {
                mask: if layer.sliding { &local } else { &global },
                cache: None,
                shared: None,
                per_layer_input: &pli.index((.., .., i as i32, ..)),
                offset: &offset,
            };
            x = layer.forward(&x, step)?.0;
        }
        Ok(x)
    }

    fn run(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        let a = &self.a;
        let h0 = self.embed_scaled(ids)?;
        let pli = self.per_layer_inputs(ids, &h0)?;
        let x = self.streams(&h0)?;
        // Training's pass-through caches: mlx-lm's cache None, where the KV-shared layers
        // project their own K/V.
        let cacheless = caches.iter().all(|c| c.is_pass_through());
        if cacheless && !plant::is(Defect::Gemma3nSharedKvWithoutCache) {
            let x = self.run_cacheless(&x, &pli, 0..self.layers.len())?;
            return self.head(&x);
        }
        let l = ids.shape()[1];
        let first_of = |sliding: bool| self.layers.iter().position(|x| x.sliding == sliding);
        let mask_of = |caches: &[Box<dyn Cache>], sliding: bool| -> R<crate::cache::Mask> {
            let i = first_of(sliding).unwrap_or(0);
            let window = sliding.then_some(a.sliding_window);
            caches[self.cache_of[i]].make_mask(l, window)
        };
        let (global, local) = (mask_of(caches, false)?, mask_of(caches, true)?);
        let mut x = x;
        let offset = caches[0].rope_offset();
        let mut lent: Vec<Option<Kv>> = vec![None; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let owner = self.cache_of[i];
            let shared = (i >= self.first_shared)
                .then(|| lent[owner].as_ref())
                .flatten();
            let cache = match i < self.first_shared {
                true => Some(kv_of(caches[owner].as_mut())?),
                false => None,
            };
            let step = layer::Step {
                mask: if layer.sliding { &local } else { &global },
                cache,
                shared,
                per_layer_input: &pli.index((.., .., i as i32, ..)),
                offset: &offset,
            };
            let (next, kv) = layer.forward(&x, step)?;
            x = next;
            if i < self.first_shared {
                lent[i] = Some(kv);
            }
        }
        self.head(&x)
    }
}

/// Segmented training: the streams [K, B, L, H] cross each boundary; the per-layer inputs
/// are made once from the ids and h0 (stream 0 of the first boundary) and read by every
/// segment; the blocks run cache-less, as the whole step's forward does.
impl Layered for Gemma3n {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.streams(&self.embed_scaled(ids)?)
    }

    fn run_blocks(&self, _h: &Array, _range: std::ops::Range<usize>) -> R<Array> {
        Err(Exception::custom(
            "gemma3n blocks read per-layer inputs: run them with run_carried",
        ))
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head(h)
    }

    fn carried(&self) -> Option<&dyn Carried> {
        Some(self)
    }
}

impl Carried for Gemma3n {
    fn side_inputs(&self, ids: &Array, h0: &Array) -> R<Vec<Array>> {
        Ok(vec![self.per_layer_inputs(ids, &h0.index(0))?])
    }

    fn carried_at(&self, _b: usize) -> usize {
        0
    }

    fn run_carried(
        &self,
        h: &Array,
        _carried: &[Array],
        side: &[Array],
        range: std::ops::Range<usize>,
    ) -> R<(Array, Vec<Array>)> {
        let pli = side
            .first()
            .ok_or_else(|| Exception::custom("gemma3n blocks need the per-layer inputs"))?;
        Ok((self.run_cacheless(h, pli, range)?, Vec::new()))
    }
}

impl LanguageModel for Gemma3n {
    fn model_type(&self) -> &str {
        "gemma3n"
    }

    fn activation_dtype(&self) -> Dtype {
        self.embed.output_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.embed.rows()
    }

    /// mlx-lm's `make_cache`: one per layer before the shared ones.
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        let window = self.a.sliding_window;
        (self.layers[..self.first_shared].iter())
            .map(|l| super::layers::layer_cache(!l.sliding, window))
            .collect()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> R<Array> {
        self.run(ids, caches)
    }

    /// Every block's linears under mlx-lm's names (`model.language_model.layers.{i}.…`).
    fn linears(&self) -> Vec<(String, &Linear)> {
        let per_layer = self.layers.iter().enumerate().map(|(i, l)| {
            let named = l.linears().into_iter();
            named.map(move |(n, lin)| (format!("model.language_model.layers.{i}.{n}"), lin))
        });
        per_layer.flatten().collect()
    }

    fn as_layered(&self) -> Option<&dyn Layered> {
        Some(self)
    }
}

/// Which cache each layer reads: its own before `first_shared`, else the last earlier
/// layer of its kind.
fn cache_map(types: &[String], first_shared: usize) -> Result<Vec<usize>, LoadError> {
    let last_of = |kind: &str| types[..first_shared].iter().rposition(|t| t == kind);
    (0..types.len())
        .map(|i| match i < first_shared {
            true => Ok(i),
            false => last_of(&types[i]).ok_or_else(|| {
                LoadError::Unsupported(format!(
                    "gemma3n: shared layer {i} ({}) has no earlier layer of its kind",
                    types[i]
                ))
            }),
        })
        .collect()
}

/// Loads the text model of a `gemma3n` checkpoint.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    let Some(text) = config.raw.get("text_config") else {
        return Err(LoadError::Config {
            path: config.path.clone(),
            message: "gemma3n: the language model's settings are read from `text_config`".into(),
        });
    };
    let a: Gemma3nArgs = serde_json::from_value(text.clone()).map_err(|e| LoadError::Config {
        path: config.path.clone(),
        message: format!("text_config: {e}"),
    })?;
    w.set_quantization(config.quantization.clone());
    const TOWERS: [&str; 4] = [
        "vision_tower.",
        "audio_tower.",
        "embed_audio.",
        "embed_vision.",
    ];
    w.rename(|n| {
        let rest = n.strip_prefix("model.")?;
        match TOWERS.iter().any(|t| rest.starts_with(t)) {
            true => None,
            false => Some(n.to_owned()),
        }
    });
    let n = a.num_hidden_layers;
    let first_shared = (n - a.num_kv_shared_layers) as usize;
    let cache_of = cache_map(&a.layer_types, first_shared)?;
    let p = "model.language_model";
    let (h, hpl) = (a.hidden_size, a.hidden_size_per_layer_input);
    let lin = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.{name}"), false, out_in)
    };
    let embed = Embedding::load(&mut w, &format!("{p}.embed_tokens"), [a.vocab_size, h])?;
    let embed_per_layer = Embedding::load(
        &mut w,
        &format!("{p}.embed_tokens_per_layer"),
        [a.vocab_size_per_layer_input, n * hpl],
    )?;
    let layers = (0..n as usize)
        .map(|i| layer::load(&mut w, &format!("{p}.layers.{i}"), &a, i))
        .collect::<Result<Vec<_>, _>>()?;
    let k = a.altup_num_inputs;
    let model = Gemma3n {
        per_layer_model_projection: lin(&mut w, "per_layer_model_projection", [n * hpl, h])?,
        per_layer_projection_norm: RmsNorm::load(
            &mut w,
            &format!("{p}.per_layer_projection_norm"),
            hpl,
            a.rms_norm_eps,
        )?,
        altup_projections: (0..k - 1)
            .map(|j| lin(&mut w, &format!("altup_projections.{j}"), [h, h]))
            .collect::<Result<_, _>>()?,
        altup_unembed_projections: (0..k - 1)
            .map(|j| lin(&mut w, &format!("altup_unembed_projections.{j}"), [h, h]))
            .collect::<Result<_, _>>()?,
        norm: RmsNorm::load(&mut w, &format!("{p}.norm"), h, a.rms_norm_eps)?,
        embed,
        embed_per_layer,
        layers,
        cache_of,
        first_shared,
        a,
    };
    w.ensure_consumed("gemma3n", |_| false)?;
    Ok(Box::new(model))
}
