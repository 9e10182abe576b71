//! Memory-phase probes (`harness probe memory`): one LoRA SFT training step at a time, MLX's
//! peak memory read and reset after each phase — the forward, the head, each segment's
//! backward (segmented) or the one whole backward, the optimizer step — for the whole-model
//! backward and for segmented backward at 1×, 2× and 4× a base sequence length. Peaks are
//! reported as measured (weights included) and above the step's starting active memory
//! (what the step itself needs). A leak check compares active memory after the first and
//! the last of several steps.

use std::path::Path;

use anyhow::Result;
use engine::train::data::Example;
use engine::train::lora::{AdapterConfig, Adapters, LoraParams};
use engine::train::optim::{AdamW, Schedule};
use engine::train::orpo::SftScope;
use engine::train::segmented::Phases;
use engine::train::trainer::{batch_grads, Dataset, Method, TrainConfig};

/// One phase's peak.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PhasePeak {
    pub mode: String,
    pub seq: usize,
    pub phase: String,
    pub peak_mb: f64,
    /// Above the active memory when the step started.
    pub above_start_mb: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeResult {
    pub phases: Vec<PhasePeak>,
    /// (mode, seq, step peak above start MB, active MB after the first step, after the last).
    pub steps: Vec<(String, usize, f64, f64, f64)>,
}

struct Recorder {
    mode: String,
    seq: usize,
    start: f64,
    rows: Vec<PhasePeak>,
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / 1e6
}

impl Phases for Recorder {
    fn phase(&mut self, name: &str) {
        let peak = engine::runtime::memory().map_or(0.0, |m| mb(m.peak));
        self.rows.push(PhasePeak {
            mode: self.mode.clone(),
            seq: self.seq,
            phase: name.into(),
            peak_mb: peak,
            above_start_mb: peak - self.start,
        });
        let _ = engine::runtime::reset_peak_memory();
    }
}

/// Probes `model` at sequence lengths `seqs` (batch of 2), whole vs `segment_size`.
pub fn memory(
    model_dir: &Path,
    seqs: &[usize],
    segment_size: usize,
    steps: usize,
) -> Result<ProbeResult> {
    let model = engine::model::load(model_dir)?;
    let vocab = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(
        model_dir.join("config.json"),
    )?)?["vocab_size"]
        .as_i64()
        .unwrap_or(1024) as i32;
    let config = AdapterConfig {
        fine_tune_type: "lora".into(),
        num_layers: usize::MAX,
        lora_parameters: LoraParams {
            rank: 8,
            scale: 20.0,
            dropout: 0.0,
            keys: None,
        },
        extra: Default::default(),
    };
    let adapters = Adapters::attach(model.as_ref(), config, 0)?;
    let mut result = ProbeResult {
        phases: Vec::new(),
        steps: Vec::new(),
    };
    for &seq in seqs {
        let data = Dataset::Sft(
            (0..2u64)
                .map(|i| Example {
                    tokens: crate::bench::prompt_ids(seq, vocab, 40 + i),
                    offset: 0,
                })
                .collect(),
        );
        for segment in [None, Some(segment_size)] {
            let mode = segment.map_or("whole".to_owned(), |s| format!("segmented-{s}"));
            let cfg = TrainConfig {
                method: Method::Sft,
                iters: steps,
                batch_size: 2,
                grad_accumulation: 1,
                max_grad_norm: None,
                steps_per_eval: usize::MAX,
                val_batches: 0,
                save_every: 0,
                max_seq_length: seq + 1,
                seed: 0,
                orpo_lambda: 0.1,
                sft_scope: SftScope::Full,
                segment_size: segment,
                orpo_forward: Default::default(),
                lambda_controller: None,
                loss_chunk: None,
            };
            let mut opt = AdamW::new(Schedule::Constant(1e-4), 0.01);
            let mut active = Vec::new();
            let mut last = Vec::new();
            let mut step_peak = 0.0f64;
            for _ in 0..steps {
                mlx_rs::memory::clear_cache()?;
                let start = mb(engine::runtime::memory()?.active);
                engine::runtime::reset_peak_memory()?;
                let mut rec = Recorder {
                    mode: mode.clone(),
                    seq,
                    start,
                    rows: Vec::new(),
                };
                let (out, grads) =
                    batch_grads(model.as_ref(), &adapters, &data, &[0, 1], &cfg, &mut rec)?;
                engine::train::apply_update(&mut opt, &adapters, &grads, &[&out[0]])?;
                rec.phase("optimizer");
                drop((out, grads));
                step_peak = rec
                    .rows
                    .iter()
                    .map(|r| r.above_start_mb)
                    .fold(0.0, f64::max);
                active.push(mb(engine::runtime::memory()?.active));
                last = rec.rows;
            }
            result.phases.extend(last);
            result.steps.push((
                mode,
                seq,
                step_peak,
                active[0],
                *active.last().unwrap_or(&0.0),
            ));
        }
    }
    Ok(result)
}

impl ProbeResult {
    pub fn table(&self) -> String {
        let mut s =
            String::from("mode          seq   phase                 peak MB   above start MB\n");
        for p in &self.phases {
            s += &format!(
                "{:13} {:5} {:20} {:9.1} {:12.1}\n",
                p.mode, p.seq, p.phase, p.peak_mb, p.above_start_mb
            );
        }
        s += "\nmode          seq   step peak above start MB   active after step 1 → last (MB)\n";
        for (mode, seq, peak, a0, a1) in &self.steps {
            s += &format!("{mode:13} {seq:5} {peak:26.1}   {a0:.1} → {a1:.1}\n");
        }
        s
    }
}
