//! `deepseek_v3` (and mlx-lm's aliases `kimi_k2`, `joyai_llm_flash`), `glm4_moe_lite`
//! (GLM-4.7-Flash: the same model, other defaults), `deepseek_v32` (its attention with an
//! indexer, `deepseek_v32.rs`) and `kimi_k25` (Kimi K2.5's wrapper, read for text) as mlx-lm
//! 0.32.2's deepseek_v3.py / glm4_moe_lite.py / deepseek_v32.py / kimi_k25.py build them:
//!
//!   h = embed(ids)
//!   for each layer i:  h = h + mla(rms_norm(h))                       (`mla.rs`)
//!                      h = h + ffn_i(rms_norm(h))
//!       ffn_i = MoE   if n_routed_experts and i ≥ first_k_dense_replace and i % moe_layer_freq == 0
//!             = SwiGLU of intermediate_size otherwise
//!       MoE(x) = Σ_k w_k · expert_k(x)  (+ shared_experts(x), SwiGLU of moe_intermediate · n_shared)
//!              the experts and weights from `group_expert_select` (moe.rs's `GroupedTopK`:
//!              σ scores, bias for the choice, groups, top k, renormalized, × routed_scaling_factor)
//!   logits = lm_head(rms_norm(h))       (never tied)
//!
//! mlx-lm's sanitize: per-expert tensors stacked, `kv_b_proj` split into `embed_q` /
//! `unembed_out`, and the multi-token-prediction layer dropped — deepseek_v3 drops names
//! starting `model.layers.61` (and any `rotary_emb.inv_freq`), glm4_moe_lite and deepseek_v32
//! every layer at or past `num_hidden_layers`.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{Decoder, Dims, FeedForward, Mixer};
use super::deepseek_v32::{IndexArgs, SparseMla};
use super::layers::{Glu, Linear, Mlp};
use super::mla::{split_kv_b_proj, Mla, MlaShape};
use super::moe::{combine, Gate, GroupedTopK, Router, SwitchGlu, SwitchLinear, EXPERT_NAMES};
use super::shard::{Part, Split};
use super::LanguageModel;
use crate::load::config::{ModelConfig, QuantConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

/// Which of mlx-lm's copies of the model a config is read by (their defaults and the few
/// places they differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    DeepseekV3,
    Glm4MoeLite,
    /// deepseek_v32: DeepSeek-V3's defaults, attention with an indexer (`deepseek_v32.rs`).
    DeepseekV32,
}

/// The union of `deepseek_v3.ModelArgs` and `glm4_moe_lite.ModelArgs`; a missing field takes
/// the variant's default ([`Variant::defaults`]).
#[derive(Debug, Clone, Deserialize)]
struct RawArgs {
    vocab_size: Option<i32>,
    hidden_size: Option<i32>,
    intermediate_size: Option<i32>,
    moe_intermediate_size: Option<i32>,
    num_hidden_layers: Option<i32>,
    num_attention_heads: Option<i32>,
    routed_scaling_factor: Option<f64>,
    kv_lora_rank: Option<i32>,
    qk_rope_head_dim: Option<i32>,
    v_head_dim: Option<i32>,
    qk_nope_head_dim: Option<i32>,
    topk_method: Option<String>,
    norm_topk_prob: Option<bool>,
    n_group: Option<i32>,
    topk_group: Option<i32>,
    num_experts_per_tok: Option<i32>,
    moe_layer_freq: Option<i32>,
    first_k_dense_replace: Option<i32>,
    max_position_embeddings: Option<i32>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<RopeScaling>,
    attention_bias: Option<bool>,
}

/// The settled arguments.
#[derive(Debug, Clone)]
pub struct Args {
    pub variant: Variant,
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub moe_intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub n_shared_experts: Option<i32>,
    pub n_routed_experts: Option<i32>,
    pub routed_scaling_factor: f64,
    pub kv_lora_rank: i32,
    pub q_lora_rank: Option<i32>,
    pub qk_rope_head_dim: i32,
    pub v_head_dim: i32,
    pub qk_nope_head_dim: i32,
    pub norm_topk_prob: bool,
    pub n_group: i32,
    pub topk_group: i32,
    pub num_experts_per_tok: i32,
    pub moe_layer_freq: i32,
    pub first_k_dense_replace: i32,
    pub max_position_embeddings: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub attention_bias: bool,
}

/// An optional integer as Python reads it: missing → `default`, null → None.
fn optional_int(
    v: Option<&Value>,
    default: Option<i32>,
    field: &str,
) -> Result<Option<i32>, LoadError> {
    match v {
        None => Ok(default),
        Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| LoadError::Unsupported(format!("`{field}` must be an integer or null"))),
    }
}

impl Args {
    pub fn parse(config: &ModelConfig, variant: Variant) -> Result<Self, LoadError> {
        let r: RawArgs = config.parse()?;
        let glm = variant == Variant::Glm4MoeLite;
        let pick = |v: Option<i32>, ds: i32, g: i32| v.unwrap_or(if glm { g } else { ds });
        if let Some(m) = r.topk_method.as_deref().filter(|m| *m != "noaux_tc") {
            return Err(LoadError::Unsupported(format!(
                "{}: topk_method `{m}`: mlx-lm's MoEGate supports noaux_tc only",
                config.model_type
            )));
        }
        let raw = |k: &str| config.raw.get(k);
        let experts_default = if glm { Some(64) } else { None };
        Ok(Args {
            variant,
            vocab_size: pick(r.vocab_size, 102_400, 154_880),
            hidden_size: pick(r.hidden_size, 4096, 2048),
            intermediate_size: pick(r.intermediate_size, 11_008, 10_240),
            moe_intermediate_size: pick(r.moe_intermediate_size, 1407, 1536),
            num_hidden_layers: pick(r.num_hidden_layers, 30, 47),
            num_attention_heads: pick(r.num_attention_heads, 32, 20),
            n_shared_experts: optional_int(
                raw("n_shared_experts"),
                if glm { Some(1) } else { None },
                "n_shared_experts",
            )?,
            n_routed_experts: optional_int(
                raw("n_routed_experts"),
                experts_default,
                "n_routed_experts",
            )?,
            routed_scaling_factor: r
                .routed_scaling_factor
                .unwrap_or(if glm { 1.8 } else { 1.0 }),
            kv_lora_rank: r.kv_lora_rank.unwrap_or(512),
            q_lora_rank: optional_int(
                raw("q_lora_rank"),
                Some(if glm { 768 } else { 1536 }),
                "q_lora_rank",
            )?,
            qk_rope_head_dim: r.qk_rope_head_dim.unwrap_or(64),
            v_head_dim: pick(r.v_head_dim, 128, 256),
            qk_nope_head_dim: pick(r.qk_nope_head_dim, 128, 192),
            norm_topk_prob: r.norm_topk_prob.unwrap_or(true),
            n_group: r.n_group.unwrap_or(1),
            topk_group: r.topk_group.unwrap_or(1),
            num_experts_per_tok: pick(r.num_experts_per_tok, 1, 4),
            moe_layer_freq: r.moe_layer_freq.unwrap_or(1),
            first_k_dense_replace: pick(r.first_k_dense_replace, 0, 1),
            max_position_embeddings: pick(r.max_position_embeddings, 2048, 202_752),
            rms_norm_eps: r.rms_norm_eps.unwrap_or(if glm { 1e-5 } else { 1e-6 }),
            rope_theta: r
                .rope_theta
                .unwrap_or(if glm { 1_000_000.0 } else { 10_000.0 }),
            rope_scaling: r.rope_scaling,
            attention_bias: r.attention_bias.unwrap_or(false),
        })
    }

    /// Whether layer `i` is the sparse block (`DeepseekV3DecoderLayer.__init__`).
    fn sparse(&self, i: i32) -> bool {
        self.n_routed_experts.is_some()
            && i >= self.first_k_dense_replace
            && i % self.moe_layer_freq == 0
    }

    pub fn mla_shape(&self) -> MlaShape {
        MlaShape {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            nope: self.qk_nope_head_dim,
            rope: self.qk_rope_head_dim,
            v: self.v_head_dim,
            attention_bias: self.attention_bias,
            latent_norm_eps: match self.variant {
                Variant::DeepseekV3 | Variant::DeepseekV32 => 1e-6,
                Variant::Glm4MoeLite => self.rms_norm_eps,
            },
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
            max_positions: self.max_position_embeddings,
        }
    }

    fn check(&self, model_type: &str) -> Result<(), LoadError> {
        if let Some(e) = self.n_routed_experts {
            let k = self.num_experts_per_tok;
            if k <= 0 || k > e || self.n_group <= 0 || e % self.n_group != 0 {
                return Err(LoadError::Unsupported(format!(
                    "{model_type}: {e} experts cannot be routed top {k} in {} groups",
                    self.n_group
                )));
            }
            if self.n_group > 1 && !(1..self.n_group).contains(&self.topk_group) {
                return Err(LoadError::Unsupported(format!(
                    "{model_type}: topk_group {} must be in 1..{} (mlx-lm's argpartition needs it)",
                    self.topk_group, self.n_group
                )));
            }
        }
        if self.moe_layer_freq <= 0 {
            return Err(LoadError::Unsupported(format!(
                "{model_type}: moe_layer_freq must be positive"
            )));
        }
        Ok(())
    }
}

/// A layer's feed-forward: the dense SwiGLU, or the sparse block with its shared experts.
pub enum Ffn {
    Dense(Mlp),
    Moe(MoeBlock),
}

/// `DeepseekV3MoE`: the router, the routed experts and the shared ones.
pub struct MoeBlock {
    pub router: Gate,
    pub experts: SwitchGlu,
    /// Boxed so that the block stays the size of the dense MLP (clippy's variant sizes).
    pub shared: Option<Box<Mlp>>,
}

impl Ffn {
    fn load(w: &mut Weights, p: &str, a: &Args, i: i32) -> Result<Self, LoadError> {
        let (mlp, h) = (format!("{p}.mlp"), a.hidden_size);
        let Some(experts) = a.n_routed_experts.filter(|_| a.sparse(i)) else {
            let dense = Mlp::load(w, &mlp, false, h, a.intermediate_size, Glu::Swiglu)?;
            return Ok(Ffn::Dense(dense));
        };
        // MoEGate is a plain module (`weight`, `e_score_correction_bias`), never quantized.
        let router = Gate {
            gate: Linear {
                weight: w.take_shaped(&format!("{mlp}.gate.weight"), &[experts, h])?,
                bias: None,
                quantized: None,
                lora: Default::default(),
                reduce: false,
            },
            top_k: a.num_experts_per_tok,
            kind: Router::SigmoidGroupedTopK(GroupedTopK {
                bias: w.take_shaped(&format!("{mlp}.gate.e_score_correction_bias"), &[experts])?,
                n_group: a.n_group,
                topk_group: a.topk_group,
                norm_topk_prob: a.norm_topk_prob,
                denominator_eps: a.variant == Variant::Glm4MoeLite,
                routed_scaling_factor: a.routed_scaling_factor,
            }),
        };
        let dims = (h, a.moe_intermediate_size);
        let experts = SwitchGlu::load(w, &mlp, dims, experts, EXPERT_NAMES)?;
        let shared = a
            .n_shared_experts
            .map(|n| {
                let width = a.moe_intermediate_size * n;
                Mlp::load(
                    w,
                    &format!("{mlp}.shared_experts"),
                    false,
                    h,
                    width,
                    Glu::Swiglu,
                )
                .map(Box::new)
            })
            .transpose()?;
        Ok(Ffn::Moe(MoeBlock {
            router,
            experts,
            shared,
        }))
    }
}

impl FeedForward for Ffn {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        match self {
            Ffn::Dense(mlp) => mlp.forward(x),
            Ffn::Moe(m) => {
                let (inds, scores) = m.router.route(x)?;
                let y = combine(&m.experts.forward(x, &inds)?, &scores)?;
                let y = match &m.shared {
                    Some(s) => y.add(s.forward(x)?)?,
                    None => y,
                };
                // Tensor parallel: both terms are this rank's partial sums, summed once.
                m.experts.sum_partials(y)
            }
        }
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        fn mlp(prefix: String, m: &Mlp) -> [(String, &Linear); 3] {
            [
                ("gate_proj", &m.gate_proj),
                ("up_proj", &m.up_proj),
                ("down_proj", &m.down_proj),
            ]
            .map(|(n, l)| (format!("{prefix}.{n}"), l))
        }
        match self {
            Ffn::Dense(m) => mlp(module.to_owned(), m).into(),
            Ffn::Moe(m) => m
                .shared
                .iter()
                .flat_map(|s| mlp(format!("{module}.shared_experts"), s))
                .collect(),
        }
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        match self {
            Ffn::Dense(_) => Vec::new(),
            Ffn::Moe(m) => m.experts.named(&format!("{module}.switch_mlp")),
        }
    }

    /// `deepseek_v3.Model.shard` on the feed-forward: a dense MLP as Llama's (gate and up by
    /// columns, down by rows, its own `all_sum`); the sparse block's shared expert and every
    /// routed expert narrowed in place (`shard_inplace`), the `MoEGate` whole, the block's
    /// output summed over the ranks once (`sharding_group`).
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        let m = match self {
            Ffn::Dense(mlp) => return mlp.shard(part, prefix),
            Ffn::Moe(m) => m,
        };
        if let Some(shared) = &mut m.shared {
            let s = format!("{prefix}.shared_experts");
            for (proj, name, split) in [
                (&mut shared.gate_proj, "gate_proj", Split::Columns),
                (&mut shared.down_proj, "down_proj", Split::Rows),
                (&mut shared.up_proj, "up_proj", Split::Columns),
            ] {
                proj.shard_inplace(split, part, &format!("{s}.{name}"))?;
            }
        }
        m.experts.shard(part, &format!("{prefix}.switch_mlp"))
    }
}

/// mlx-lm's sanitize on the text model's names: refuses what it converts but we do not (fp8
/// block scales, compressed-tensors int4), drops the MTP layer, splits `kv_b_proj`.
fn sanitize(w: &mut Weights, a: &Args, model_type: &str) -> Result<(), LoadError> {
    let names = w.remaining();
    if let Some(n) = names
        .iter()
        .find(|n| n.contains("weight_scale_inv") || n.ends_with("weight_shape"))
    {
        return Err(LoadError::Unsupported(format!(
            "{model_type}: `{n}`: fp8 block-scaled and compressed-tensors int4 checkpoints are not \
             read here; convert them with mlx_lm.convert first"
        )));
    }
    match a.variant {
        Variant::DeepseekV3 => {
            w.discard(|n| n.starts_with("model.layers.61") || n.contains("rotary_emb.inv_freq"))
        }
        Variant::Glm4MoeLite | Variant::DeepseekV32 => {
            let layers = a.num_hidden_layers;
            w.discard(|n| {
                let parts: Vec<&str> = n.split('.').collect();
                parts.len() >= 3
                    && parts[1] == "layers"
                    && parts[2].parse::<i64>().is_ok_and(|i| i >= layers as i64)
            })
        }
    }
    for i in 0..a.num_hidden_layers {
        let attn = format!("model.layers.{i}.self_attn");
        split_kv_b_proj(
            w,
            &attn,
            a.num_attention_heads,
            a.qk_nope_head_dim,
            a.v_head_dim,
        )?;
    }
    Ok(())
}

/// The decoder of the text model read from `config` by `variant`.
pub fn load(config: &ModelConfig, mut w: Weights, variant: Variant) -> Result<Decoder, LoadError> {
    let a = Args::parse(config, variant)?;
    a.check(&config.model_type)?;
    if !w.is_probe() {
        sanitize(&mut w, &a, &config.model_type)?;
    }
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "mlp",
    };
    let shape = a.mla_shape();
    let index = match variant {
        Variant::DeepseekV32 => Some(IndexArgs::parse(config)?),
        _ => None,
    };
    Decoder::load(config, w, dims, |w, p, i| {
        let mixer: Box<dyn Mixer> = match &index {
            Some(index) => Box::new(SparseMla::load(w, p, &shape, index)?),
            None => Box::new(Mla::load(w, p, &shape)?),
        };
        Ok((mixer, Box::new(Ffn::load(w, p, &a, i)?)))
    })
}

/// `kimi_k25.Model` for text: `text_config` read as deepseek_v3's arguments, the vision
/// tower and projectors (`vision_tower`, `vision_model`, `multi_modal_projector`,
/// `mm_projector`) dropped, `language_model.X` read as X; anything else is left for the
/// strict load to refuse, as mlx-lm's does.
pub fn load_kimi_k25(
    config: &ModelConfig,
    mut w: Weights,
) -> Result<Box<dyn LanguageModel>, LoadError> {
    let Some(Value::Object(text)) = config.raw.get("text_config") else {
        return Err(LoadError::Config {
            path: config.path.clone(),
            message: "kimi_k25 reads its language model's settings from `text_config`, which \
                      this config lacks (or is not an object)"
                .into(),
        });
    };
    let mut text = text.clone();
    // The text model keeps the wrapper's name (what the engine reports and refuses by).
    text.insert("model_type".into(), config.model_type.clone().into());
    let mut inner = ModelConfig::from_value(config.path.clone(), Value::Object(text))?;
    inner.quantization = config.quantization.as_ref().map(|q| QuantConfig {
        default: q.default,
        per_path: q
            .per_path
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("language_model.")?.to_owned(), *v)))
            .collect(),
    });
    const TOWERS: [&str; 4] = [
        "vision_tower.",
        "vision_model.",
        "multi_modal_projector.",
        "mm_projector.",
    ];
    match w.is_probe() {
        true => w.set_probe_prefix("language_model."),
        false => w.rename(|n| match n.strip_prefix("language_model.") {
            Some(rest) => Some(rest.to_owned()),
            None if TOWERS.iter().any(|t| n.starts_with(t)) => None,
            None => Some(n.to_owned()),
        }),
    }
    Ok(Box::new(
        load(&inner, w, Variant::DeepseekV3)?.under_language_model(),
    ))
}
