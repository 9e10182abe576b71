//! Generation, mirroring mlx-lm's `generate_step`: the prompt minus its last token is
//! prefilled in chunks of `prefill_step` (caches evaluated after each), then every step
//! feeds one token and reads the logits of the last position. Greedy picks
//! argmax(logits − logsumexp(logits)), exactly as mlx-lm's default sampler sees them.

pub mod assistant;
pub mod batch;
pub mod batch_draft;
pub mod batch_lookup;
pub mod bench;
pub mod budget;
pub mod compiled;
pub mod decode;
pub mod drafter;
pub mod lookup;
pub mod probe;
pub mod profile;
pub mod rollback;
pub mod sampler;
pub mod speculative;
pub mod stop;

use std::time::Duration;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

/// The KV quantization plan lives with the caches it converts; reachable here too.
pub use crate::cache::kv_quant::{self, KvLayers, KvQuantPlan};
use crate::cache::Cache;
use crate::model::LanguageModel;
use sampler::{Sampler, SamplingParams};

/// mlx-lm's default prefill chunk.
pub const PREFILL_STEP: usize = 2048;

/// Whether one-token steps run through the compiled graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompileDecode {
    /// Always eager (`--no-compile`).
    Off,
    /// Where it is bit-exact with eager, each path timed over the first one-token steps and
    /// the faster one kept (`probe`); the default.
    WherePays,
    /// Compiled wherever it is bit-exact with eager (see `compiled_decode_is_exact`).
    WhereExact,
    /// Compiled regardless (for measurements and planted-defect checks).
    Always,
}

/// How a session runs: the compiled-decode policy and KV quantization, and the probe
/// choices it shares with the owner's other sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOptions {
    pub compile: CompileDecode,
    pub kv_quant: Option<KvQuantPlan>,
    /// `WherePays`: recent probe choices its clones share (`probe::Memo`; none by default).
    pub probe_memo: probe::Memo,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            compile: CompileDecode::WherePays,
            kv_quant: None,
            probe_memo: probe::Memo::default(),
        }
    }
}

impl From<CompileDecode> for SessionOptions {
    fn from(compile: CompileDecode) -> Self {
        SessionOptions {
            compile,
            ..Default::default()
        }
    }
}

impl SessionOptions {
    /// These options, their sessions sharing probe choices (a server's, a warm bench leg's).
    pub fn sharing_probe_choices(self) -> Self {
        SessionOptions {
            probe_memo: probe::Memo::shared(),
            ..self
        }
    }
}

/// One sequence being generated: the model, its caches, and the step logic.
pub struct Session<'m> {
    // Declared first so it is dropped before anything else: it borrows `model`.
    compiled: Option<compiled::CompiledDecode>,
    /// `WherePays`: timing both paths until it has chosen.
    probe: Option<probe::CompileProbe>,
    /// The choices shared with the owner's other sessions, and this one's key there.
    probe_memo: probe::Memo,
    memo_key: Option<probe::MemoKey>,
    /// Compiled steps of a compiled step dropped after the probe chose eager.
    compiled_before: usize,
    model: &'m dyn LanguageModel,
    pub caches: Vec<Box<dyn Cache>>,
    pub prefill_step: usize,
    kv_quant: Option<KvQuantPlan>,
    /// Called with each prefill chunk's length once its caches are evaluated (the server's
    /// prompt progress and keep-alive test hook: `serve::progress`).
    pub on_prefill: Option<Box<dyn FnMut(usize) + Send>>,
}

pub(crate) fn ids_array(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

impl<'m> Session<'m> {
    /// A session with the default options (the compiled step where it is exact and pays).
    pub fn new(model: &'m dyn LanguageModel) -> Self {
        Self::with_options(model, &SessionOptions::default())
    }

    /// Where the compiled step reproduces the eager (mlx-lm) step bit for bit. On the CPU
    /// backend, compiling fuses the SDPA fallback's elementwise ops and changes their
    /// rounding in f32 (38/39 single-query cases differ) and in f16 (tiny-qwen2 diverged at
    /// step 97 of 300); bf16 stayed exact on every step measured (3 models × 300 steps plus
    /// the L1 gate). So only bf16 models decode compiled by default, and only in the families
    /// whose tiny models were measured exact over 300 steps (`registry::Family::compiled_decode`:
    /// smollm3's and quantized qwen3_moe's were not).
    pub fn compiled_decode_is_exact(model: &dyn LanguageModel) -> bool {
        model.activation_dtype() == mlx_rs::Dtype::Bfloat16
            && crate::model::registry::has(model.model_type(), |f| f.compiled_decode)
    }

    pub fn with_compile(model: &'m dyn LanguageModel, policy: CompileDecode) -> Self {
        Self::with_options(model, &policy.into())
    }

    pub fn with_options(model: &'m dyn LanguageModel, opts: &SessionOptions) -> Self {
        Self::with_caches(model, opts, model.make_caches())
    }

    /// A session continuing from `caches` (e.g. a prompt-cache hit holding a prefix).
    pub fn with_caches(
        model: &'m dyn LanguageModel,
        opts: &SessionOptions,
        caches: Vec<Box<dyn Cache>>,
    ) -> Self {
        let on = match opts.compile {
            CompileDecode::Off => false,
            CompileDecode::WherePays | CompileDecode::WhereExact => {
                Self::compiled_decode_is_exact(model)
            }
            CompileDecode::Always => true,
        };
        // A rank of a group runs eagerly, as mlx-lm's sharded models do: a compiled step
        // would trace the collectives into the graph, which is untried (and not mlx-lm's path).
        let on = on && !crate::dist::active();
        // Caches the compiled step never takes (rotating ones unless forced) build none:
        // every step would try it and fall back, and the probe would time eager against eager.
        let mut caches = caches;
        let forced = opts.compile == CompileDecode::Always;
        let on = on && compiled::takes_kinds(&mut caches, forced);
        Session {
            // SAFETY: the compiled step lives in this session, which borrows `model` for 'm.
            compiled: on.then(|| unsafe {
                compiled::CompiledDecode::new(model, opts.compile == CompileDecode::Always)
            }),
            probe: (on && opts.compile == CompileDecode::WherePays)
                .then(probe::CompileProbe::default),
            probe_memo: opts.probe_memo.clone(),
            memo_key: None,
            compiled_before: 0,
            model,
            caches,
            prefill_step: PREFILL_STEP,
            kv_quant: opts.kv_quant.clone(),
            on_prefill: None,
        }
    }

    /// generate_step's quantization hook: converts the caches that are due.
    fn quantize_due(&mut self) -> Result<(), Exception> {
        if let Some(plan) = &self.kv_quant {
            plan.apply(&mut self.caches)?;
        }
        Ok(())
    }

    /// The model this session runs.
    pub fn model(&self) -> &'m dyn LanguageModel {
        self.model
    }

    /// How many steps ran through the compiled graph (proof that the path ran).
    pub fn compiled_steps(&self) -> usize {
        self.compiled_before + self.compiled.as_ref().map_or(0, |c| c.steps)
    }

    /// The path the `WherePays` probe chose (None while it is timing, or without a probe).
    pub fn compile_choice(&self) -> Option<probe::Path> {
        self.probe.as_ref().and_then(|p| p.decided())
    }

    /// The probe's median intervals (eager, compiled) once it has chosen.
    pub fn compile_probe_medians(&self) -> Option<(Duration, Duration)> {
        self.probe.as_ref().and_then(|p| p.medians())
    }

    /// Whether this one-token step may take the compiled graph; the probe's timing.
    fn compiled_turn(&mut self) -> bool {
        let Some(probe) = self.probe.as_mut() else {
            return true;
        };
        if probe.untouched() {
            let context = self.caches.first().map_or(0, |c| c.offset());
            let key = probe::MemoKey::new(self.model, context, self.kv_quant.is_some());
            if let Some(path) = self.probe_memo.adopt(key) {
                probe.adopt(path);
            }
            self.memo_key = Some(key);
        }
        let timing = probe.decided().is_none();
        let path = probe.next(std::time::Instant::now());
        if let (true, Some(chosen), Some(key)) = (timing, probe.decided(), self.memo_key) {
            self.probe_memo.record(key, chosen);
        }
        if probe.decided() == Some(probe::Path::Eager) {
            if let Some(c) = self.compiled.take() {
                // Dropping the compiled step frees its graphs; the probe stays as the record.
                self.compiled_before += c.steps;
            }
        }
        path == probe::Path::Compiled
    }

    fn eval_caches(&self) -> Result<(), Exception> {
        let state: Vec<&Array> = self.caches.iter().flat_map(|c| c.state()).collect();
        mlx_rs::transforms::eval(state)
    }

    /// Feeds `ids` and returns the logits of the last position, [1, vocab].
    pub fn step(&mut self, ids: &[u32]) -> Result<Array, Exception> {
        let ids = ids_array(ids);
        if ids.shape()[1] == 1 {
            return self.step_array(&ids.reshape(&[1])?);
        }
        let logits = self.model.forward(&ids, &mut self.caches)?;
        self.quantize_due()?;
        Ok(logits.index((.., -1, ..)))
    }

    /// Feeds a token id that is still an MLX array (shape [1], e.g. a lazy sample) and
    /// returns the logits of its position, [1, vocab].
    pub fn step_array(&mut self, token: &Array) -> Result<Array, Exception> {
        let compiled_turn = self.compiled.is_some() && self.compiled_turn();
        if let Some(compiled) = self.compiled.as_mut().filter(|_| compiled_turn) {
            if let Some(logits) = compiled.try_step(token, &mut self.caches)? {
                self.quantize_due()?;
                return Ok(logits);
            }
        }
        let ids = token.reshape(&[1, -1])?;
        let logits = self.model.forward(&ids, &mut self.caches)?;
        self.quantize_due()?;
        Ok(logits.index((.., -1, ..)))
    }

    /// Feeds `ids` and returns the logits of every position, [1, len, vocab] (a speculative
    /// verify pass).
    pub fn forward(&mut self, ids: &[u32]) -> Result<Array, Exception> {
        let logits = self.model.forward(&ids_array(ids), &mut self.caches)?;
        self.quantize_due()?;
        Ok(logits)
    }

    /// Drops the last `n` tokens from every cache (a speculative rollback when every cache
    /// can trim; `rollback::Checkpoint` handles recurrent states); fails, naming the cache,
    /// where one cannot give them back (a sliding-window ring that has wrapped has
    /// overwritten what it would need; a recurrent state never can).
    pub fn trim(&mut self, n: usize) -> Result<(), Exception> {
        if n == 0 {
            return Ok(());
        }
        if let Some(i) = self.caches.iter().position(|c| !c.is_trimmable()) {
            let c = &self.caches[i];
            let why = match c.kind() {
                Some(crate::cache::rotating::KIND) => {
                    "a sliding-window cache that has wrapped cannot give tokens back; use a \
                     model without sliding windows, or keep prompt + output under its window"
                }
                _ => "this kind of cache cannot give tokens back",
            };
            return Err(Exception::custom(format!(
                "speculative decoding cannot roll back layer {i}'s cache at position {}: {why}",
                c.offset()
            )));
        }
        for c in self.caches.iter_mut() {
            c.trim(n as i32);
        }
        Ok(())
    }

    /// Processes the prompt as mlx-lm does and returns the logits after its last token.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Array, Exception> {
        assert!(!prompt.is_empty(), "prefill needs at least one token");
        let mut rest = prompt;
        while rest.len() > 1 {
            let n = self.prefill_step.min(rest.len() - 1);
            self.prefill_chunk(&rest[..n])?;
            let another_chunk = rest.len() - n > 1;
            let overlap = n > 1
                && another_chunk
                && crate::plant::is(crate::plant::Defect::PrefillChunksOverlap);
            rest = &rest[n - usize::from(overlap)..];
        }
        self.step(rest)
    }

    /// Feeds one prefill chunk: only the caches are evaluated; the chunk's logits are never
    /// computed.
    pub fn prefill_chunk(&mut self, ids: &[u32]) -> Result<(), Exception> {
        self.model.forward(&ids_array(ids), &mut self.caches)?;
        self.quantize_due()?;
        self.eval_caches()?;
        if let Some(hook) = self.on_prefill.as_mut() {
            hook(ids.len());
        }
        mlx_rs::memory::clear_cache()
    }
}

/// The greedy choice for logits [1, vocab]: argmax of the log-probabilities.
pub fn greedy(logits: &Array) -> Result<u32, Exception> {
    let logprobs = logits.subtract(logits.logsumexp(true)?)?;
    let vocab = logprobs.dim(-1);
    let logprobs = match crate::plant::is(crate::plant::Defect::GreedyFirst64k) && vocab > 65_536 {
        true => logprobs.reshape(&[-1, vocab])?.index((.., ..65_536)),
        false => logprobs,
    };
    let id = argmax_axis(&logprobs, -1, None)?;
    id.eval()?;
    Ok(id.as_slice::<u32>()[0])
}

/// Timing of one generation.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub generation_time: Duration,
}

impl Stats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    pub fn generation_tps(&self) -> f64 {
        self.generated_tokens as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Eos,
    Length,
    /// The caller asked to stop (e.g. a stop string completed).
    Stop,
}

/// What the token callback wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// Generation of up to `max_tokens` with `sampler` (mlx-lm's `generate_step` loop: the
/// logits processors see every token so far, prompt included), stopping at any of
/// `eos_ids`; `on_token` sees each id as it is produced, with the log-probabilities
/// [1, vocab] it was sampled from (the EOS id is not passed on).
pub fn generate(
    model: &dyn LanguageModel,
    prompt: &[u32],
    max_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32, &Array) -> Result<Flow, Exception>,
) -> Result<(Stats, Finish), Exception> {
    generate_with(
        model,
        prompt,
        max_tokens,
        eos_ids,
        sampler,
        &SessionOptions::default(),
        on_token,
    )
}

/// `generate` with explicit session options.
pub fn generate_with(
    model: &dyn LanguageModel,
    prompt: &[u32],
    max_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    opts: &SessionOptions,
    on_token: impl FnMut(u32, &Array) -> Result<Flow, Exception>,
) -> Result<(Stats, Finish), Exception> {
    let mut session = Session::with_options(model, opts);
    generate_in(
        &mut session,
        prompt,
        0,
        max_tokens,
        eos_ids,
        sampler,
        on_token,
    )
}

/// `generate` in an existing session whose caches already hold `prompt[..cached]` (a
/// prompt-cache hit): only the rest of the prompt is prefilled. Afterwards the session's
/// caches hold every token fed to the model.
pub fn generate_in(
    session: &mut Session,
    prompt: &[u32],
    cached: usize,
    max_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32, &Array) -> Result<Flow, Exception>,
) -> Result<(Stats, Finish), Exception> {
    assert!(
        cached < prompt.len(),
        "at least one prompt token must be fed"
    );
    let mut dec = decode::Decoder::new(prompt, max_tokens, eos_ids, sampler);
    let mut plain = decode::Plain::start(session, &mut dec, &prompt[cached..])?;
    let mut on_token = |id: u32, logprobs: &Array, _drafted: bool| on_token(id, logprobs);
    let finish = loop {
        match plain.advance(session, &mut dec, &mut on_token) {
            Ok(None) => {}
            Ok(Some(finish)) => break finish,
            Err(e) => {
                let _ = plain.end();
                return Err(e);
            }
        }
    };
    let stats = dec.finish();
    plain.end()?;
    Ok((stats, finish))
}

/// Greedy generation (temperature 0, no processors): `generate` with mlx-lm's defaults.
pub fn generate_greedy(
    model: &dyn LanguageModel,
    prompt: &[u32],
    max_tokens: usize,
    eos_ids: &[u32],
    on_token: impl FnMut(u32, &Array) -> Result<Flow, Exception>,
) -> Result<(Stats, Finish), Exception> {
    let mut sampler = Sampler::new(SamplingParams::default())?;
    generate(model, prompt, max_tokens, eos_ids, &mut sampler, on_token)
}
