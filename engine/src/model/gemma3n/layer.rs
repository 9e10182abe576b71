//! One Gemma 3n decoder layer as mlx-lm 0.32.2's `Gemma3nDecoderLayer` runs it, over the
//! AltUp streams x [K, B, L, H]:
//!
//!   p = altup.predict(x);  a = p[active]
//!   n = input_norm(a);  lau = n + laurel_norm(right(left(n)))
//!   h = (a + post_attn_norm(attn(n)) + lau) · 2^-½      (the sum grouped as mlx-lm's)
//!   h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))
//!   c = altup.correct(p, h);  g = post_pli_norm(proj(gelu(gate(c[active] · s)) · pli))
//!   c[1:] += g
//!
//! The attention: q/k RMSNorm per head, v RMSNorm without a scale, RoPE (local base on
//! sliding layers), scale 1; a KV-shared layer reads its owner's K/V of this step.

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{clip, concatenate, maximum, tanh};
use mlx_rs::{Array, Dtype};

use super::Gemma3nArgs;
use crate::cache::{AttentionCache, Kv, Mask, RopeOffset};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{compiled_shapeless, gelu_approx, CompiledFn, Linear, RmsNorm, Rope};
use crate::scalar::weak;

type R<T> = Result<T, Exception>;

/// `gelu_topk`: gelu_approx(max(0, x − (mean + std · m))) over the last axis, compiled
/// shapeless as mlx-lm compiles it.
fn gelu_topk_graph(args: &[Array]) -> R<Vec<Array>> {
    let (x, m) = (&args[0], &args[1]);
    let mean = x.mean_axis(-1, true)?;
    let std = mlx_rs::ops::std_axis(x, -1, true, 0)?;
    let cutoff = mean.add(std.multiply(m.as_dtype(std.dtype())?)?)?;
    let y = maximum(weak(0.0, x)?, x.subtract(&cutoff)?)?;
    gelu_graph(&y)
}

/// nn.gelu_approx's graph inside the compiled gelu_topk (weak scalars).
fn gelu_graph(x: &Array) -> R<Vec<Array>> {
    let c = |v: f64| weak(v, x);
    let cubic = c(0.044715)?.multiply(x.power(c(3.0)?)?)?;
    let inner = c((2.0 / std::f64::consts::PI).sqrt())?.multiply(x.add(&cubic)?)?;
    let y = c(0.5)?.multiply(x)?.multiply(c(1.0)?.add(tanh(&inner)?)?)?;
    Ok(vec![y])
}

thread_local! {
    static GELU_TOPK: std::cell::RefCell<CompiledFn> =
        std::cell::RefCell::new(compiled_shapeless(gelu_topk_graph));
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    eps: f32,
    head_dim: i32,
    rope: Rope,
}

impl Attention {
    /// Returns the output and, for an owner, the K/V it attended over (what its
    /// `keys_and_values()` gives the shared layers after this step).
    fn forward(
        &self,
        x: &Array,
        mask: &Mask,
        cache: Option<&mut dyn AttentionCache>,
        shared: Option<&Kv>,
        offset: &RopeOffset,
    ) -> R<(Array, Kv)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let q = self
            .q_proj
            .forward(x)?
            .reshape(&[b, l, -1, self.head_dim])?;
        let q = self.q_norm.forward(&q)?;
        let kv = match shared {
            Some(kv) => kv.clone(),
            None => {
                let k = self
                    .k_proj
                    .forward(x)?
                    .reshape(&[b, l, -1, self.head_dim])?;
                let k = self.k_norm.forward(&k)?.transpose_axes(&[0, 2, 1, 3])?;
                let k = self.rope.forward(&k, offset)?;
                let v = self
                    .v_proj
                    .forward(x)?
                    .reshape(&[b, l, -1, self.head_dim])?;
                let v = fast::rms_norm(&v, None, self.eps)?.transpose_axes(&[0, 2, 1, 3])?;
                match cache {
                    Some(c) => c.update_and_fetch(k, v)?,
                    None => Kv::Dense(k, v),
                }
            }
        };
        let q = self
            .rope
            .forward(&q.transpose_axes(&[0, 2, 1, 3])?, offset)?;
        let out = crate::model::sdpa::attend(&q, &kv, 1.0, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        Ok((self.o_proj.forward(&out)?, kv))
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// √2 · erfinv(2·sparsity − 1) (float32) where the layer's sparsity is above 0.
    std_multiplier: Option<Array>,
}

impl Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        let gate = self.gate_proj.forward(x)?;
        let act = match &self.std_multiplier {
            Some(m) => GELU_TOPK
                .with_borrow_mut(|f| -> R<Array> { Ok(f(&[gate, m.clone()])?.remove(0)) })?,
            None => gelu_approx(&gate)?,
        };
        let up = self.up_proj.forward(x)?;
        self.down_proj.forward(&act.multiply(&up)?)
    }
}

/// AltUp's coefficients and router.
struct AltUp {
    correct_output_scale: Array,
    /// float32, clipped to ±altup_coef_clip (mlx-lm converts and clips on every call).
    correction_coefs: Array,
    prediction_coefs: Array,
    modality_router: Linear,
    router_norm: RmsNorm,
    hidden: i32,
    k: i32,
    active: i32,
}

impl AltUp {
    fn modalities(&self, x: &Array) -> R<Array> {
        let inputs = self
            .router_norm
            .forward(x)?
            .multiply(weak((self.hidden as f64).powf(-1.0), x)?)?;
        let routed = self
            .modality_router
            .forward(&inputs)?
            .as_dtype(Dtype::Float32)?;
        tanh(&routed)
    }

    fn predict(&self, x: &Array) -> R<Array> {
        let m = self.modalities(&x.index(self.active))?;
        let s = m.shape().to_vec();
        let coefs = m
            .matmul(self.prediction_coefs.t())?
            .reshape(&[s[0], s[1], self.k, self.k])?
            .transpose_axes(&[0, 1, 3, 2])?;
        let up = x.as_dtype(Dtype::Float32)?;
        let p = up.transpose_axes(&[1, 2, 3, 0])?.matmul(&coefs)?;
        let p = p.transpose_axes(&[3, 0, 1, 2])?.add(&up)?;
        p.as_dtype(x.dtype())
    }

    fn correct(&self, predictions: &Array, activated: &Array) -> R<Array> {
        let m = self.modalities(activated)?;
        let one = Array::from_f32(1.0);
        let coefs = m.matmul(self.correction_coefs.t())?.add(&one)?;
        let innovation = activated.subtract(predictions.index(self.active))?;
        let coefs = coefs.transpose_axes(&[2, 0, 1])?;
        let corrected = innovation
            .expand_dims(0)?
            .multiply(coefs.expand_dims(-1)?)?
            .add(predictions)?;
        corrected.as_dtype(activated.dtype())
    }
}

pub(super) struct Layer {
    attn: Attention,
    mlp: Mlp,
    altup: AltUp,
    laurel_left: Linear,
    laurel_right: Linear,
    post_laurel_norm: RmsNorm,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    pli_gate: Linear,
    pli_projection: Linear,
    post_pli_norm: RmsNorm,
    correct_scale: bool,
    pub(super) sliding: bool,
}

/// What one layer reads besides its streams.
pub(super) struct Step<'a> {
    pub mask: &'a Mask,
    pub cache: Option<&'a mut dyn AttentionCache>,
    pub shared: Option<&'a Kv>,
    pub per_layer_input: &'a Array,
    pub offset: &'a RopeOffset,
}

impl Layer {
    /// Its linears as mlx-lm's block names them (where LoRA attaches). AltUp's prediction
    /// and correction coefficients are not among them: mlx-lm reads their weights instead of
    /// calling them (so its LoRA cannot wrap them), and here they are plain arrays.
    pub(super) fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let a = &self.attn;
        vec![
            ("self_attn.q_proj", &a.q_proj),
            ("self_attn.k_proj", &a.k_proj),
            ("self_attn.v_proj", &a.v_proj),
            ("self_attn.o_proj", &a.o_proj),
            ("mlp.gate_proj", &self.mlp.gate_proj),
            ("mlp.up_proj", &self.mlp.up_proj),
            ("mlp.down_proj", &self.mlp.down_proj),
            ("altup.modality_router", &self.altup.modality_router),
            ("laurel.linear_left", &self.laurel_left),
            ("laurel.linear_right", &self.laurel_right),
            ("per_layer_input_gate", &self.pli_gate),
            ("per_layer_projection", &self.pli_projection),
        ]
    }

    pub(super) fn forward(&self, x: &Array, step: Step) -> R<(Array, Kv)> {
        let p = self.altup.predict(x)?;
        let a = p.index(self.altup.active);
        let n = self.input_norm.forward(&a)?;
        let lau = n.add(
            self.post_laurel_norm
                .forward(&self.laurel_right.forward(&self.laurel_left.forward(&n)?)?)?,
        )?;
        let (attn, kv) = self
            .attn
            .forward(&n, step.mask, step.cache, step.shared, step.offset)?;
        let attn = self.post_attn_norm.forward(&attn)?;
        let h = a.add(&attn)?.add(&lau)?;
        let h = h.multiply(weak(2f64.powf(-0.5), &h)?)?;
        let ffw = self.mlp.forward(&self.pre_ffw_norm.forward(&h)?)?;
        let h = h.add(self.post_ffw_norm.forward(&ffw)?)?;
        let c = self.altup.correct(&p, &h)?;
        let mut first = c.index(self.altup.active);
        if self.correct_scale {
            first = first.multiply(&self.altup.correct_output_scale)?;
        }
        let g = gelu_approx(&self.pli_gate.forward(&first)?)?;
        let g = g.multiply(step.per_layer_input)?;
        let g = self
            .post_pli_norm
            .forward(&self.pli_projection.forward(&g)?)?;
        let rest = c.index(1..).add(&g)?;
        Ok((concatenate(&[c.index(0..1), rest], 0)?, kv))
    }
}

/// Loads layer `i` (prefix `p`).
pub(super) fn load(
    w: &mut Weights,
    p: &str,
    a: &Gemma3nArgs,
    i: usize,
) -> Result<Layer, LoadError> {
    let (h, hd, eps) = (a.hidden_size, a.head_dim, a.rms_norm_eps);
    let lin = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.{name}"), false, out_in)
    };
    let norm = |w: &mut Weights, name: &str, dims: i32| {
        RmsNorm::load(w, &format!("{p}.{name}"), dims, eps)
    };
    let sliding = a.layer_types[i] == "sliding_attention";
    let (q_dims, kv_dims) = (a.num_attention_heads * hd, a.num_key_value_heads * hd);
    let attn = Attention {
        q_proj: lin(w, "self_attn.q_proj", [q_dims, h])?,
        k_proj: lin(w, "self_attn.k_proj", [kv_dims, h])?,
        v_proj: lin(w, "self_attn.v_proj", [kv_dims, h])?,
        o_proj: lin(w, "self_attn.o_proj", [h, q_dims])?,
        q_norm: norm(w, "self_attn.q_norm", hd)?,
        k_norm: norm(w, "self_attn.k_norm", hd)?,
        eps,
        head_dim: hd,
        rope: Rope::Standard {
            dims: hd,
            traditional: false,
            base: if sliding {
                a.rope_local_base_freq
            } else {
                a.rope_theta
            },
            scale: 1.0,
        },
    };
    let inter = a.intermediate(i)?;
    let sparsity = a.activation_sparsity_pattern.as_ref().map_or(0.0, |s| s[i]);
    let std_multiplier = (sparsity > 0.0)
        .then(|| {
            let e = mlx_rs::ops::erfinv(Array::from_f32((2.0 * sparsity - 1.0) as f32))?;
            Array::from_f32(2f32.sqrt()).multiply(e)
        })
        .transpose()
        .map_err(|e| LoadError::Unsupported(format!("gemma3n: {e}")))?;
    let mlp = Mlp {
        gate_proj: lin(w, "mlp.gate_proj", [inter, h])?,
        up_proj: lin(w, "mlp.up_proj", [inter, h])?,
        down_proj: lin(w, "mlp.down_proj", [h, inter])?,
        std_multiplier,
    };
    let k = a.altup_num_inputs;
    let coefs = |w: &mut Weights, name: &str, rows: i32| -> Result<Array, LoadError> {
        let raw = w.take_shaped(&format!("{p}.altup.{name}.weight"), &[rows, k])?;
        let f = raw
            .as_dtype(Dtype::Float32)
            .and_then(|f| match a.altup_coef_clip {
                Some(c) => clip(&f, (Array::from_f32(-c), Array::from_f32(c))),
                None => Ok(f),
            });
        f.map_err(|e| LoadError::Unsupported(format!("gemma3n: {e}")))
    };
    let altup = AltUp {
        correct_output_scale: w.take_shaped(&format!("{p}.altup.correct_output_scale"), &[h])?,
        correction_coefs: coefs(w, "correction_coefs", k)?,
        prediction_coefs: coefs(w, "prediction_coefs", k * k)?,
        modality_router: lin(w, "altup.modality_router", [k, h])?,
        router_norm: norm(w, "altup.router_norm", h)?,
        hidden: h,
        k,
        active: a.altup_active_idx,
    };
    let hpl = a.hidden_size_per_layer_input;
    Ok(Layer {
        attn,
        mlp,
        altup,
        laurel_left: lin(w, "laurel.linear_left", [a.laurel_rank, h])?,
        laurel_right: lin(w, "laurel.linear_right", [h, a.laurel_rank])?,
        post_laurel_norm: norm(w, "laurel.post_laurel_norm", h)?,
        input_norm: norm(w, "input_layernorm", h)?,
        post_attn_norm: norm(w, "post_attention_layernorm", h)?,
        pre_ffw_norm: norm(w, "pre_feedforward_layernorm", h)?,
        post_ffw_norm: norm(w, "post_feedforward_layernorm", h)?,
        pli_gate: lin(w, "per_layer_input_gate", [hpl, h])?,
        pli_projection: lin(w, "per_layer_projection", [h, hpl])?,
        post_pli_norm: norm(w, "post_per_layer_input_norm", h)?,
        correct_scale: a.altup_correct_scale,
        sliding,
    })
}
