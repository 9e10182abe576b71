//! `granitemoehybrid` (IBM Granite 4.0 hybrids) as mlx-lm 0.32.2 implements it: the plain
//! pre-norm decoder with Granite's multipliers, each layer's mixer by `layer_types` —
//! `mamba` (ssm.rs's Mamba-2 mixer: D cast to x, the plain gated norm) or `attention`
//! (GQA, scale `attention_multiplier`, RoPE unless `position_embedding_type` is `nope`):
//!
//!   h = embed(ids) · embedding_multiplier
//!   each layer:  h = h + mixer(input_layernorm(h)) · residual_multiplier
//!                h = h + ffn(post_attention_layernorm(h)) · residual_multiplier
//!   logits = head(norm(h)) / logits_scaling
//!
//! The feed-forward is a SwiGLU (`mlp`), or with `num_local_experts` the sparse block (top k
//! logits by `argpartition`, softmax over them, SwitchGLU experts) plus the shared MLP
//! (`shared_mlp`: one `input_linear` whose output halves are gate and up). mlx-lm's
//! sanitize: conv kernels moved, HF's fused expert `input_linear` split into gate and up
//! (and `output_linear` as down), a dense checkpoint's `shared_mlp` read as `mlp`, a tied
//! `lm_head` dropped.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{
    dims_of, Decoder, EmbedScale, FeedForward, Mixer, NamedAttention, Residual, Style,
};
use super::layers::{swiglu, Attention, Glu, Linear, Mlp, Rope};
use super::mamba2::sanitize_conv;
use super::moe::{unfuse_experts, MoeDims, Router, SparseMoe, SwitchLinear, EXPERT_NAMES};
use super::moe_family::check_top_k;
use super::shard::Part;
use super::ssm::{GatedNorm, Mamba2Mixer, SsmShape};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn default_limit() -> (f64, f64) {
    (0.001, 100.0)
}

fn rope() -> String {
    "rope".into()
}

fn ten_k() -> f32 {
    10_000.0
}

fn yes() -> bool {
    true
}

/// mlx-lm's `granitemoehybrid.ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct GraniteArgs {
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub max_position_embeddings: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub attention_bias: bool,
    pub embedding_multiplier: f32,
    pub attention_multiplier: f32,
    pub logits_scaling: f32,
    pub residual_multiplier: f32,
    pub layer_types: Vec<String>,
    pub rms_norm_eps: f32,
    pub num_local_experts: Option<i32>,
    pub num_experts_per_tok: Option<i32>,
    pub shared_intermediate_size: Option<i32>,
    pub mamba_n_heads: Option<i32>,
    pub mamba_d_head: Option<i32>,
    pub mamba_proj_bias: Option<bool>,
    pub mamba_d_state: Option<i32>,
    pub mamba_d_conv: Option<i32>,
    pub mamba_n_groups: Option<i32>,
    pub mamba_conv_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "rope")]
    pub position_embedding_type: String,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_limit")]
    pub time_step_limit: (f64, f64),
    #[serde(default = "ten_k")]
    pub rope_theta: f32,
    pub rope_parameters: Option<Value>,
}

impl GraniteArgs {
    fn use_moe(&self) -> bool {
        self.num_local_experts.is_some_and(|n| n > 0)
    }

    fn theta(&self) -> f32 {
        let nested = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"));
        nested
            .and_then(Value::as_f64)
            .map_or(self.rope_theta, |t| t as f32)
    }

    fn ssm(&self) -> Result<SsmShape, LoadError> {
        let need = |v: Option<i32>, f: &str| {
            v.ok_or_else(|| {
                LoadError::Unsupported(format!("granitemoehybrid: mamba layers need `{f}`"))
            })
        };
        Ok(SsmShape {
            hidden: self.hidden_size,
            heads: need(self.mamba_n_heads, "mamba_n_heads")?,
            head_dim: need(self.mamba_d_head, "mamba_d_head")?,
            groups: need(self.mamba_n_groups, "mamba_n_groups")?,
            state: need(self.mamba_d_state, "mamba_d_state")?,
            conv_kernel: need(self.mamba_d_conv, "mamba_d_conv")?,
            use_bias: self.mamba_proj_bias.unwrap_or(false),
            use_conv_bias: self.mamba_conv_bias.unwrap_or(false),
            eps: self.rms_norm_eps,
            limits: (self.time_step_limit.0 as f32, self.time_step_limit.1 as f32),
            out_bias: self.mamba_proj_bias.unwrap_or(false),
            norm: GatedNorm::AfterGate,
            cast_d: true,
            scan_lengths: true,
        })
    }
}

fn not_sharded(at: &str) -> LoadError {
    LoadError::Unsupported(format!("{at}: granitemoehybrid is not split across ranks"))
}

/// The sparse block and the shared MLP beside it.
struct GraniteMoe {
    moe: SparseMoe,
    shared_in: Linear,
    shared_out: Linear,
}

impl FeedForward for GraniteMoe {
    fn forward(&self, x: &Array) -> R<Array> {
        let (inds, gates) = self.moe.router.route(x)?;
        let y = self.moe.experts.forward(x, &inds)?;
        let moe = y.multiply(gates.expand_dims(-1)?)?.sum_axis(-2, false)?;
        let halves = self.shared_in.forward(x)?.split_equal(2, -1)?;
        let shared = self.shared_out.forward(&swiglu(&halves[0], &halves[1])?)?;
        moe.add(&shared)
    }

    fn linears(&self, _module: &str) -> Vec<(String, &Linear)> {
        vec![
            (
                "block_sparse_moe.router.layer".into(),
                &self.moe.router.gate,
            ),
            ("shared_mlp.input_linear".into(), &self.shared_in),
            ("shared_mlp.output_linear".into(), &self.shared_out),
        ]
    }

    fn switches(&self, _module: &str) -> Vec<(String, &SwitchLinear)> {
        self.moe.experts.named("block_sparse_moe.switch_mlp")
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(not_sharded(prefix))
    }
}

/// mlx-lm's `sanitize` (see the module header).
fn sanitize(w: &mut Weights, a: &GraniteArgs) -> Result<(), LoadError> {
    sanitize_conv(w)?;
    let layers = a.num_hidden_layers;
    if a.use_moe() && w.contains("model.layers.0.block_sparse_moe.input_linear.weight") {
        for l in 0..layers {
            let p = format!("model.layers.{l}.block_sparse_moe");
            let (fused, down) = (
                format!("{p}.input_linear.weight"),
                format!("{p}.output_linear.weight"),
            );
            unfuse_experts(w, &p, &fused, &down)?;
        }
    } else if !a.use_moe() && w.contains("model.layers.0.shared_mlp.input_linear.weight") {
        for l in 0..layers {
            let p = format!("model.layers.{l}.shared_mlp");
            let fused = w.take(&format!("{p}.input_linear.weight"))?;
            let halves = fused
                .split_equal(2, 0)
                .map_err(|e| LoadError::Weights(format!("{p}.input_linear: {e}")))?;
            let m = format!("model.layers.{l}.mlp");
            w.insert(format!("{m}.gate_proj.weight"), halves[0].clone());
            w.insert(format!("{m}.up_proj.weight"), halves[1].clone());
            let down = w.take(&format!("{p}.output_linear.weight"))?;
            w.insert(format!("{m}.down_proj.weight"), down);
        }
    }
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    Ok(())
}

/// mlx-lm's `sanitize`, for `engine convert` (the expert stacks split as the loader reads
/// them).
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    sanitize(w, &config.parse()?)
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: GraniteArgs = config.parse()?;
    if a.layer_types.len() != a.num_hidden_layers as usize {
        return Err(LoadError::Unsupported(format!(
            "granitemoehybrid: {} layer_types for {} layers",
            a.layer_types.len(),
            a.num_hidden_layers
        )));
    }
    if let Some(t) = a
        .layer_types
        .iter()
        .find(|t| !matches!(t.as_str(), "mamba" | "attention"))
    {
        return Err(LoadError::Unsupported(format!(
            "granitemoehybrid: unknown layer type `{t}` (mamba and attention are)"
        )));
    }
    let ssm = match a.layer_types.iter().any(|t| t == "mamba") {
        true => Some(a.ssm()?),
        false => None,
    };
    if a.use_moe() {
        let experts = a.num_local_experts.unwrap_or(0);
        check_top_k(
            "granitemoehybrid",
            a.num_experts_per_tok.unwrap_or(0),
            experts,
            "num_local_experts",
        )?;
    }
    sanitize(&mut w, &a)?;
    let dims = dims_of!(a);
    let style = Style {
        residual: Residual::Scaled(a.residual_multiplier),
        embed_scale: Some(EmbedScale {
            scale: a.embedding_multiplier,
            through: None,
        }),
        logits_scaling: Some(a.logits_scaling),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        Ok(super::decoder::Built {
            mixer: mixer(w, p, &a, a.layer_types[i as usize] == "mamba", ssm)?,
            ffn: Some(feed_forward(w, p, &a)?),
            tail: None,
            borrows: None,
        })
    })
}

/// Layer `p`'s mixer: the Mamba-2 mixer, or attention.
fn mixer(
    w: &mut Weights,
    p: &str,
    a: &GraniteArgs,
    mamba: bool,
    ssm: Option<SsmShape>,
) -> Result<Box<dyn Mixer>, LoadError> {
    if let (true, Some(ssm)) = (mamba, ssm) {
        return Ok(Box::new(Mamba2Mixer::load(
            w,
            &format!("{p}.mamba"),
            "mamba",
            ssm,
        )?));
    }
    let head_dim = a.hidden_size / a.num_attention_heads;
    let lin = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.self_attn.{n}"), a.attention_bias, out_in)
    };
    let (h, q_dims, kv_dims) = (
        a.hidden_size,
        a.num_attention_heads * head_dim,
        a.num_key_value_heads * head_dim,
    );
    let rope = match a.position_embedding_type.as_str() {
        "nope" => Rope::None,
        _ => Rope::init(
            head_dim,
            a.theta(),
            false,
            None,
            Some(a.max_position_embeddings),
        )?,
    };
    let attn = Attention {
        q_proj: lin(w, "q_proj", [q_dims, h])?,
        k_proj: lin(w, "k_proj", [kv_dims, h])?,
        v_proj: lin(w, "v_proj", [kv_dims, h])?,
        o_proj: lin(w, "o_proj", [h, q_dims])?,
        q_norm: None,
        k_norm: None,
        n_heads: a.num_attention_heads,
        n_kv_heads: a.num_key_value_heads,
        scale: a.attention_multiplier,
        norm_after_transpose: false,
        rope,
    };
    let names = attn.named_linears().map(|(n, _)| n);
    Ok(Box::new(NamedAttention {
        attn,
        names,
        family: "granitemoehybrid",
    }))
}

/// Layer `p`'s feed-forward: the SwiGLU MLP, or the sparse block beside the shared MLP.
fn feed_forward(
    w: &mut Weights,
    p: &str,
    a: &GraniteArgs,
) -> Result<Box<dyn FeedForward>, LoadError> {
    if !a.use_moe() {
        return Ok(Box::new(Mlp::load(
            w,
            &format!("{p}.mlp"),
            a.mlp_bias,
            a.hidden_size,
            a.intermediate_size,
            Glu::Swiglu,
        )?));
    }
    let moe = format!("{p}.block_sparse_moe");
    let shared = format!("{p}.shared_mlp");
    let d = MoeDims {
        hidden: a.hidden_size,
        intermediate: a.intermediate_size,
        experts: a.num_local_experts.unwrap_or(0),
        top_k: a.num_experts_per_tok.unwrap_or(0),
    };
    let gate = format!("{moe}.router.layer");
    let sparse = SparseMoe::load(w, &moe, &gate, d, Router::HighTopKSoftmax, EXPERT_NAMES)?;
    let (h, width) = (a.hidden_size, a.shared_intermediate_size.unwrap_or(0));
    Ok(Box::new(GraniteMoe {
        moe: sparse,
        shared_in: Linear::load(w, &format!("{shared}.input_linear"), false, [2 * width, h])?,
        shared_out: Linear::load(w, &format!("{shared}.output_linear"), false, [h, width])?,
    }))
}
