//! `gpt_oss` (OpenAI's gpt-oss) as mlx-lm 0.32.2 implements it, on the shared decoder
//! (`decoder.rs`):
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + experts(rms_norm(h))
//!   logits = lm_head(rms_norm(h))
//!
//! - attention: q/k/v/o with biases, RoPE from `initialize_rope` (yarn in the released
//!   configs), scale 1/√head_dim, and a learned per-head attention sink passed to the fused
//!   SDPA (`sinks`: an extra logit per head in the softmax's denominator);
//! - `layer_types` alternate `sliding_attention` (a rotating cache of `sliding_window`, the
//!   windowed mask) and `full_attention` (a standard cache, the causal mask); the two masks
//!   are made once per forward from the first cache of each kind;
//! - experts: the router (a biased linear) scores every expert, the top k logits by
//!   `argpartition(g, -k)[..., -k:]`, then a softmax over those k (precise); the experts are
//!   mlx-lm's `SwitchGLU` with biases (`moe.rs`) and gpt-oss's clamped SwiGLU, compiled
//!   shapeless as mlx-lm compiles it:
//!
//!   swiglu_oai(gate, up) = (clip(up, −7, 7) + 1) · (g · σ(1.702 g)),  g = min(gate, 7)

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, clip, minimum, sigmoid, softmax_axis};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, FeedForward, Mixer, Style, Windowed};
use super::layers::{compiled_shapeless, weak, CompiledFn, Linear, Rope};
use super::moe::{SwitchGlu, SwitchLinear};
use super::moe_family::check_top_k;
use super::shard::{slice, Part, Split};
use super::{rope, sdpa};
use crate::cache::{kv_of, AttentionCache, Cache, Mask};
use crate::load::config::{ModelConfig, RopeParameters, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// mlx-lm's `gpt_oss.ModelArgs`, its defaults (gpt-oss-120b's) included.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct GptOssArgs {
    pub num_hidden_layers: i32,
    pub num_local_experts: i32,
    pub num_experts_per_tok: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub head_dim: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub sliding_window: i32,
    /// None: from rope_parameters (transformers 5), else mlx-lm's 150000.
    pub rope_theta: Option<f32>,
    pub rope_scaling: Option<RopeScaling>,
    /// transformers 5 (mlx-lm 0.32.2 ignores it; we read it as transformers does).
    pub rope_parameters: Option<RopeParameters>,
    pub layer_types: Option<Vec<String>>,
    /// Not read by mlx-lm, which hard-codes 7.0; any other value is refused.
    pub swiglu_limit: Option<f64>,
}

impl Default for GptOssArgs {
    fn default() -> Self {
        GptOssArgs {
            num_hidden_layers: 36,
            num_local_experts: 128,
            num_experts_per_tok: 4,
            vocab_size: 201_088,
            rms_norm_eps: 1e-5,
            hidden_size: 2880,
            intermediate_size: 2880,
            head_dim: 64,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            sliding_window: 128,
            rope_theta: None,
            rope_scaling: None,
            rope_parameters: None,
            layer_types: None,
            swiglu_limit: None,
        }
    }
}

/// gpt-oss's SwiGLU constants (mlx-lm's `SwigluOAI` defaults, never read from the config).
const SWIGLU_ALPHA: f32 = 1.702;
const SWIGLU_LIMIT: f32 = 7.0;

impl GptOssArgs {
    /// Whether each layer attends within the window, from `layer_types` (mlx-lm's default:
    /// sliding, full, repeated). Both kinds must be present (mlx-lm looks up the first of
    /// each) and one type per layer (mlx-lm would silently drop the layers past the list).
    fn sliding_layers(&self) -> Result<Vec<bool>, LoadError> {
        let types = self.layer_types.clone().unwrap_or_else(|| {
            ["sliding_attention", "full_attention"]
                .repeat((self.num_hidden_layers / 2) as usize)
                .into_iter()
                .map(String::from)
                .collect()
        });
        if types.len() != self.num_hidden_layers as usize {
            return Err(LoadError::Unsupported(format!(
                "gpt_oss: layer_types lists {} layers, num_hidden_layers is {}",
                types.len(),
                self.num_hidden_layers
            )));
        }
        let sliding = types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(LoadError::Unsupported(format!(
                    "gpt_oss: layer type `{other}` (supported: sliding_attention, full_attention)"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !sliding.contains(&true) || !sliding.contains(&false) {
            return Err(LoadError::Unsupported(
                "gpt_oss needs both a sliding_attention and a full_attention layer (mlx-lm \
                 looks up the first of each)"
                    .into(),
            ));
        }
        Ok(sliding)
    }

    fn rope(&self) -> Result<Rope, LoadError> {
        let (theta, scaling) = rope::settings(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            "full_attention",
            150_000.0,
        );
        Rope::new(self.head_dim, theta, false, scaling.as_ref())
    }

    fn check(&self) -> Result<(), LoadError> {
        check_top_k(
            "gpt_oss",
            self.num_experts_per_tok,
            self.num_local_experts,
            "num_local_experts",
        )?;
        if let Some(limit) = self.swiglu_limit.filter(|l| *l != SWIGLU_LIMIT as f64) {
            return Err(LoadError::Unsupported(format!(
                "gpt_oss with swiglu_limit {limit}: mlx-lm's gpt_oss clamps at 7.0 whatever \
                 the config says, so another limit is refused rather than run differently"
            )));
        }
        if self.sliding_window <= 0 {
            return Err(LoadError::Unsupported(format!(
                "gpt_oss: sliding_window must be positive, got {}",
                self.sliding_window
            )));
        }
        Ok(())
    }
}

/// mlx-lm's compiled `swiglu_oai(gate, x)`; its Python scalars are weak (x's dtype).
fn swiglu_oai_graph(args: &[Array]) -> R<Vec<Array>> {
    let (gate, x) = (&args[0], &args[1]);
    let c = |v: f32| Array::from_f32(v).as_dtype(x.dtype());
    let gate = minimum(gate, c(SWIGLU_LIMIT)?)?;
    let x = clip(x, (&c(-SWIGLU_LIMIT)?, &c(SWIGLU_LIMIT)?))?;
    let glu = gate.multiply(sigmoid(&c(SWIGLU_ALPHA)?.multiply(&gate)?)?)?;
    Ok(vec![x.add(c(1.0)?)?.multiply(&glu)?])
}

thread_local! {
    static SWIGLU_OAI: std::cell::RefCell<CompiledFn> =
        std::cell::RefCell::new(compiled_shapeless(swiglu_oai_graph));
}

/// gpt-oss's clamped SwiGLU, one compiled graph.
pub fn swiglu_oai(gate: &Array, x: &Array) -> R<Array> {
    SWIGLU_OAI.with_borrow_mut(|f| Ok(f(&[gate.clone(), x.clone()])?.remove(0)))
}

/// `AttentionBlock`: biased projections, RoPE, SDPA with the per-head sinks.
struct SinkAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    sinks: Array,
    head_dim: i32,
    scale: f32,
    rope: Rope,
}

impl SinkAttention {
    fn load(w: &mut Weights, p: &str, a: &GptOssArgs) -> Result<Self, LoadError> {
        let proj = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
            Linear::load(w, &format!("{p}.self_attn.{name}"), true, out_in)
        };
        let h = a.hidden_size;
        let q_dims = a.num_attention_heads * a.head_dim;
        let kv_dims = a.num_key_value_heads * a.head_dim;
        Ok(SinkAttention {
            q_proj: proj(w, "q_proj", [q_dims, h])?,
            k_proj: proj(w, "k_proj", [kv_dims, h])?,
            v_proj: proj(w, "v_proj", [kv_dims, h])?,
            o_proj: proj(w, "o_proj", [h, q_dims])?,
            sinks: w.take_shaped(&format!("{p}.self_attn.sinks"), &[a.num_attention_heads])?,
            head_dim: a.head_dim,
            // `1 / math.sqrt(head_dim)` in Python floats.
            scale: (1.0 / (a.head_dim as f64).sqrt()) as f32,
            rope: a.rope()?,
        })
    }

    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn AttentionCache) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = |t: Array| t.reshape(&[b, l, -1, self.head_dim])?.swap_axes(1, 2);
        let q = heads(self.q_proj.forward(x)?)?;
        let k = heads(self.k_proj.forward(x)?)?;
        let v = heads(self.v_proj.forward(x)?)?;
        let offset = cache.rope_offset();
        let q = self.rope.forward(&q, &offset)?;
        let k = self.rope.forward(&k, &offset)?;
        let kv = cache.update_and_fetch(k, v)?;
        let sinks = (!plant::is(Defect::GptOssSinksDropped)).then_some(&self.sinks);
        let out = sdpa::attend_with_sinks(&q, &kv, self.scale, mask, sinks)?;
        self.o_proj
            .forward(&out.swap_axes(1, 2)?.reshape(&[b, l, -1])?)
    }

    /// `gpt_oss.Model.shard`'s attention: q/k/v by columns, o by rows, and this rank's
    /// heads' sinks (`sinks[h·r : h·(r+1)]`, h the heads per rank). Heads are counted from
    /// the projections (the forward reshapes with -1).
    fn shard(&mut self, part: Part, attn: &str) -> Result<(), LoadError> {
        let heads = self.sinks.shape()[0];
        let kv_heads = self.k_proj.weight.shape()[0] / self.head_dim;
        let n = part.size as i32;
        if heads % n != 0 || kv_heads % n != 0 {
            return Err(LoadError::Unsupported(format!(
                "{attn}: {heads} query and {kv_heads} KV heads do not split over {n} ranks \
                 (tensor parallel needs both to divide by the rank count)"
            )));
        }
        for (l, name) in [
            (&mut self.q_proj, "q_proj"),
            (&mut self.k_proj, "k_proj"),
            (&mut self.v_proj, "v_proj"),
        ] {
            l.shard(Split::Columns, part, &format!("{attn}.{name}"))?;
        }
        self.o_proj
            .shard(Split::Rows, part, &format!("{attn}.o_proj"))?;
        self.sinks = slice(&self.sinks, 0, part, &format!("{attn}.sinks"))?;
        Ok(())
    }
}

/// `MLPBlock`: the router's top k logits, softmaxed, weigh the k experts' outputs.
struct Experts {
    router: Linear,
    experts: SwitchGlu,
    top_k: i32,
}

impl Experts {
    fn load(w: &mut Weights, p: &str, a: &GptOssArgs) -> Result<Self, LoadError> {
        let mlp = format!("{p}.mlp");
        let proj = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
            let [out, inp] = out_in;
            let shape = [a.num_local_experts, out, inp];
            SwitchLinear::load(w, &format!("{mlp}.experts.{name}"), true, shape)
        };
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let up_proj = proj(w, "up_proj", [inter, h])?;
        let down_proj = proj(w, "down_proj", [h, inter])?;
        let gate_proj = proj(w, "gate_proj", [inter, h])?;
        let router_shape = [a.num_local_experts, h];
        Ok(Experts {
            router: Linear::load(w, &format!("{mlp}.router"), true, router_shape)?,
            experts: SwitchGlu {
                gate_proj,
                up_proj,
                down_proj,
            },
            top_k: a.num_experts_per_tok,
        })
    }

    fn forward(&self, x: &Array) -> R<Array> {
        let g = self.router.forward(x)?;
        let (k, n) = (self.top_k, *g.shape().last().unwrap_or(&0));
        // The planted top-k defect of the MoE families applies here too.
        let off = plant::is(Defect::MoeTopKOffByOne) as i32;
        let part = argpartition_axis(&g, -k, -1)?;
        // mlx-lm's mlx_topk stops the indices' gradient (they are integers).
        let inds = mlx_rs::stop_gradient(part.index((Ellipsis, (n - k - off)..(n - off))))?;
        let weights = softmax_axis(g.take_along_axis(&inds, -1)?, -1, true)?;
        let y = self.experts.forward_with(x, &inds, swiglu_oai)?;
        let y = y.multiply(weights.expand_dims(-1)?)?.sum_axis(-2, false)?;
        self.experts.sum_partials(y)
    }

    /// `gpt_oss.Model.shard`'s experts: narrowed in place (`moe/shard.rs`), the router
    /// whole. Every rank adds the down projection's bias before the block's `all_sum`, so
    /// mlx-lm divides it by N (`bias /= N`); N adds of bias/N round unlike one add of the
    /// bias, so the port divides exactly as mlx-lm does.
    fn shard(&mut self, part: Part, mlp: &str) -> Result<(), LoadError> {
        self.experts.shard(part, &format!("{mlp}.experts"))?;
        if let Some(b) = &self.experts.down_proj.bias {
            // `bias /= N`: a Python int, weak (the bias's dtype).
            let divided = weak(part.size as f64, b).and_then(|n| b.divide(&n));
            let divided = divided.map_err(|e| {
                LoadError::Weights(format!("sharding `{mlp}.experts.down_proj.bias`: {e}"))
            })?;
            self.experts.down_proj.bias = Some(divided);
        }
        Ok(())
    }
}

/// `TransformerBlock`'s attention as the decoder's mixer (a sliding layer's wrapped in
/// `Windowed`).
impl Mixer for SinkAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        SinkAttention::forward(self, x, mask, kv_of(cache)?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ]
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        SinkAttention::shard(self, part, &format!("{layer}.self_attn"))
    }
}

/// `MLPBlock` as the decoder's feed-forward (`mlp`): the router, and the experts stacked
/// under `mlp.experts`.
impl FeedForward for Experts {
    fn forward(&self, x: &Array) -> R<Array> {
        Experts::forward(self, x)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        vec![(format!("{module}.router"), &self.router)]
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        let e = &self.experts;
        [
            ("gate_proj", &e.gate_proj),
            ("up_proj", &e.up_proj),
            ("down_proj", &e.down_proj),
        ]
        .map(|(n, l)| (format!("{module}.experts.{n}"), l))
        .into()
    }

    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        Experts::shard(self, part, prefix)
    }
}

/// A Hugging Face gpt-oss checkpoint (fused, interleaved `gate_up_proj` experts, mxfp4
/// `_blocks` / `_scales`) is refused: mlx-lm's `sanitize` converts it at load, we read the
/// converted layout. Its first tensor of that layout, if any.
fn hf_layout(w: &Weights) -> Option<String> {
    let names = w.remaining();
    if names.iter().any(|n| n.contains("gate_proj.weight")) {
        return None; // mlx-lm: "already sanitized"
    }
    names
        .into_iter()
        .find(|n| n.contains("gate_up_proj") || n.ends_with("_blocks"))
}

/// The model: mlx-lm's checks, then the decoder with gpt-oss's layers — sink attention
/// (windowed on the `sliding_attention` layers: a rotating cache of `sliding_window`, the
/// windowed mask) and the experts; its own lm_head (never tied).
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: GptOssArgs = config.parse()?;
    a.check()?;
    if let Some(name) = hf_layout(&w) {
        return Err(LoadError::Unsupported(format!(
            "gpt_oss: `{name}` is Hugging Face's layout (fused, interleaved gate_up_proj \
             experts, mxfp4 as _blocks/_scales), which mlx-lm's sanitize rewrites at load; \
             the engine reads the converted layout. Convert it once with `mlx_lm.convert \
             --hf-path <dir or repo> --mlx-path <out>` (`engine convert` does not handle \
             gpt_oss yet), or use an MLX conversion such as mlx-community's gpt-oss models"
        )));
    }
    let sliding = a.sliding_layers()?;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "mlp",
    };
    let style = Style::default();
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let attn = SinkAttention::load(w, p, &a)?;
        let mixer: Box<dyn Mixer> = match sliding[i as usize] {
            true => Box::new(Windowed {
                mixer: attn,
                window: a.sliding_window,
            }),
            false => Box::new(attn),
        };
        Ok((mixer, Box::new(Experts::load(w, p, &a)?)))
    })
}
