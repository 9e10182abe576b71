//! Memory-phase probes (`harness probe memory`): one LoRA SFT training step at a time, MLX's
//! peak memory read and reset after each phase — the forward, the head, each segment's
//! backward (segmented) or the one whole backward, the optimizer step — for the whole-model
//! backward and for segmented backward at 1×, 2× and 4× a base sequence length. Peaks are
//! reported as measured (weights included) and above the step's starting active memory
//! (what the step itself needs). A leak check compares active memory after the first and
//! the last of several steps. `memory_modes` takes any set of configurations (segmented
//! backward and the chunked cross-entropy, each on or off) and also times each step, by
//! wall clock and by the process's CPU time.

use std::path::Path;

use anyhow::Result;

use crate::plot::{Figure, Panel, Series};
use engine::train::data::Example;
use engine::train::lora::{AdapterConfig, Adapters};
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
    /// (mode, seq, step wall time ms: the median over the steps after the first).
    pub step_ms: Vec<(String, usize, f64)>,
    /// (mode, seq, the process's CPU time per step, ms, median likewise): what the step
    /// costs whatever else shares the machine.
    pub step_cpu_ms: Vec<(String, usize, f64)>,
}

/// The median of the steps after the first (which builds the optimizer state).
fn warm_median(mut v: Vec<f64>) -> f64 {
    let mut warm = v.split_off(1.min(v.len()));
    warm.sort_by(f64::total_cmp);
    warm.get(warm.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The process's user + system CPU time so far, ms (`/proc/self/stat`, in USER_HZ = 100
/// ticks a second; NaN where there is no procfs).
fn cpu_ms() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command's closing parenthesis: state is the 3rd field, utime the 14th.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(f64::NAN))
        .collect();
    match (f.get(11), f.get(12)) {
        (Some(u), Some(s)) => (u + s) * 10.0,
        _ => f64::NAN,
    }
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

/// One configuration of the step: segmented backward and the chunked loss, each or not.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    pub segment_size: Option<usize>,
    pub loss_chunk: Option<usize>,
}

impl Mode {
    /// `whole`, `segmented-S`, `chunked-N`, `chunked-N+segmented-S`.
    pub fn name(&self) -> String {
        let seg = self.segment_size.map(|s| format!("segmented-{s}"));
        let chunk = self.loss_chunk.map(|n| format!("chunked-{n}"));
        match (chunk, seg) {
            (None, None) => "whole".into(),
            (Some(c), Some(s)) => format!("{c}+{s}"),
            (c, s) => c.or(s).unwrap_or_default(),
        }
    }
}

/// Probes `model` at sequence lengths `seqs` (batch of 2), whole vs `segment_size`.
pub fn memory(
    model_dir: &Path,
    seqs: &[usize],
    segment_size: usize,
    steps: usize,
) -> Result<ProbeResult> {
    let modes = [None, Some(segment_size)].map(|segment_size| Mode {
        segment_size,
        loss_chunk: None,
    });
    memory_modes(model_dir, seqs, &modes, steps)
}

/// Probes `model` at sequence lengths `seqs` (batch of 2) in each of `modes`.
pub fn memory_modes(
    model_dir: &Path,
    seqs: &[usize],
    modes: &[Mode],
    steps: usize,
) -> Result<ProbeResult> {
    let model = engine::model::load(model_dir)?;
    let vocab = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(
        model_dir.join("config.json"),
    )?)?["vocab_size"]
        .as_i64()
        .unwrap_or(1024) as i32;
    let config = AdapterConfig::lora(usize::MAX, 8);
    let adapters = Adapters::attach(model.as_ref(), config, 0)?;
    let mut result = ProbeResult {
        phases: Vec::new(),
        steps: Vec::new(),
        step_ms: Vec::new(),
        step_cpu_ms: Vec::new(),
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
        for m in modes {
            let mode = m.name();
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
                segment_size: m.segment_size,
                orpo_forward: Default::default(),
                lambda_controller: None,
                actuated: engine::train::lambda::Actuated::Lambda,
                loss_chunk: m.loss_chunk,
            };
            let (last, step_peak, active, times, cpu) =
                run_steps(model.as_ref(), &adapters, &data, &cfg, &mode, seq)?;
            result.phases.extend(last);
            let (ms, cpu_ms) = (warm_median(times), warm_median(cpu));
            eprintln!(
                "{mode} seq {seq}: step peak {step_peak:.1} MB above start, {ms:.0} ms, \
                 {cpu_ms:.0} ms CPU"
            );
            result.step_ms.push((mode.clone(), seq, ms));
            result.step_cpu_ms.push((mode.clone(), seq, cpu_ms));
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

/// The probe steps of one mode at one length: the last step's phases, the step peak above
/// its start, active memory after each step, and wall and CPU times (ms).
type StepRun = (Vec<PhasePeak>, f64, Vec<f64>, Vec<f64>, Vec<f64>);

fn run_steps(
    model: &dyn engine::model::LanguageModel,
    adapters: &Adapters,
    data: &Dataset,
    cfg: &TrainConfig,
    mode: &str,
    seq: usize,
) -> Result<StepRun> {
    let mut opt = AdamW::new(Schedule::Constant(1e-4), 0.01);
    let mut active = Vec::new();
    let mut last = Vec::new();
    let mut step_peak = 0.0f64;
    let (mut times, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..cfg.iters {
        mlx_rs::memory::clear_cache()?;
        let start = mb(engine::runtime::memory()?.active);
        engine::runtime::reset_peak_memory()?;
        let mut rec = Recorder {
            mode: mode.to_string(),
            seq,
            start,
            rows: Vec::new(),
        };
        let (tic, cpu0) = (std::time::Instant::now(), cpu_ms());
        let (out, grads) = batch_grads(model, adapters, data, &[0, 1], cfg, &mut rec)?;
        engine::train::apply_update(&mut opt, adapters, &grads, &[&out[0]])?;
        times.push(tic.elapsed().as_secs_f64() * 1e3);
        cpu.push(cpu_ms() - cpu0);
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
    Ok((last, step_peak, active, times, cpu))
}

impl ProbeResult {
    pub fn table(&self) -> String {
        let mut s = String::from(
            "mode                      seq   phase                 peak MB   above start MB\n",
        );
        for p in &self.phases {
            s += &format!(
                "{:25} {:5} {:20} {:9.1} {:12.1}\n",
                p.mode, p.seq, p.phase, p.peak_mb, p.above_start_mb
            );
        }
        s += "\nmode                      seq   step peak above start MB   step ms    CPU ms   active after step 1 → last (MB)\n";
        let times = self.step_ms.iter().zip(&self.step_cpu_ms);
        for ((mode, seq, peak, a0, a1), ((_, _, ms), (_, _, cpu))) in self.steps.iter().zip(times) {
            s += &format!("{mode:25} {seq:5} {peak:26.1} {ms:9.1} {cpu:9.1}   {a0:.1} → {a1:.1}\n");
        }
        s
    }
}

impl ProbeResult {
    /// A mode's step peak above start (MB) and step time (ms) at `seq`.
    pub fn at(&self, mode: &str, seq: usize) -> Option<(f64, f64)> {
        let peak = self.steps.iter().find(|x| x.0 == mode && x.1 == seq)?.2;
        let ms = self.step_ms.iter().find(|x| x.0 == mode && x.1 == seq)?.2;
        Some((peak, ms))
    }

    /// A mode's CPU time per step (ms) at `seq`.
    pub fn cpu_at(&self, mode: &str, seq: usize) -> Option<f64> {
        let x = self
            .step_cpu_ms
            .iter()
            .find(|x| x.0 == mode && x.1 == seq)?;
        Some(x.2)
    }

    /// Step peak and step time against the sequence length, one line per mode (log x).
    pub fn plot(&self, title: &str) -> String {
        // Each mode once, in the order first measured (rows run seq by seq).
        let mut modes: Vec<String> = Vec::new();
        for x in &self.steps {
            if !modes.contains(&x.0) {
                modes.push(x.0.clone());
            }
        }
        let series = |pick: fn(&Self, &str, usize) -> Option<f64>| -> Vec<Option<Series>> {
            let mut seqs: Vec<usize> = self.steps.iter().map(|x| x.1).collect();
            seqs.sort_unstable();
            seqs.dedup();
            let line = |m: &String| Series {
                name: m.clone(),
                points: seqs
                    .iter()
                    .filter_map(|&s| pick(self, m, s).map(|v| (s as f64, v)))
                    .collect(),
            };
            modes.iter().map(|m| Some(line(m))).collect()
        };
        let panel = |name: &str, pick: fn(&Self, &str, usize) -> Option<f64>| Panel {
            title: name.into(),
            x_label: "sequence length (tokens per row, batch 2)".into(),
            series: series(pick),
            log_x: true,
            y_from_zero: true,
        };
        crate::plot::svg(&Figure {
            title: title.into(),
            legend: modes.clone(),
            panels: vec![
                panel("step peak above start (MB)", |r, m, s| {
                    r.at(m, s).map(|x| x.0)
                }),
                panel("step wall time (ms)", |r, m, s| r.at(m, s).map(|x| x.1)),
                panel("step CPU time (ms)", |r, m, s| r.cpu_at(m, s)),
            ],
        })
    }
}
