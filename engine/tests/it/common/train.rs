//! What the training gates share: a run's settings with the tests' defaults, and LoRA
//! adapters whose every parameter gets a gradient.

use engine::model::LanguageModel;
use engine::train::lora::{AdapterConfig, Adapters};
use engine::train::trainer::{Method, TrainConfig};
use mlx_rs::{Array, Dtype};

/// `method` with one step of batch 2, no eval or save, λ 0.1, the full NLL scope, the
/// default forward, no controller, no segments and no loss chunks (override fields with
/// `TrainConfig { …, ..config(method) }`).
pub fn config(method: Method) -> TrainConfig {
    TrainConfig {
        method,
        iters: 1,
        batch_size: 2,
        grad_accumulation: 1,
        max_grad_norm: None,
        steps_per_eval: usize::MAX,
        val_batches: 0,
        save_every: 0,
        max_seq_length: 2048,
        seed: 0,
        orpo_lambda: 0.1,
        sft_scope: engine::train::orpo::SftScope::Full,
        segment_size: None,
        orpo_forward: Default::default(),
        lambda_controller: None,
        actuated: engine::train::lambda::Actuated::Lambda,
        loss_chunk: None,
    }
}

/// Rank-4 LoRA on every linear of `m` with nonzero B (so every adapter parameter gets a
/// gradient) drawn from keys `key_base + i`, in values bf16 holds exactly (a bf16 model
/// and its f32 copy start from the same adapters).
pub fn attach_nonzero(m: &dyn LanguageModel, key_base: u64) -> Adapters<'_> {
    let config = AdapterConfig::lora(usize::MAX, 4);
    let adapters = Adapters::attach(m, config, 3).unwrap();
    let params: Vec<Array> = adapters
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let key = mlx_rs::random::key(key_base + i as u64).unwrap();
            mlx_rs::random::normal::<f32>(p.shape(), None, None, &key)
                .unwrap()
                .multiply(Array::from_f32(0.01))
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap()
                .as_dtype(p.dtype())
                .unwrap()
        })
        .collect();
    adapters.set(&params);
    adapters
}
