//! `nemotron_h` (Nemotron-H) as mlx-lm 0.32.2 implements it: a stack of residual blocks,
//! each `h + block(norm(h))` with one kind per layer from `hybrid_override_pattern`
//! (`M` a Mamba-2 mixer, `*` attention without positions, `-` a ReLU² MLP, `E` Nemotron 3's
//! mixture of experts):
//!
//!   M: ssm.rs's mixer with Nemotron-H's gated norm (per group of channels) and D cast to x
//!   *: softmax attention, GQA, no RoPE, scale head_dim^-½, a standard KV cache
//!   -: down(relu(up(x))²)                     (position-wise: no cache, no mask)
//!   E: `NemotronHMoE`, position-wise like `-`:
//!        inds, w = group_expert_select(x @ gate.T)   (moe.rs's `GroupedTopK`: σ scores in
//!                                                     float32, `e_score_correction_bias` for
//!                                                     the choice only, top k renormalized,
//!                                                     × routed_scaling_factor)
//!        y = Σ_k w_k · fc2_e(relu2(fc1_e(x')))       (SwitchMLP; x' = fc1_latent_proj(x)
//!                                                     with `moe_latent_size`, else x)
//!        y = fc2_latent_proj(y) (with the latent) + shared_experts(x) (with n_shared_experts)
//!   logits = lm_head(norm_f(h))               (never tied)
//!
//! LoRA takes mlx-lm's default keys in every kind of block, `E` included: the expert
//! stacks `mixer.switch_mlp.fc1` / `fc2` (`LoRASwitchLinear`: one pair per expert), the
//! latent projections and the shared expert's linears; never the router's `gate` (mlx-lm's
//! `MoEGate` is no Linear) nor the Mamba-2 mixer's conv1d.
//!
//! The pattern may come as `layers_block_type` / `layer_types` names instead (mapped as
//! mlx-lm maps them). Names are the `backbone.` ones; mlx-lm's sanitize runs at load as in
//! `engine convert`: Hugging Face's [C, 1, K] conv kernels move to MLX's layout, `mtp.` heads
//! are dropped and per-expert `experts.{e}.up_proj` / `down_proj` are stacked into
//! `switch_mlp.fc1` / `fc2` (mlx-community's checkpoints have them stacked already).

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{Built, Decoder, Dims, Mixer, NamedAttention, Names, Style};
use super::layers::{compiled_shapeless, Attention, CompiledFn, Linear, Rope};
use super::mamba2::sanitize_conv;
use super::moe::{combine, stack_experts, Gate, GroupedTopK, Router, SwitchLinear, SwitchMlp};
use super::moe_family::check_top_k;
use super::shard::Part;
use super::ssm::{GatedNorm, Mamba2Mixer, SsmShape};
use crate::cache::none::PassThrough;
use crate::cache::{Cache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn no_limit() -> (f64, f64) {
    (0.0, f64::MAX)
}

/// mlx-lm's `nemotron_h.ModelArgs` (the dense fields).
#[derive(Debug, Clone, Deserialize)]
pub struct NemotronHArgs {
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub attention_bias: bool,
    pub mamba_num_heads: i32,
    pub mamba_head_dim: i32,
    pub mamba_proj_bias: bool,
    pub ssm_state_size: i32,
    pub conv_kernel: i32,
    pub n_groups: i32,
    pub mlp_bias: bool,
    pub layer_norm_epsilon: f32,
    pub use_conv_bias: bool,
    pub hybrid_override_pattern: Option<Value>,
    pub layers_block_type: Option<Vec<String>>,
    pub layer_types: Option<Vec<String>>,
    pub head_dim: Option<i32>,
    #[serde(default = "no_limit")]
    pub time_step_limit: (f64, f64),
    /// The `E` blocks' fields (mlx-lm's `ModelArgs` leaves them optional; the blocks need
    /// them, [`MoeArgs::of`]).
    pub n_routed_experts: Option<i32>,
    pub num_experts_per_tok: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    pub moe_shared_expert_intermediate_size: Option<i32>,
    pub moe_latent_size: Option<i32>,
    pub n_shared_experts: Option<i32>,
    pub n_group: Option<i32>,
    pub topk_group: Option<i32>,
    pub norm_topk_prob: Option<bool>,
    pub routed_scaling_factor: Option<f64>,
}

/// What the `E` blocks read of the config, each field checked present and in range.
#[derive(Debug, Clone, Copy)]
struct MoeArgs {
    experts: i32,
    top_k: i32,
    intermediate: i32,
    /// The shared expert's width (`NemotronHMLP`'s `intermediate_size or
    /// args.intermediate_size`), when `n_shared_experts` is set.
    shared: Option<i32>,
    latent: Option<i32>,
    n_group: i32,
    topk_group: i32,
    norm_topk_prob: bool,
    routed_scaling_factor: f64,
}

impl MoeArgs {
    fn of(a: &NemotronHArgs) -> Result<Self, LoadError> {
        fn need<T: Copy>(v: Option<T>, field: &str) -> Result<T, LoadError> {
            v.ok_or_else(|| {
                LoadError::Unsupported(format!(
                    "nemotron_h: the mixture-of-experts blocks `E` need `{field}` in config.json \
                     (Nemotron 3's configs set it); add it or drop the `E` blocks"
                ))
            })
        }
        let m = MoeArgs {
            experts: need(a.n_routed_experts, "n_routed_experts")?,
            top_k: need(a.num_experts_per_tok, "num_experts_per_tok")?,
            intermediate: need(a.moe_intermediate_size, "moe_intermediate_size")?,
            shared: a.n_shared_experts.map(|_| {
                a.moe_shared_expert_intermediate_size
                    .filter(|&n| n != 0)
                    .unwrap_or(a.intermediate_size)
            }),
            latent: a.moe_latent_size,
            n_group: need(a.n_group, "n_group")?,
            topk_group: need(a.topk_group, "topk_group")?,
            norm_topk_prob: a.norm_topk_prob.unwrap_or(false),
            routed_scaling_factor: need(a.routed_scaling_factor, "routed_scaling_factor")?,
        };
        check_top_k("nemotron_h", m.top_k, m.experts, "n_routed_experts")?;
        if m.n_group > 1 {
            let per_group = m.experts / m.n_group;
            if m.experts % m.n_group != 0 || per_group < 2 {
                return Err(LoadError::Unsupported(format!(
                    "nemotron_h: n_routed_experts ({}) must split into n_group ({}) groups of \
                     at least 2 (each group is ranked by its top two scores)",
                    m.experts, m.n_group
                )));
            }
            if m.topk_group < 1 || m.topk_group > m.n_group {
                return Err(LoadError::Unsupported(format!(
                    "nemotron_h: topk_group {} must be in 1..={} (n_group)",
                    m.topk_group, m.n_group
                )));
            }
        }
        Ok(m)
    }
}

impl NemotronHArgs {
    /// `__post_init__`'s pattern, one character per layer (`M`, `*`, `-` or `E`).
    fn pattern(&self) -> Result<Vec<char>, LoadError> {
        let chars = self.blocks()?;
        if let Some(c) = chars.iter().find(|c| !matches!(c, 'M' | '*' | '-' | 'E')) {
            return Err(LoadError::Unsupported(format!(
                "nemotron_h: block `{c}` in hybrid_override_pattern is not one of mlx-lm's \
                 (M, *, - and E)"
            )));
        }
        Ok(chars)
    }

    /// `__post_init__`'s pattern as the config gives it.
    fn blocks(&self) -> Result<Vec<char>, LoadError> {
        Ok(match &self.hybrid_override_pattern {
            Some(Value::String(s)) => s.chars().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_str)
                .flat_map(str::chars)
                .collect(),
            _ => {
                let types = self
                    .layers_block_type
                    .as_ref()
                    .or(self.layer_types.as_ref());
                let types = types.ok_or_else(|| {
                    LoadError::Unsupported(
                        "nemotron_h: the config must have layers_block_type or \
                         hybrid_override_pattern to describe the layer stack"
                            .into(),
                    )
                })?;
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "full_attention" | "attention" => Ok('*'),
                        "linear_attention" | "mamba" | "conv" => Ok('M'),
                        "moe" => Ok('E'),
                        "mlp" => Ok('-'),
                        other => Err(LoadError::Unsupported(format!(
                            "nemotron_h: unsupported layers_block_type `{other}`"
                        ))),
                    })
                    .collect::<Result<_, _>>()?
            }
        })
    }
}

/// The ReLU² MLP block, position-wise.
struct Relu2Mlp {
    up_proj: Linear,
    down_proj: Linear,
}

impl Relu2Mlp {
    fn load(w: &mut Weights, prefix: &str, bias: bool, h: i32, ff: i32) -> Result<Self, LoadError> {
        Ok(Relu2Mlp {
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), bias, [ff, h])?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), bias, [h, ff])?,
        })
    }

    fn apply(&self, x: &Array) -> R<Array> {
        self.down_proj.forward(&relu2(&self.up_proj.forward(x)?)?)
    }
}

impl Mixer for Relu2Mlp {
    fn forward(&self, x: &Array, _mask: &Mask, _cache: &mut dyn Cache) -> R<Array> {
        self.apply(x)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(PassThrough)
    }

    fn stateless(&self) -> bool {
        true
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("mixer.up_proj", &self.up_proj),
            ("mixer.down_proj", &self.down_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(not_sharded(layer))
    }
}

/// An `E` block (`NemotronHMoE`; see the module header), position-wise.
struct MoeBlock {
    router: Gate,
    experts: SwitchMlp,
    /// `fc1_latent_proj` / `fc2_latent_proj` (`moe_latent_size`).
    latent: Option<(Linear, Linear)>,
    shared_experts: Option<Relu2Mlp>,
}

impl MoeBlock {
    fn load(w: &mut Weights, m: &str, a: &NemotronHArgs, moe: MoeArgs) -> Result<Self, LoadError> {
        let h = a.hidden_size;
        // MoEGate is a plain module (its `weight` and `e_score_correction_bias`), never
        // quantized by mlx-lm: a dense `x @ weight.T`.
        let router = Gate {
            gate: Linear {
                weight: w.take_shaped(&format!("{m}.gate.weight"), &[moe.experts, h])?,
                bias: None,
                quantized: None,
                lora: Default::default(),
                reduce: false,
            },
            top_k: moe.top_k,
            kind: Router::SigmoidGroupedTopK(GroupedTopK {
                bias: w
                    .take_shaped(&format!("{m}.gate.e_score_correction_bias"), &[moe.experts])?,
                n_group: moe.n_group,
                topk_group: moe.topk_group,
                norm_topk_prob: moe.norm_topk_prob,
                norm_eps: true,
                routed_scaling_factor: moe.routed_scaling_factor,
            }),
        };
        let latent = match moe.latent {
            Some(l) => Some((
                Linear::load(w, &format!("{m}.fc1_latent_proj"), a.mlp_bias, [l, h])?,
                Linear::load(w, &format!("{m}.fc2_latent_proj"), a.mlp_bias, [h, l])?,
            )),
            None => None,
        };
        let input = moe.latent.unwrap_or(h);
        Ok(MoeBlock {
            router,
            experts: SwitchMlp::load(w, m, (input, moe.intermediate), moe.experts)?,
            latent,
            shared_experts: match moe.shared {
                Some(ff) => Some(Relu2Mlp::load(
                    w,
                    &format!("{m}.shared_experts"),
                    a.mlp_bias,
                    h,
                    ff,
                )?),
                None => None,
            },
        })
    }
}

impl Mixer for MoeBlock {
    fn forward(&self, x: &Array, _mask: &Mask, _cache: &mut dyn Cache) -> R<Array> {
        let (inds, scores) = self.router.route(x)?;
        let y = match &self.latent {
            Some((fc1, _)) => self.experts.forward_with(&fc1.forward(x)?, &inds, relu2)?,
            None => self.experts.forward_with(x, &inds, relu2)?,
        };
        let y = combine(&y, &scores)?;
        let y = match &self.latent {
            Some((_, fc2)) => fc2.forward(&y)?,
            None => y,
        };
        match &self.shared_experts {
            Some(shared) => y.add(shared.apply(x)?),
            None => Ok(y),
        }
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        Box::new(PassThrough)
    }

    fn stateless(&self) -> bool {
        true
    }

    /// mlx-lm's default LoRA keys in an `E` block: the latent projections and the shared
    /// expert's two linears. The router's `gate` is a plain module (`MoEGate`), not a
    /// Linear, so `linear_to_lora_layers` leaves it alone, and so do we.
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut all = Vec::new();
        if let Some((fc1, fc2)) = &self.latent {
            all.push(("mixer.fc1_latent_proj", fc1));
            all.push(("mixer.fc2_latent_proj", fc2));
        }
        if let Some(shared) = &self.shared_experts {
            all.push(("mixer.shared_experts.up_proj", &shared.up_proj));
            all.push(("mixer.shared_experts.down_proj", &shared.down_proj));
        }
        all
    }

    /// The experts' stacks (`SwitchLinear`, so `LoRASwitchLinear` in mlx-lm's trainer).
    fn switches(&self) -> Vec<(&'static str, &SwitchLinear)> {
        vec![
            ("mixer.switch_mlp.fc1", &self.experts.fc1),
            ("mixer.switch_mlp.fc2", &self.experts.fc2),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(not_sharded(layer))
    }
}

fn not_sharded(layer: &str) -> LoadError {
    LoadError::Unsupported(format!("{layer}: nemotron_h is not split across ranks"))
}

fn relu2_graph(args: &[Array]) -> R<Vec<Array>> {
    let x = &args[0];
    let zero = Array::from_int(0).as_dtype(x.dtype())?;
    Ok(vec![mlx_rs::ops::square(mlx_rs::ops::maximum(x, &zero)?)?])
}

thread_local! {
    static RELU2: RefCell<CompiledFn> = RefCell::new(compiled_shapeless(relu2_graph));
}

/// `nn.relu2`, compiled shapeless as MLX compiles it.
fn relu2(x: &Array) -> R<Array> {
    RELU2.with_borrow_mut(|f| Ok(f(std::slice::from_ref(x))?.remove(0)))
}

/// mlx-lm's `sanitize`, at load and for `engine convert`: `mtp.` heads dropped, the conv
/// kernels in MLX's layout, and each `E` block's per-expert `experts.{e}.up_proj` /
/// `down_proj` stacked into `switch_mlp.fc1` / `fc2` (Hugging Face's layout; mlx-community's
/// has them stacked already).
fn sanitize(a: &NemotronHArgs, w: &mut Weights) -> Result<(), LoadError> {
    w.discard(|n| n.starts_with("mtp."));
    sanitize_conv(w)?;
    let experts = a.n_routed_experts.unwrap_or(0);
    for l in 0..a.blocks()?.len() {
        let mixer = format!("backbone.layers.{l}.mixer");
        for (hf, fc) in [("down_proj", "fc2"), ("up_proj", "fc1")] {
            if let Some(stacked) = stack_experts(w, &mixer, hf, experts, None)? {
                w.insert(format!("{mixer}.switch_mlp.{fc}.weight"), stacked);
            }
        }
    }
    Ok(())
}

/// [`sanitize`] for `engine convert`.
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    sanitize(&config.parse()?, w)
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: NemotronHArgs = config.parse()?;
    let pattern = a.pattern()?;
    let has_moe = pattern.contains(&'E');
    if has_moe {
        // The `E` blocks' fields refused before any weight is read (each block reads them).
        MoeArgs::of(&a)?;
    }
    sanitize(&a, &mut w)?;
    let inner = a.mamba_num_heads * a.mamba_head_dim;
    let ssm = SsmShape {
        hidden: a.hidden_size,
        heads: a.mamba_num_heads,
        head_dim: a.mamba_head_dim,
        groups: a.n_groups,
        state: a.ssm_state_size,
        conv_kernel: a.conv_kernel,
        use_bias: a.mamba_proj_bias,
        use_conv_bias: a.use_conv_bias,
        eps: a.layer_norm_epsilon,
        limits: (a.time_step_limit.0 as f32, a.time_step_limit.1 as f32),
        out_bias: a.mamba_proj_bias,
        norm: GatedNorm::Grouped(a.n_groups),
        cast_d: true,
        scan_lengths: false,
    };
    if a.n_groups <= 0 || inner % a.n_groups != 0 {
        return Err(LoadError::Unsupported(format!(
            "nemotron_h: mamba_num_heads · mamba_head_dim ({inner}) must split into n_groups ({})",
            a.n_groups
        )));
    }
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let dims = Dims {
        layers: pattern.len() as i32,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.layer_norm_epsilon,
        tie_word_embeddings: false,
        ffn_module: "mlp",
    };
    let style = Style {
        names: Names::BACKBONE,
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let m = format!("{p}.mixer");
        let lin = |w: &mut Weights, n: &str, bias: bool, out_in: [i32; 2]| {
            Linear::load(w, &format!("{m}.{n}"), bias, out_in)
        };
        let (h, ff) = (a.hidden_size, a.intermediate_size);
        let (q_dims, kv_dims) = (
            a.num_attention_heads * head_dim,
            a.num_key_value_heads * head_dim,
        );
        let mixer: Box<dyn Mixer> = match pattern[i as usize] {
            'M' => Box::new(Mamba2Mixer::load(w, &m, "mixer", ssm)?),
            '*' => Box::new(NamedAttention {
                attn: Attention {
                    q_proj: lin(w, "q_proj", a.attention_bias, [q_dims, h])?,
                    k_proj: lin(w, "k_proj", a.attention_bias, [kv_dims, h])?,
                    v_proj: lin(w, "v_proj", a.attention_bias, [kv_dims, h])?,
                    o_proj: lin(w, "o_proj", a.attention_bias, [h, q_dims])?,
                    q_norm: None,
                    k_norm: None,
                    n_heads: a.num_attention_heads,
                    n_kv_heads: a.num_key_value_heads,
                    scale: (head_dim as f32).powf(-0.5),
                    norm_after_transpose: false,
                    rope: Rope::None,
                },
                names: [
                    "mixer.q_proj",
                    "mixer.k_proj",
                    "mixer.v_proj",
                    "mixer.o_proj",
                ],
                family: "nemotron_h",
            }),
            'E' => Box::new(MoeBlock::load(w, &m, &a, MoeArgs::of(&a)?)?),
            _ => Box::new(Relu2Mlp::load(w, &m, a.mlp_bias, h, ff)?),
        };
        Ok(Built::mixer_only(mixer))
    })
}
