//! `nemotron_h` (Nemotron-H) as mlx-lm 0.32.2 implements it: a stack of residual blocks,
//! each `h + block(norm(h))` with one kind per layer from `hybrid_override_pattern`
//! (`M` a Mamba-2 mixer, `*` attention without positions, `-` a ReLU² MLP):
//!
//!   M: ssm.rs's mixer with Nemotron-H's gated norm (per group of channels) and D cast to x
//!   *: softmax attention, GQA, no RoPE, scale head_dim^-½, a standard KV cache
//!   -: down(relu(up(x))²)                     (position-wise: no cache, no mask)
//!   logits = lm_head(norm_f(h))               (never tied)
//!
//! The pattern may come as `layers_block_type` / `layer_types` names instead (mapped as
//! mlx-lm maps them). Names are the `backbone.` ones; Hugging Face's [C, 1, K] conv kernels
//! move to MLX's layout and `mtp.` heads are dropped, as mlx-lm's sanitize does. The
//! mixture-of-experts blocks (`E`, Nemotron 3) are refused.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{Built, Decoder, Dims, Mixer, NamedAttention, Names, Style};
use super::layers::{compiled_shapeless, Attention, CompiledFn, Linear, Rope};
use super::mamba2::sanitize_conv;
use super::moe::stack_experts;
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
    /// The `E` blocks' expert count (read by `engine convert`'s sanitize only).
    pub n_routed_experts: Option<i32>,
}

impl NemotronHArgs {
    /// `__post_init__`'s pattern, the blocks this engine runs: one character per layer.
    fn pattern(&self) -> Result<Vec<char>, LoadError> {
        let chars = self.blocks()?;
        if let Some(c) = chars.iter().find(|c| !matches!(c, 'M' | '*' | '-')) {
            return Err(LoadError::Unsupported(format!(
                "nemotron_h: block `{c}` is not supported (M, * and - are; the \
                 mixture-of-experts blocks `E` of Nemotron 3 are not yet)"
            )));
        }
        Ok(chars)
    }

    /// `__post_init__`'s pattern as the config gives it (`E` blocks included).
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

impl Mixer for Relu2Mlp {
    fn forward(&self, x: &Array, _mask: &Mask, _cache: &mut dyn Cache) -> R<Array> {
        self.down_proj.forward(&relu2(&self.up_proj.forward(x)?)?)
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

/// mlx-lm's `sanitize` at load: `mtp.` heads dropped, the conv kernels in MLX's layout.
/// (Its expert stacking is for the `E` blocks, refused at load; `engine convert` does it:
/// [`convert_sanitize`].)
fn sanitize(w: &mut Weights) -> Result<(), LoadError> {
    w.discard(|n| n.starts_with("mtp."));
    sanitize_conv(w)
}

/// mlx-lm's whole `sanitize`, for `engine convert`: the loader's, then each `E` block's
/// per-expert `experts.{e}.up_proj` / `down_proj` stacked into `switch_mlp.fc1` / `fc2`
/// (Nemotron 3's mixture of experts, which `engine convert` lays out although the engine
/// does not run it).
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    let a: NemotronHArgs = config.parse()?;
    let layers = a.blocks()?.len();
    sanitize(w)?;
    let experts = a.n_routed_experts.unwrap_or(0);
    for l in 0..layers {
        let mixer = format!("backbone.layers.{l}.mixer");
        for (hf, fc) in [("down_proj", "fc2"), ("up_proj", "fc1")] {
            if let Some(stacked) = stack_experts(w, &mixer, hf, experts, None)? {
                w.insert(format!("{mixer}.switch_mlp.{fc}.weight"), stacked);
            }
        }
    }
    Ok(())
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: NemotronHArgs = config.parse()?;
    let pattern = a.pattern()?;
    sanitize(&mut w)?;
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
            _ => Box::new(Relu2Mlp {
                up_proj: lin(w, "up_proj", a.mlp_bias, [ff, h])?,
                down_proj: lin(w, "down_proj", a.mlp_bias, [h, ff])?,
            }),
        };
        Ok(Built::mixer_only(mixer))
    })
}
