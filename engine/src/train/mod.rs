//! Fine-tuning: LoRA adapters (`lora`), mlx-lm's SFT loss (`loss`), AdamW and schedules as
//! mlx.optimizers runs them (`optim`), and one training step: the loss and the adapters'
//! gradients from MLX's autodiff over the same forward the engine decodes with.

pub mod chunked;
pub mod cli;
pub mod compiled;
pub mod compiled_probe;
pub mod data;
pub mod grpo;
pub mod grpo_cli;
pub mod grpo_train;
pub mod lambda;
pub mod lora;
pub mod loss;
pub mod optim;
pub mod orpo;
pub mod orpo_prefix;
pub mod preference;
pub mod preference_cli;
pub mod preference_data;
pub mod progress;
pub mod reward;
pub mod segmented;
pub mod setup;
pub mod trainer;

use std::path::{Path, PathBuf};

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::model::LanguageModel;
use lora::Adapters;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("MLX: {0}")]
    Mlx(#[from] Exception),
    #[error(transparent)]
    Load(#[from] crate::load::LoadError),
}

/// Writes `bytes` to a temporary sibling, syncs it and renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let io = |e| TrainError::Io(tmp.clone(), e);
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::Io(path.to_path_buf(), e))
}

/// The outputs of `f` (which runs the model with the adapters attached) and the gradient
/// of its first output with respect to every adapter parameter (`adapters.params()` order).
pub fn value_and_grad(
    adapters: &Adapters,
    mut f: impl FnMut() -> Result<Vec<Array>, Exception>,
) -> Result<(Vec<Array>, Vec<Array>), Exception> {
    let params = adapters.params();
    let argnums: Vec<i32> = (0..params.len() as i32).collect();
    let traced = |p: &[Array]| -> Result<Vec<Array>, Exception> {
        adapters.set(p);
        f()
    };
    let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(traced, &argnums[..]);
    let result = vg(&params);
    // The closure left tracers in the layers; put the real parameters back either way.
    adapters.set(&params);
    result
}

/// One optimizer update of the adapters from `grads`, evaluated together with `also` (the
/// step's loss, its gradient norm, …) so nothing of the step stays lazy.
pub fn apply_update(
    opt: &mut optim::AdamW,
    adapters: &Adapters,
    grads: &[Array],
    also: &[&Array],
) -> Result<(), Exception> {
    let next = opt.update(&adapters.params(), grads)?;
    adapters.set(&next);
    let mut state: Vec<&Array> = next.iter().collect();
    state.extend(opt.state());
    state.extend(also);
    mlx_rs::transforms::eval(state)
}

/// The SFT loss on a batch and its gradient (mlx-lm's `default_loss`): (loss, supervised
/// token count, gradients).
pub fn loss_and_grad(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    batch: &Array,
    lengths: &Array,
) -> Result<(Array, Array, Vec<Array>), Exception> {
    let (values, grads) = value_and_grad(adapters, || {
        let (loss, ntoks) = loss::default_loss(model, batch, lengths)?;
        Ok(vec![loss, ntoks])
    })?;
    Ok((values[0].clone(), values[1].clone(), grads))
}
