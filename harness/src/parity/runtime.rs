//! The runtime golden (`goldens/runtime`, made by `oracles/gen_runtime.py`): each case draws
//! its inputs from explicitly keyed MLX RNG calls, runs a few ops, and must reproduce the
//! Python results bit for bit. The Rust side mirrors the script op by op.

use mlx_rs::error::Exception;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::{quantize, quantized_matmul, softmax_axis};
use mlx_rs::transforms::value_and_grad;
use mlx_rs::{random, Array, Dtype};

use super::{ParityError, Report};
use crate::compare::{compare, Comparison};
use crate::goldens::TensorGolden;

/// The cases of `oracles/gen_runtime.py`, in its order.
pub const CASES: [&str; 6] = [
    "normal_matmul_softmax",
    "rms_norm",
    "sdpa_gqa",
    "quantized_matmul",
    "value_and_grad",
    "half_matmul",
];

/// A deliberate defect, for proving the gate can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    None,
    /// Add 1 to the first value of the case's first input.
    FirstInputValue,
}

/// One tensor's verdict.
#[derive(Debug, Clone)]
pub struct TensorReport {
    pub case: String,
    pub tensor: String,
    pub comparison: Comparison,
}

fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Result<Array, Exception> {
    let key = random::key(seed)?;
    random::normal::<f32>(shape, None, None, &key)?.as_dtype(dtype)
}

fn f32_normal(shape: &[i32], seed: u64) -> Result<Array, Exception> {
    normal(shape, seed, Dtype::Float32)
}

fn tamper_first(x: Array, tamper: Tamper) -> Result<Array, Exception> {
    if tamper == Tamper::None {
        return Ok(x);
    }
    let mut bump = vec![0.0f32; x.size()];
    bump[0] = 1.0;
    let bump = Array::from_slice(&bump, x.shape()).as_dtype(x.dtype())?;
    x.add(bump)
}

/// Runs case `name` in Rust; returns its named outputs in the golden's tensor names.
pub fn run_case(name: &str, tamper: Tamper) -> Result<Vec<(&'static str, Array)>, ParityError> {
    Ok(match name {
        "normal_matmul_softmax" => {
            let a = tamper_first(f32_normal(&[8, 32], 1)?, tamper)?;
            let b = f32_normal(&[32, 16], 2)?;
            let y = softmax_axis(a.matmul(&b)?, -1, None)?;
            vec![("a", a), ("b", b), ("y", y)]
        }
        "rms_norm" => {
            let x = tamper_first(f32_normal(&[4, 64], 3)?, tamper)?;
            let w = f32_normal(&[64], 4)?;
            let y = fast::rms_norm(&x, Some(&w), 1e-5)?;
            vec![("x", x), ("w", w), ("y", y)]
        }
        "sdpa_gqa" => {
            let q = tamper_first(f32_normal(&[1, 4, 8, 16], 5)?, tamper)?;
            let k = f32_normal(&[1, 2, 12, 16], 6)?;
            let v = f32_normal(&[1, 2, 12, 16], 7)?;
            let none = fast::scaled_dot_product_attention(&q, &k, &v, 0.25, None, None)?;
            let causal = fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                0.25,
                ScaledDotProductAttentionMask::Causal,
                None,
            )?;
            vec![("y_none", none), ("y_causal", causal)]
        }
        "quantized_matmul" => {
            let w = tamper_first(f32_normal(&[64, 128], 8)?, tamper)?;
            let x = f32_normal(&[3, 128], 9)?;
            let (wq, scales, biases) = quantize(&w, 64, 4)?;
            let y = quantized_matmul(&x, &wq, &scales, &biases, true, 64, 4)?;
            vec![("wq", wq), ("scales", scales), ("biases", biases), ("y", y)]
        }
        "value_and_grad" => {
            let x = tamper_first(f32_normal(&[5, 12], 10)?, tamper)?;
            let w = f32_normal(&[12, 7], 11)?;
            let loss = move |args: &[Array]| -> Result<Vec<Array>, Exception> {
                let probs = softmax_axis(x.matmul(&args[0])?, -1, None)?;
                Ok(vec![probs.square()?.sum(None)?])
            };
            let (values, grads) = value_and_grad(loss)(&[w])?;
            let value = values.into_iter().next().expect("one value");
            let grad = grads.into_iter().next().expect("one gradient");
            vec![("value", value), ("grad", grad)]
        }
        "half_matmul" => {
            let a_bf16 = tamper_first(normal(&[6, 32], 12, Dtype::Bfloat16)?, tamper)?;
            let b_bf16 = normal(&[32, 10], 13, Dtype::Bfloat16)?;
            let a_f16 = normal(&[6, 32], 12, Dtype::Float16)?;
            let b_f16 = normal(&[32, 10], 13, Dtype::Float16)?;
            let y_bf16 = a_bf16.matmul(&b_bf16)?;
            let y_f16 = a_f16.matmul(&b_f16)?;
            vec![
                ("a_bf16", a_bf16),
                ("y_bf16", y_bf16),
                ("a_f16", a_f16),
                ("y_f16", y_f16),
            ]
        }
        other => return Err(ParityError::UnknownCase(other.to_owned())),
    })
}

/// Runs one case and compares every output it shares with the golden.
fn check_case(
    golden: &TensorGolden,
    name: &str,
    tamper: Tamper,
) -> Result<Vec<TensorReport>, ParityError> {
    let mut reports = Vec::new();
    for (tensor, array) in run_case(name, tamper)? {
        let (entry, bytes) = golden.tensor(name, tensor)?;
        reports.push(TensorReport {
            case: name.to_owned(),
            tensor: tensor.to_owned(),
            comparison: compare(&array, &entry, bytes)?,
        });
    }
    Ok(reports)
}

/// Every tensor of the cases run.
#[derive(Debug, Clone)]
pub struct RuntimeReport {
    pub tensors: Vec<TensorReport>,
}

impl Report for RuntimeReport {
    fn summary(&self) -> String {
        let exact = self
            .tensors
            .iter()
            .filter(|r| r.comparison.bit_exact)
            .count();
        format!(
            "runtime golden: {exact}/{} tensors bit-exact vs Python mlx",
            self.tensors.len()
        )
    }

    /// The tensors that are not bit-exact.
    fn details(&self) -> Vec<String> {
        self.tensors
            .iter()
            .filter(|r| !r.comparison.bit_exact)
            .map(|r| format!("  {}/{}: {}", r.case, r.tensor, r.comparison))
            .collect()
    }

    fn passed(&self) -> bool {
        !self.tensors.is_empty() && self.tensors.iter().all(|r| r.comparison.bit_exact)
    }
}

/// Runs `case` (default: every case) against the golden.
pub fn run(
    golden: &TensorGolden,
    case: Option<&str>,
    tamper: Tamper,
) -> Result<RuntimeReport, ParityError> {
    let mut tensors = Vec::new();
    for name in CASES
        .into_iter()
        .filter(|c| case.is_none_or(|want| want == *c))
    {
        tensors.extend(check_case(golden, name, tamper)?);
    }
    match case {
        Some(name) if tensors.is_empty() => Err(ParityError::UnknownCase(name.to_owned())),
        _ => Ok(RuntimeReport { tensors }),
    }
}
