//! The budget's measurements, on the model thread at startup (`probe`): weights, KV bytes
//! per token, activations; and how a server (`charge`) and `engine generate`
//! (`check_alone`) use them.

use std::time::Duration;

use super::{parse, physical_memory, ActBound, Budget, KvBound, ACT_PROBE_OFFSET, KV_STEP};

/// What the startup probe measured on the model thread.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub weights: u64,
    pub kv: KvBound,
    pub act: ActBound,
}

/// MLX's active bytes once its buffer cache is emptied (on a model thread holding the MLX
/// turn: before a load, what the other loaded models hold).
pub(crate) fn active() -> anyhow::Result<u64> {
    mlx_rs::memory::clear_cache()?;
    Ok(mlx_rs::memory::active_memory()? as u64)
}

/// Measures, on the model thread, with nothing else alive: the resident bytes (weights),
/// the caches' bytes after 1 and after 257 prompt tokens (`KvBound`) and the peak over a
/// prefill chunk of `prefill_step` tokens beyond what was held before it, on fresh caches
/// and after `ACT_PROBE_OFFSET` tokens (`ActBound`). `make_caches` gives the caches a
/// request gets (the model's, then a drafter's); only the model's forward runs, so a
/// drafter's caches count as constant (`kv_fixed`) here and its weights are in `weights`.
pub fn probe(
    model: &dyn crate::model::LanguageModel,
    make_caches: &dyn Fn() -> Vec<Box<dyn crate::cache::Cache>>,
    opts: &crate::generate::SessionOptions,
    prefill_step: usize,
    context: usize,
) -> anyhow::Result<Probe> {
    let vocab = model.vocab_size().max(1) as u32;
    let ids = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 7 + 3) % vocab).collect() };
    let layers = model.make_caches().len();
    let weights = active()?;
    // Feeds `before` tokens, then measures one chunk of `n`: (the caches' bytes after it,
    // the peak during it beyond what was held before it).
    let fed = |before: usize, n: usize| -> anyhow::Result<(u64, u64)> {
        let mut caches = make_caches();
        let rest = caches.split_off(layers);
        let mut session = crate::generate::Session::with_caches(model, opts, caches);
        for chunk in ids(before).chunks(n.max(1)) {
            session.prefill_chunk(chunk)?;
        }
        let held = active()?;
        mlx_rs::memory::reset_peak_memory()?;
        session.prefill_chunk(&ids(n))?;
        let peak = mlx_rs::memory::peak_memory()? as u64;
        let after = active()?;
        drop(session);
        drop(rest);
        Ok((after.saturating_sub(weights), peak.saturating_sub(held)))
    };
    let (one, _) = fed(0, 1)?;
    let (two, _) = fed(0, KV_STEP as usize + 1)?;
    let chunk = prefill_step.clamp(1, context.max(1));
    let (_, fresh) = fed(0, chunk)?;
    let (_, deeper) = fed(ACT_PROBE_OFFSET as usize, chunk)?;
    let extra: u64 = {
        // The drafter's caches (after the model's), empty: counted as constant.
        let mut caches = make_caches();
        let rest = caches.split_off(layers);
        rest.iter().map(|c| c.nbytes() as u64).sum()
    };
    let mut kv = KvBound::from_probe(one, two);
    kv.fixed += extra;
    mlx_rs::memory::reset_peak_memory()?;
    Ok(Probe {
        weights,
        kv,
        act: ActBound::from_probe(chunk as u64, fresh, deeper),
    })
}

/// `engine generate --memory-budget`: measures the model as the server does and refuses,
/// before any prefill, a prompt + max_tokens that cannot fit (the same numbers as the
/// server's 400).
pub fn check_alone(
    flag: &str,
    model: &dyn crate::model::LanguageModel,
    make_caches: &dyn Fn() -> Vec<Box<dyn crate::cache::Cache>>,
    opts: &crate::generate::SessionOptions,
    prefill_step: usize,
    prompt_tokens: usize,
    max_tokens: usize,
) -> anyhow::Result<()> {
    let limit = parse(flag)?.resolve(flag, physical_memory())?;
    let p = probe(
        model,
        make_caches,
        opts,
        prefill_step,
        prompt_tokens + max_tokens,
    )?;
    let budget = Budget::new(limit, Duration::ZERO);
    budget.reserve_weights("model", p.weights);
    budget.set_measured("model", p.kv, p.act);
    mlx_rs::memory::set_cache_limit(budget.mlx_cache_limit() as usize)?;
    budget.check(budget.need("model", prompt_tokens, max_tokens))?;
    Ok(())
}

/// What `charge` measures: a loaded model (with the drafter's caches in `make_caches`, as
/// a prompt-cache entry holds them) and how it prefills.
pub(crate) struct Loaded<'a> {
    pub model: &'a dyn crate::model::LanguageModel,
    pub make_caches: &'a dyn Fn() -> Vec<Box<dyn crate::cache::Cache>>,
    pub opts: &'a crate::generate::SessionOptions,
    pub prefill_step: usize,
    pub context: usize,
}

/// Charges a loaded model to `budget` under `name`: measures it (`probe`), counts its
/// weights (beyond `before`: MLX's active bytes before it loaded, the other models'),
/// caps MLX's buffer cache. Refuses a budget the loaded models already fill.
pub(crate) fn charge(
    loaded: Loaded<'_>,
    budget: &Budget,
    name: &str,
    before: u64,
) -> anyhow::Result<()> {
    let p = probe(
        loaded.model,
        loaded.make_caches,
        loaded.opts,
        loaded.prefill_step,
        loaded.context,
    )?;
    let weights = p.weights.saturating_sub(before);
    budget.reserve_weights(name, weights);
    budget.set_measured(name, p.kv, p.act);
    mlx_rs::memory::set_cache_limit(budget.mlx_cache_limit() as usize)?;
    let fixed = budget.weights() + budget.mlx_cache_limit();
    let one = budget.need(name, 1, 0).bytes();
    anyhow::ensure!(
        fixed + one <= budget.limit,
        "--memory-budget {} bytes: the loaded models' weights ({} bytes), MLX's buffer cache \
         ({}) and one token's request ({}) do not fit; give a bigger --memory-budget",
        budget.limit,
        budget.weights(),
        budget.mlx_cache_limit(),
        one
    );
    eprintln!(
        "engine serve: --memory-budget {} bytes: weights {}, KV {} + {} per token, \
         activations {} + {} per token past {} (docs/serve.md \"Memory budget\")",
        budget.limit,
        weights,
        p.kv.fixed,
        p.kv.per_token,
        p.act.at_chunk,
        p.act.per_token,
        p.act.chunk
    );
    Ok(())
}
