//! The pieces every family shares, written to compute exactly what mlx-lm's modules compute
//! (same MLX ops, same order, same dtypes): Linear, RMSNorm, Embedding, RoPE, attention, the
//! gated MLPs (SwiGLU, gelu-tanh), the output head (final norm, lm_head or tied embedding,
//! softcap) and the list of adaptable linears.

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::addmm;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::cache::{AttentionCache, Cache, KvCache, Mask, RopeOffset, RotatingKvCache};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

pub use super::quantized::Quantized;

pub mod dora;

pub use crate::scalar::weak;

/// A low-rank adapter on a linear layer (mlx-lm's `LoRALinear`): y + scale·((x·A)·B), the
/// update cast to x's dtype. A is [in, rank], B is [rank, out], both f32.
#[derive(Clone)]
pub struct Lora {
    pub a: Array,
    pub b: Array,
    pub scale: f32,
    /// Training-time dropout on the adapter's input: the drop probability and this step's
    /// key (no key: no dropout, as at inference).
    pub dropout: Option<(f32, Array)>,
    /// DoRA's magnitude (mlx-lm's `DoRALinear.m`, [out], f32): with it the layer computes
    /// DoRA (`train::lora::dora`), without it LoRA.
    pub m: Option<Array>,
}

/// `nn.Linear` (`x @ W.T`, or `addmm(b, x, W.T)` with a bias) or `nn.QuantizedLinear`
/// (`quantized_matmul(x, W, …)`, then `+ b`), as the checkpoint stores it.
pub struct Linear {
    pub weight: Array,
    pub bias: Option<Array>,
    pub quantized: Option<Quantized>,
    /// An adapter, when one is attached (training, or adapters loaded for inference).
    pub lora: std::cell::RefCell<Option<Lora>>,
    /// Tensor parallel, row-split (mlx's `ShardedToAllLinear`): this rank's partial product
    /// is summed over the ranks (`all_sum`) before the bias is added once.
    pub reduce: bool,
}

/// `nn.Dropout(p)` in training on an adapter's input: a Bernoulli keep-mask from this
/// step's key, the kept values scaled by 1/(1 − p); the input as it is without a key.
pub fn dropped(x: &Array, dropout: &Option<(f32, Array)>) -> R<Array> {
    match dropout {
        Some((p, key)) if *p > 0.0 => {
            let keep = mlx_rs::random::bernoulli(&Array::from_f32(1.0 - p), x.shape(), key)?;
            x.multiply(&keep)?
                .multiply(weak(1.0 / (1.0 - *p as f64), x)?)
        }
        _ => Ok(x.clone()),
    }
}

impl Linear {
    /// `<prefix>.weight` (and `.bias`), which config.json makes `[out, in]` (`[out]`): dense,
    /// or quantized with that dense shape.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        [out_dims, in_dims]: [i32; 2],
    ) -> Result<Self, LoadError> {
        let (weight, quantized) = Quantized::load_weight(w, prefix, &[out_dims, in_dims])?;
        Ok(Linear {
            weight,
            bias: if bias {
                Some(w.take_shaped(&format!("{prefix}.bias"), &[out_dims])?)
            } else {
                None
            },
            quantized,
            lora: Default::default(),
            reduce: false,
        })
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        if self.reduce {
            return self.forward_reduced(x);
        }
        if let Some(y) = dora::forward_if_any(self, x)? {
            return Ok(y);
        }
        let y = match (&self.quantized, &self.bias) {
            (Some(_), _) if dora::planted_dequantized_base(self) => {
                dora::dequantized_base(self, x)?
            }
            (Some(q), Some(b)) => q.matmul_t(x, &self.weight)?.add(b)?,
            (Some(q), None) => q.matmul_t(x, &self.weight)?,
            (None, Some(b)) => addmm(b, x, self.weight.t(), None, None)?,
            (None, None) => x.matmul(self.weight.t())?,
        };
        match &*self.lora.borrow() {
            None => Ok(y),
            Some(l) => {
                let x = dropped(x, &l.dropout)?;
                let z = x.matmul(&l.a)?.matmul(&l.b)?;
                let z = z.multiply(weak(l.scale as f64, &z)?)?.as_dtype(x.dtype())?;
                y.add(&z)
            }
        }
    }

    /// `ShardedToAllLinear.__call__` (and its quantized twin): `x @ W.T` or
    /// `quantized_matmul`, `all_sum`, then `+ bias` — never `addmm`.
    fn forward_reduced(&self, x: &Array) -> R<Array> {
        if self.lora.borrow().is_some() {
            return Err(Exception::custom(
                "LoRA adapters on a tensor-parallel model are not supported (as in mlx-lm)",
            ));
        }
        let y = match &self.quantized {
            Some(q) => q.matmul_t(x, &self.weight)?,
            None => x.matmul(self.weight.t())?,
        };
        let y = if crate::plant::is(crate::plant::Defect::DistReduceDropped) {
            y
        } else {
            crate::dist::all_sum(&y)?
        };
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// The input width (of the dense weight, or unpacked from a quantized one).
    pub fn input_dims(&self) -> i32 {
        let cols = self.weight.shape()[1];
        match &self.quantized {
            Some(q) => q.unpacked_width(cols),
            None => cols,
        }
    }

    pub fn output_dims(&self) -> i32 {
        self.weight.shape()[0]
    }
}

/// `nn.RMSNorm`: the fused `fast::rms_norm` kernel; or, loaded by `load_layer_norm`,
/// `nn.LayerNorm` (`fast::layer_norm`: mean-centered, with its bias where it has one), so
/// that a family with LayerNorms (Cohere 2) runs on the decoder's one norm type.
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
    /// optiq's drafter norm: computed in f32, cast back to the input's dtype.
    pub upcast: bool,
    /// Some: a LayerNorm, with its bias (None: `bias=False`).
    pub layer_norm: Option<Option<Array>>,
}

impl RmsNorm {
    /// `<prefix>.weight`, `dims` wide.
    pub fn load(w: &mut Weights, prefix: &str, dims: i32, eps: f32) -> Result<Self, LoadError> {
        Ok(RmsNorm {
            weight: w.take_shaped(&format!("{prefix}.weight"), &[dims])?,
            eps,
            upcast: false,
            layer_norm: None,
        })
    }

    /// `nn.LayerNorm(dims, eps, bias=…)`: `<prefix>.weight`, and `<prefix>.bias` where the
    /// checkpoint has one.
    pub fn load_layer_norm(
        w: &mut Weights,
        prefix: &str,
        dims: i32,
        eps: f32,
    ) -> Result<Self, LoadError> {
        let bias_name = format!("{prefix}.bias");
        let bias = match w.contains(&bias_name) {
            true => Some(w.take_shaped(&bias_name, &[dims])?),
            false => None,
        };
        Ok(RmsNorm {
            layer_norm: Some(bias),
            ..Self::load(w, prefix, dims, eps)?
        })
    }

    /// Gemma's RMSNorm, which scales by (1 + w): the sum is formed once, in w's dtype, as
    /// mlx-lm forms it on every call.
    pub fn load_one_plus(
        w: &mut Weights,
        prefix: &str,
        dims: i32,
        eps: f32,
    ) -> Result<Self, LoadError> {
        let mut norm = Self::load(w, prefix, dims, eps)?;
        let one = Array::from_f32(1.0).as_dtype(norm.weight.dtype())?;
        norm.weight = one.add(&norm.weight)?;
        Ok(norm)
    }

    /// The norm optiq's assistant drafter uses (`x.astype(f32)`, rms_norm, cast back).
    pub fn load_upcast(
        w: &mut Weights,
        prefix: &str,
        dims: i32,
        eps: f32,
    ) -> Result<Self, LoadError> {
        Ok(RmsNorm {
            upcast: true,
            ..Self::load(w, prefix, dims, eps)?
        })
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        if let Some(bias) = &self.layer_norm {
            return fast::layer_norm(x, &self.weight, bias.as_ref(), self.eps);
        }
        if self.upcast {
            return fast::rms_norm(
                x.as_dtype(mlx_rs::Dtype::Float32)?,
                Some(&self.weight),
                self.eps,
            )?
            .as_dtype(x.dtype());
        }
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// `nn.Embedding` (a gather of rows) or `nn.QuantizedEmbedding` (gather the packed rows,
/// then dequantize); `as_linear` is the tied output head.
pub struct Embedding {
    pub weight: Array,
    pub quantized: Option<Quantized>,
}

impl Embedding {
    /// `<prefix>.weight`: `rows` ids of `dims` each (dense, or quantized with that shape).
    pub fn load(w: &mut Weights, prefix: &str, [rows, dims]: [i32; 2]) -> Result<Self, LoadError> {
        let (weight, quantized) = Quantized::load_weight(w, prefix, &[rows, dims])?;
        Ok(Embedding { weight, quantized })
    }

    pub fn forward(&self, ids: &Array) -> R<Array> {
        match &self.quantized {
            None => self.weight.take_axis(ids, 0),
            Some(q) => q.rows(&self.weight, ids),
        }
    }

    /// How many rows (token ids) the table has.
    pub fn rows(&self) -> usize {
        self.weight.shape()[0] as usize
    }

    /// The dtype rows come out in (when quantized: the scales' dtype for affine, bfloat16
    /// for the floating-point modes).
    pub fn output_dtype(&self) -> mlx_rs::Dtype {
        self.quantized
            .as_ref()
            .map_or(self.weight.dtype(), Quantized::rows_dtype)
    }

    pub fn as_linear(&self, x: &Array) -> R<Array> {
        match &self.quantized {
            None => x.matmul(self.weight.t()),
            Some(q) => q.matmul_t(x, &self.weight),
        }
    }
}

pub use super::rope::Rope;

/// Multi-head attention with grouped KV heads and optional per-head q/k RMSNorm (Qwen3).
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Per head (`head_dim` wide: Qwen3's, Gemma's), or over the whole projection (as wide
    /// as it: OLMo 2's), which runs before the heads are split.
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub scale: f32,
    pub rope: Rope,
    /// Gemma normalizes q/k after moving heads forward, Qwen3 before; same math, but we
    /// keep each family's op order.
    pub norm_after_transpose: bool,
}

impl Attention {
    /// The four projections `{prefix}.{q,k,v,o}_proj` (with biases when `bias`) for
    /// `heads` query and `kv_heads` key/value heads of `head_dim` over `hidden`, and the
    /// defaults a family overrides with struct update syntax: no q/k norms, scale
    /// `head_dim ** -0.5` formed in double precision as Python does, no RoPE, norms
    /// before the heads move forward.
    pub fn load_projections(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        hidden: i32,
        heads: i32,
        kv_heads: i32,
        head_dim: i32,
    ) -> Result<Self, LoadError> {
        let (q_dims, kv_dims) = (heads * head_dim, kv_heads * head_dim);
        let proj = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
            Linear::load(w, &format!("{prefix}.{name}"), bias, out_in)
        };
        Ok(Attention {
            q_proj: proj(w, "q_proj", [q_dims, hidden])?,
            k_proj: proj(w, "k_proj", [kv_dims, hidden])?,
            v_proj: proj(w, "v_proj", [kv_dims, hidden])?,
            o_proj: proj(w, "o_proj", [hidden, q_dims])?,
            q_norm: None,
            k_norm: None,
            n_heads: heads,
            n_kv_heads: kv_heads,
            scale: (head_dim as f64).powf(-0.5) as f32,
            rope: Rope::None,
            norm_after_transpose: false,
        })
    }

    /// The four projections under mlx-lm's names within a block, where LoRA attaches.
    pub fn named_linears(&self) -> [(&'static str, &Linear); 4] {
        [
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ]
    }

    pub fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn AttentionCache) -> R<Array> {
        self.forward_with(x, cache, |q, _, kv| {
            super::sdpa::attend(&q, kv, self.scale, mask)
        })
    }

    /// The forward with `attend(q, offset, kv)` in place of the fused SDPA over the rotated
    /// queries: projections, norms, RoPE and the cache as [`Attention::forward`]. Gemma 2
    /// forms softcapped scores eagerly; Ministral 3 scales the queries by position (the
    /// step's RoPE offset) first.
    pub fn forward_with(
        &self,
        x: &Array,
        cache: &mut dyn AttentionCache,
        attend: impl FnOnce(Array, &RopeOffset, &crate::cache::Kv) -> R<Array>,
    ) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = |t: Array, n: i32, norm: Option<&RmsNorm>| -> R<Array> {
            let (t, norm) = match norm {
                Some(norm) if n > 1 && norm.weight.shape()[0] == t.shape()[2] => {
                    (whole_projection_norm(norm, &t, n)?, None)
                }
                _ => (t, norm),
            };
            let t = t.reshape(&[b, l, n, -1])?;
            match norm {
                None => t.transpose_axes(&[0, 2, 1, 3]),
                Some(norm) if self.norm_after_transpose => {
                    norm.forward(&t.transpose_axes(&[0, 2, 1, 3])?)
                }
                Some(norm) => norm.forward(&t)?.transpose_axes(&[0, 2, 1, 3]),
            }
        };
        let q = heads(self.q_proj.forward(x)?, self.n_heads, self.q_norm.as_ref())?;
        let k = heads(
            self.k_proj.forward(x)?,
            self.n_kv_heads,
            self.k_norm.as_ref(),
        )?;
        let v = heads(self.v_proj.forward(x)?, self.n_kv_heads, None)?;
        let offset = cache.rope_offset();
        let q = self.rope.forward(&q, &offset)?;
        let k = self.rope.forward(&k, &offset)?;
        let kv = cache.update_and_fetch(k, v)?;
        let out = attend(q, &offset, &kv)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&out)
    }
}

/// An RMSNorm over a whole [B, L, n · head_dim] projection (OLMo 2's q/k norms).
fn whole_projection_norm(norm: &RmsNorm, t: &Array, n: i32) -> R<Array> {
    if crate::plant::is(crate::plant::Defect::QkNormPerHead) {
        let s = t.shape();
        let heads = t.reshape(&[s[0], s[1], n, -1])?;
        let w = norm.weight.reshape(&[n, -1])?;
        let normed = fast::rms_norm(&heads, None, norm.eps)?.multiply(&w)?;
        return normed.reshape(&[s[0], s[1], -1]);
    }
    norm.forward(t)
}

/// One layer's cache in a family that mixes global and sliding-window layers, as mlx-lm's
/// `make_cache` builds it: a standard cache for global attention, a rotating cache of
/// `window` for a sliding layer.
pub fn layer_cache(global: bool, window: i32) -> Box<dyn Cache> {
    if global {
        Box::new(KvCache::new())
    } else {
        Box::new(RotatingKvCache::new(window))
    }
}

/// A shapeless-compiled function kept for the life of the thread, so it is traced once and
/// reused at every shape (as `mx.compile(shapeless=True)` is in Python). MLX work stays on
/// one thread, so a thread-local is the right owner.
pub type CompiledFn = Box<dyn FnMut(&[Array]) -> R<Vec<Array>>>;

pub fn compiled_shapeless(f: fn(&[Array]) -> R<Vec<Array>>) -> CompiledFn {
    let mut compiled = compile(f, true);
    Box::new(move |args: &[Array]| compiled(args))
}

fn swiglu_graph(args: &[Array]) -> R<Vec<Array>> {
    Ok(vec![mlx_rs::nn::silu(&args[0])?.multiply(&args[1])?])
}

/// `nn.gelu_approx`'s graph; its Python scalars are weak (they take x's dtype).
fn gelu_approx_graph(args: &[Array]) -> R<Vec<Array>> {
    let x = &args[0];
    let c = |v: f64| Array::from_f32(v as f32).as_dtype(x.dtype());
    let cubic = c(0.044715)?.multiply(x.power(c(3.0)?)?)?;
    let inner = c((2.0 / std::f64::consts::PI).sqrt())?.multiply(x.add(&cubic)?)?;
    let y = c(0.5)?
        .multiply(x)?
        .multiply(c(1.0)?.add(mlx_rs::ops::tanh(&inner)?)?)?;
    Ok(vec![y])
}

fn geglu_graph(args: &[Array]) -> R<Vec<Array>> {
    let (gate, x) = (&args[0], &args[1]);
    Ok(vec![gelu_approx_graph(std::slice::from_ref(gate))?
        .remove(0)
        .multiply(x)?])
}

fn softcap_graph(args: &[Array]) -> R<Vec<Array>> {
    let (x, cap) = (&args[0], &args[1]);
    Ok(vec![mlx_rs::ops::tanh(&x.divide(cap)?)?.multiply(cap)?])
}

thread_local! {
    static SWIGLU: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new(compiled_shapeless(swiglu_graph));
    static GELU_APPROX: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new(compiled_shapeless(gelu_approx_graph));
    static GEGLU: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new(compiled_shapeless(geglu_graph));
    static SOFTCAP: std::cell::RefCell<CompiledFn> = std::cell::RefCell::new(compiled_shapeless(softcap_graph));
}

/// mlx-lm's `swiglu`: `silu(gate) * x`, compiled shapeless as mlx-lm compiles it (the
/// compiled CPU/GPU kernel is what the reference runs, so we run it too).
pub fn swiglu(gate: &Array, x: &Array) -> R<Array> {
    SWIGLU.with_borrow_mut(|f| Ok(f(&[gate.clone(), x.clone()])?.remove(0)))
}

/// `nn.gelu_approx` (gelu with the tanh approximation), compiled shapeless as MLX compiles
/// it.
pub fn gelu_approx(x: &Array) -> R<Array> {
    GELU_APPROX.with_borrow_mut(|f| Ok(f(std::slice::from_ref(x))?.remove(0)))
}

/// mlx-lm's compiled `geglu(gate, x)` = gelu_approx(gate) · x, one compiled graph (Gemma 4).
pub fn geglu(gate: &Array, x: &Array) -> R<Array> {
    GEGLU.with_borrow_mut(|f| Ok(f(&[gate.clone(), x.clone()])?.remove(0)))
}

/// mlx-lm's compiled `logit_softcap(cap, x)` = cap · tanh(x / cap), cap a weak scalar.
pub fn softcap(x: &Array, cap: f32) -> R<Array> {
    let cap = weak(cap as f64, x)?;
    SOFTCAP.with_borrow_mut(|f| Ok(f(&[x.clone(), cap])?.remove(0)))
}

/// A final logit softcap `c · tanh(logits / c)`, as mlx-lm writes it for the family:
/// through its compiled `logit_softcap` (Gemma 4) or as eager ops (Gemma 2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Softcap {
    Compiled(f32),
    Eager(f32),
}

/// How a gated MLP combines `gate(x)` and `up(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glu {
    /// `swiglu(gate, up)`, one compiled graph (the Llama family).
    Swiglu,
    /// `gelu_approx(gate) * up`: the compiled gelu, then an eager product (Gemma 3's MLP,
    /// optiq's assistant drafter).
    GeluApprox,
    /// `geglu(gate, up)`, one compiled graph (Gemma 4's MLP).
    Geglu,
}

/// The gated MLP: `down(glu(gate(x), up(x)))`.
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub glu: Glu,
}

impl Mlp {
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        hidden: i32,
        intermediate: i32,
        glu: Glu,
    ) -> Result<Self, LoadError> {
        let (up, down) = ([intermediate, hidden], [hidden, intermediate]);
        Ok(Mlp {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), bias, up)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), bias, up)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), bias, down)?,
            glu,
        })
    }

    /// The three projections under mlx-lm's names within a block, where LoRA attaches.
    pub fn named_linears(&self) -> [(&'static str, &Linear); 3] {
        [
            ("mlp.gate_proj", &self.gate_proj),
            ("mlp.up_proj", &self.up_proj),
            ("mlp.down_proj", &self.down_proj),
        ]
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        let (gate, up) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
        let gated = match self.glu {
            Glu::Swiglu => swiglu(&gate, &up)?,
            Glu::GeluApprox => gelu_approx(&gate)?.multiply(&up)?,
            Glu::Geglu => geglu(&gate, &up)?,
        };
        self.down_proj.forward(&gated)
    }
}

/// The output head every family ends in: the final norm (`model.norm`), then the
/// checkpoint's `lm_head` or — tied — the input embedding as a linear
/// (`embed_tokens.as_linear`), then the logit softcap where the family has one (Gemma 4's
/// `final_logit_softcapping`).
pub struct OutputHead {
    pub norm: RmsNorm,
    /// None: tied to the input embedding.
    pub lm_head: Option<Linear>,
    pub softcap: Option<Softcap>,
    /// `normed / d` before `lm_head` (MiniCPM's `hidden_size / dim_model_base`, a Python
    /// float: weak).
    pub input_divisor: Option<f64>,
    /// Tensor parallel with a vocabulary-split `lm_head` (qwen3_5's `Model.shard`): the
    /// ranks' logit columns are gathered after it (`gather_last_axis`); 1 otherwise.
    pub vocab_parts: usize,
    /// The normed state divided by this (a Python float: weak) before an untied `lm_head`
    /// (MiniCPM 3's `hidden_size / dim_model_base`); the tied head reads it undivided.
    pub untied_input_divisor: Option<f64>,
}

impl OutputHead {
    /// The head over an already loaded final `norm`: `lm_head` ([vocab, hidden], with its
    /// bias where `bias`) is loaded unless the head is `tied`.
    pub fn load(
        w: &mut Weights,
        norm: RmsNorm,
        tied: bool,
        [vocab, hidden]: [i32; 2],
        softcap: Option<Softcap>,
        bias: bool,
    ) -> Result<Self, LoadError> {
        let lm_head = if tied {
            None
        } else {
            Some(Linear::load(w, "lm_head", bias, [vocab, hidden])?)
        };
        Ok(OutputHead {
            norm,
            lm_head,
            softcap,
            input_divisor: None,
            vocab_parts: 1,
            untied_input_divisor: None,
        })
    }

    /// Logits of the last hidden state: softcap(head(norm(h))).
    pub fn forward(&self, embed: &Embedding, h: &Array) -> R<Array> {
        let normed = self.norm.forward(h)?;
        let normed = match self.input_divisor {
            Some(d) => normed.divide(weak(d, &normed)?)?,
            None => normed,
        };
        let logits = self.project(embed, &normed)?;
        match self.softcap {
            Some(Softcap::Compiled(cap)) => softcap(&logits, cap),
            Some(Softcap::Eager(cap)) => {
                let cap = weak(cap as f64, &logits)?;
                mlx_rs::ops::tanh(&logits.divide(&cap)?)?.multiply(&cap)
            }
            None => Ok(logits),
        }
    }

    /// `lm_head`, or the tied embedding, on a hidden state already through the final norm;
    /// no softcap.
    pub fn project(&self, embed: &Embedding, normed: &Array) -> R<Array> {
        if let (Some(d), Some(head)) = (self.untied_input_divisor, &self.lm_head) {
            return head.forward(&normed.divide(weak(d, normed)?)?);
        }
        match &self.lm_head {
            Some(head) if self.vocab_parts > 1 => {
                gather_last_axis(&head.forward(normed)?, self.vocab_parts as i32)
            }
            Some(head) => head.forward(normed),
            None => embed.as_linear(normed),
        }
    }

    /// The width of the logits: the head's outputs, or the tied table's rows.
    pub fn width(&self, embed: &Embedding) -> usize {
        self.lm_head.as_ref().map_or(embed.rows(), |h| {
            h.output_dims() as usize * self.vocab_parts
        })
    }
}

/// mlx-lm's `gather_last_axis(x, group)`: `x`'s last axis, split over the `n` ranks, whole
/// again on every rank (all_gather of the rows, then the ranks' columns side by side in rank
/// order).
fn gather_last_axis(x: &Array, n: i32) -> R<Array> {
    let shape = x.shape().to_vec();
    let size = shape[shape.len() - 1];
    let parts = crate::dist::all_gather(&x.reshape(&[-1, size])?)?;
    let parts = parts.reshape(&[n, -1, size])?.transpose_axes(&[1, 0, 2])?;
    let mut whole = shape[..shape.len() - 1].to_vec();
    whole.push(n * size);
    parts.reshape(&whole)
}
