//! Planted defects a gate must catch, as `harness parity --plant` spells them: a config
//! value, another attention for the quantized KV, a later KV start, an engine defect
//! (`engine::plant`, switched on with its guard for one run) or a harness-side tweak.

use std::fmt;

use engine::cache::QuantSdpa;
use engine::generate::SessionOptions;
use engine::plant::Defect;
use serde_json::Value;

use super::ParityError;

type Result<T> = std::result::Result<T, ParityError>;

/// A deliberate defect that a gate must catch.
#[derive(Debug, Clone, PartialEq)]
pub enum Plant {
    /// `KEY=VALUE`: set in the model's config.json before loading; KEY may be a dotted path
    /// (`rope_parameters.full_attention.partial_rotary_factor=0.5`).
    Config(String, Value),
    /// `sdpa=mlx-lm` / `sdpa=optiq-fused`: the quantized KV read through another attention.
    Sdpa(QuantSdpa),
    /// `kv_start=N`: the KV quantized from position N on.
    KvStart(i32),
    /// A defect in the engine's code (`engine::plant`), switched on for the run.
    Engine(Defect),
    /// A defect the harness makes in what it gives the engine or what it compares.
    Harness(Tweak),
}

/// The harness-side defects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tweak {
    FirstInput,
    Seed,
    TopPAndPenalty,
    LostCharacter,
    WeightDecay,
}

/// The plants with a name: (as `--plant` spells it, the plant, what it breaks).
#[rustfmt::skip]
const NAMED: &[(&str, Plant, &str)] = &[
    ("first-input", Plant::Harness(Tweak::FirstInput), "each case's first input value + 1"),
    ("seed", Plant::Harness(Tweak::Seed), "the sampling seed + 1"),
    ("top-p-and-penalty", Plant::Harness(Tweak::TopPAndPenalty), "top_p 0.5, repetition penalty + 0.2"),
    ("lost-character", Plant::Harness(Tweak::LostCharacter), "the first streamed piece loses its first character"),
    ("weight-decay", Plant::Harness(Tweak::WeightDecay), "AdamW's weight decay × 1.1"),
    ("unmasked-padding", Plant::Engine(Defect::BatchUnmaskedPadding), "the batch mask forgets the left padding"),
    ("ring-mask-unrolled", Plant::Engine(Defect::BatchRingMaskUnrolled), "the batched sliding-window mask is not rolled with the ring"),
    ("batch-kv-biases-dropped", Plant::Engine(Defect::BatchKvBiasesDropped), "the quantized batch cache writes new biases as zeros"),
    ("state-rows-unfiltered", Plant::Engine(Defect::BatchStateRowsUnfiltered), "the batch's recurrent states keep their first rows when rows leave"),
    ("keep-draft-tail", Plant::Engine(Defect::SpecKeepDraftTail), "the drafter's cache is not rolled back"),
    ("target-trim-short", Plant::Engine(Defect::SpecTargetTrimShort), "the target gives back one token fewer than it rejected"),
    ("ring-trim", Plant::Engine(Defect::AssistantRingTrimLikeMlxLm), "rotating caches roll back as mlx-lm's trim does"),
    ("first-sliding-donor", Plant::Engine(Defect::AssistantFirstSlidingDonor), "the drafter reads the first sliding cache"),
    ("head-from-flags", Plant::Engine(Defect::AssistantHeadFromFlags), "the drafter's head follows the config flags, not the tensors"),
    ("centroid-top-k-short", Plant::Engine(Defect::AssistantCentroidTopKShort), "the centroid head expands one centroid fewer"),
    ("perf-path", Plant::Engine(Defect::PerfDecodeDropsNewest), "the L3 decode path leaves the newest position out of attention"),
    ("argmax-first-64k", Plant::Engine(Defect::GreedyFirst64k), "greedy argmax over the first 65 536 ids only"),
    ("recurrent-in-proj-lora-dropped", Plant::Engine(Defect::RecurrentInProjLoraDropped), "the recurrent mixers' input projections get no LoRA adapter"),
    ("dora-norm-with-gradient", Plant::Engine(Defect::DoraNormWithGradient), "DoRA's weight norm is not gradient-stopped"),
    ("full-one-layer-too-many", Plant::Engine(Defect::FullOneLayerTooMany), "full fine-tuning unfreezes one block too many"),
    ("qlora-dequantized-base", Plant::Engine(Defect::QloraDequantizedBase), "a quantized base under LoRA runs on its dequantized weight"),
    ("mla-latent-proj-lora-dropped", Plant::Engine(Defect::MlaLatentProjLoraDropped), "multi-head latent attention's kv_a_proj_with_mqa gets no LoRA adapter"),
    ("moe-top-k-off-by-one", Plant::Engine(Defect::MoeTopKOffByOne), "the router keeps the experts ranked 2..k+1"),
    ("no-post-processor", Plant::Engine(Defect::EncodeSkipsPostProcessor), "encode forgets the post-processor (no bos)"),
    ("tokenizer-class-ignored", Plant::Engine(Defect::TokenizerClassIgnored), "tokenizer.json is read as written where transformers rebuilds it"),
    ("every-class-llama", Plant::Engine(Defect::TokenizerEveryClassLlama), "every tokenizer is rebuilt as LlamaTokenizer"),
    ("spm-leading-space", Plant::Engine(Defect::SpmKeepsLeadingSpace), "the SentencePiece stream keeps its leading space"),
    ("tojson-html-escape", Plant::Engine(Defect::TemplateTojsonEscapesHtml), "the templates' tojson HTML-escapes <, >, & and '"),
    ("template-kwargs-dropped", Plant::Engine(Defect::TemplateKwargsDropped), "chat template kwargs never reach the template"),
    ("template-special-tokens-dropped", Plant::Engine(Defect::TemplateSpecialTokensDropped), "the special tokens (bos_token, …) never reach the template"),
    ("value-biases-dropped", Plant::Engine(Defect::PerfDequantValueBiasesDropped), "the L3 decode attention dequantizes the values without their biases"),
    ("eval-mean-on-host", Plant::Engine(Defect::EvalMeanOnHost), "the perplexity's mean loss is taken on the host in f64"),
];

impl Plant {
    /// `--plant` as written: a name (`perf-path`), `sdpa=…`, `kv_start=N` or `KEY=VALUE`.
    pub fn parse(s: &str) -> Result<Plant> {
        if let Some((_, plant, _)) = NAMED.iter().find(|(name, ..)| *name == s) {
            return Ok(plant.clone());
        }
        let bad = |why: &str| ParityError::Usage(format!("--plant `{s}`: {why}"));
        match s.split_once('=') {
            Some(("sdpa", "mlx-lm")) => Ok(Plant::Sdpa(QuantSdpa::MlxLm)),
            Some(("sdpa", "optiq-fused")) => Ok(Plant::Sdpa(QuantSdpa::OptiqFused)),
            Some(("sdpa", _)) => Err(bad("sdpa is mlx-lm or optiq-fused")),
            Some(("kv_start", n)) => n
                .parse()
                .map(Plant::KvStart)
                .map_err(|_| bad("not a position")),
            Some((key, v)) => Ok(Plant::Config(
                key.to_owned(),
                serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_owned())),
            )),
            None => Err(bad("no such plant")),
        }
    }

    /// The form a gate lists in [`Gate::plants`].
    pub fn form(&self) -> String {
        match self {
            Plant::Config(..) => "KEY=VALUE".into(),
            Plant::KvStart(_) => "kv_start=N".into(),
            Plant::Sdpa(_) => self.to_string(),
            named => NAMED
                .iter()
                .find(|(_, p, _)| p == named)
                .map_or_else(|| format!("{named:?}"), |(name, ..)| (*name).into()),
        }
    }

    /// Applies a config plant to a model's config.json.
    pub(super) fn config(plant: Option<&Plant>, config: &mut Value) {
        if let Some(Plant::Config(key, value)) = plant {
            let at = key.split('.').fold(config, |at, k| &mut at[k]);
            *at = value.clone();
        }
    }

    /// Applies an attention or KV-start plant to quantized-KV session options.
    pub(super) fn options(plant: Option<&Plant>, opts: &mut SessionOptions) {
        let Some(kv) = opts.kv_quant.as_mut() else {
            return;
        };
        match plant {
            Some(Plant::Sdpa(sdpa)) => kv.sdpa = *sdpa,
            Some(Plant::KvStart(start)) => kv.start = *start,
            _ => {}
        }
    }
}

impl fmt::Display for Plant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Plant::Config(key, value) => write!(f, "config.json {key} = {value}"),
            Plant::Sdpa(QuantSdpa::MlxLm) => f.write_str("sdpa=mlx-lm"),
            Plant::Sdpa(QuantSdpa::OptiqFused) => f.write_str("sdpa=optiq-fused"),
            Plant::Sdpa(QuantSdpa::DequantDecode) => f.write_str("sdpa=dequant-decode"),
            Plant::KvStart(start) => write!(f, "kv_start={start}"),
            named => match NAMED.iter().find(|(_, p, _)| p == named) {
                Some((_, _, what)) => f.write_str(what),
                None => write!(f, "{named:?}"),
            },
        }
    }
}
