//! Planted defects: deliberate bugs that a gate's self-check switches on to prove the gate
//! can fail. There is one switch for all of them and one way to turn a defect on: a guard,
//!
//! ```ignore
//! let _on = engine::plant::on(Defect::BatchUnmaskedPadding)?;
//! // … run the gate: it must fail …
//! // dropping the guard (also while a panic unwinds) restores the previous state
//! ```
//!
//! and code that carries a defect asks `plant::is(Defect::X)`.
//!
//! The defects exist only in builds with the `plant` feature (`--features engine/plant`),
//! which only test builds turn on (the dev-dependencies of `engine`, `harness` and the root
//! package). Without it `is` is a constant `false`, so every defect branch is compiled out
//! of release builds, and `on` returns [`NotCompiledIn`]. A build with the feature carries
//! the byte string `ENGINE-PLANTED-DEFECTS-` `COMPILED-IN` (written here in two pieces so
//! that this comment never spells it), which `.ci/run` looks for in a non-test build of
//! the engine binary (it must be absent) and in the test build (it must be there).

/// Every planted defect of the engine, and the gate that must catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Defect {
    /// Speculative decoding: the drafter keeps the drafts it fed beyond the accepted
    /// prefix (its cache is not rolled back; same ids, different trace). Caught by the
    /// speculative gate against mlx-lm (`tests/it/spec_decode.rs`).
    SpecKeepDraftTail,
    /// Speculative decoding: the target gives back one token fewer than it rejected.
    /// Caught by `tests/it/spec_decode.rs` and by the greedy comparison of
    /// `engine/tests/it/speculative.rs`.
    SpecTargetTrimShort,
    /// Speculative decoding over a recurrent state: after a rejection the states are not
    /// returned to their checkpoint (they keep the rejected drafts, then take the accepted
    /// ones again). Caught by the greedy comparison on the hybrids and by the hybrid
    /// drafter's state check (`engine/tests/it/spec_hybrid.rs`).
    SpecStateNotRestored,
    /// Speculative decoding over a recurrent state: the re-feed after a rejection starts one
    /// position late (the accepted drafts and the first rejected one, not y and the accepted
    /// drafts: the right count, so every offset is right). Caught by the greedy comparison
    /// and by the hybrid drafter's state check (`engine/tests/it/spec_hybrid.rs`).
    SpecRefeedOneLate,
    /// Chat templates: `tojson` HTML-escapes `<`, `>`, `&` and `'` as Jinja's own filter
    /// does (transformers' does not). Caught by the template gate (`tests/it/templates.rs`).
    TemplateTojsonEscapesHtml,
    /// Chat templates: the template kwargs (`enable_thinking`, …) never reach the template.
    /// Caught by the template gate (`tests/it/templates.rs`).
    TemplateKwargsDropped,
    /// Assistant drafting: rotating caches roll back as mlx-lm's `trim` does (the write
    /// index moves, the stale tail stays). Caught by the L2 speculative gate against optiq
    /// (`tests/it/spec_l2.rs`).
    AssistantRingTrimLikeMlxLm,
    /// Assistant drafting: the drafter reads the first sliding cache instead of the last
    /// one. Caught by `tests/it/spec_l2.rs`.
    AssistantFirstSlidingDonor,
    /// Assistant drafting: the drafter's head is chosen by the config flags (as optiq 0.7.7
    /// does), not by the tensors. Caught by the head rows of the L2 speculative gate
    /// (`tests/it/spec_l2.rs`, the drafters whose flags lie).
    AssistantHeadFromFlags,
    /// Assistant drafting: the centroid head expands one centroid fewer than its top-k.
    /// Caught by the centroid row of `tests/it/spec_l2.rs`.
    AssistantCentroidTopKShort,
    /// The L3 one-token decode attention over quantized KV leaves the newest position out
    /// of attention. Caught by the L3 envelope gate (`tests/it/l3_envelope.rs`,
    /// `harness parity --tier l3 --plant perf-path`).
    PerfDecodeDropsNewest,
    /// The batch cache's mask forgets the left padding (rows attend to pad positions).
    /// Caught by the B=N batch gate (`tests/it/batch_decode.rs`) and, in a server process
    /// (`ENGINE_PLANT`), by falcon_h1's batch lane through `engine serve`
    /// (`engine/tests/it/serve.rs`).
    BatchUnmaskedPadding,
    /// The batched sliding-window cache's mask is not rolled with the ring once it has
    /// wrapped (rows attend to the wrong window slots). Caught by the B=N gate's
    /// sliding-window model (`tests/it/batch_decode.rs`).
    BatchRingMaskUnrolled,
    /// The quantized batch cache writes new positions' biases as zeros. Caught by the B=N
    /// gate over quantized KV (`tests/it/batch_decode.rs`, gate `batch-kv4`).
    BatchKvBiasesDropped,
    /// The batch's recurrent states (`ArraysCache`) keep their first rows when rows leave,
    /// not the rows kept (a row that stays decodes on the state of one that left). Caught
    /// by the B=N gate's hybrid models (`tests/it/batch_decode.rs`, `joinleave`).
    BatchStateRowsUnfiltered,
    /// A recurrent state (`ArraysCache`) takes no lengths for a batched prefill (`prepare`
    /// records none): the mixers mask nothing and take their states at the padded end, so
    /// a shorter row's state runs on over its right padding. Caught by BatchGenerator's
    /// prompt batches on the hybrids (`tests/it/batch_decode.rs`).
    BatchStateLengthsIgnored,
    /// The segmented backward drops the cotangent between segments (each segment's
    /// backward starts from zeros). Caught by `engine/tests/it/segmented.rs`.
    DropCotangent,
    /// The segmented backward drops the cotangent of the donor K/V carried across segment
    /// boundaries (Gemma 4's KV-shared layers' part never reaches the donor's segment).
    /// Caught by `engine/tests/it/segmented.rs` on tiny-gemma4.
    DropCarriedKvCotangent,
    /// ORPO: the NLL term is each pair's token mean, then the mean over pairs (not TRL's
    /// one cross-entropy over the chosen half of the batch). Caught by the B = 4
    /// unequal-length ORPO gate (`engine/tests/it/train.rs`, both scopes).
    OrpoNllPerPairMean,
    /// GRPO: advantages centred on the whole batch's mean reward instead of each prompt's
    /// group. Caught by the advantage and loss gate against the float64 TRL port
    /// (`engine/tests/it/train_grpo.rs`).
    GrpoBatchMeanBaseline,
    /// The dynamic-weight controller's value is not written into a DPO/CPO/SimPO objective
    /// (its β or γ stays as given). Caught by the actuator test
    /// (`engine/tests/it/train_preference.rs`).
    WeightNotActuated,
    /// The prefix-shared forward (ORPO's and the preference methods' pairs, a GRPO part's
    /// common prompt): the continuation reads the shared prefix's K/V with their gradient
    /// stopped (the prompt's forward learns nothing from the responses). Caught by the
    /// prefix-shared vs joint gradient gate (`engine/tests/it/orpo_prefix.rs`) and by GRPO's
    /// micro-batch gate (`engine/tests/it/train_grpo.rs`).
    OrpoPrefixKvNoGrad,
    /// ORPO's prefix-shared forward: the rejected rows read zeros for the shared prefix's
    /// values. Caught by the prefix-shared vs joint loss gate (`engine/tests/it/orpo_prefix.rs`).
    OrpoRejectedSkipsPrefix,
    /// DPO: β applied twice (the loss reads β²·Δ). Caught by the preference-loss gate
    /// against `oracles/preference_reference.py` (`engine/tests/it/train_preference.rs`).
    DpoBetaTwice,
    /// DPO: the reference log-probs are the policy's own (gradient stopped), so every reward
    /// is 0. Caught by the preference-loss gate (`engine/tests/it/train_preference.rs`).
    DpoReferenceFromPolicy,
    /// SimPO: the target margin γ is subtracted from the log-prob gap undivided by β. Caught
    /// by the preference-loss gate (`engine/tests/it/train_preference.rs`).
    SimpoGammaNotOverBeta,
    /// DPO's reference pass keeps the adapters on (the policy, not the base model, scores
    /// the reference). Caught by the reference-pass test (`engine/tests/it/train_preference.rs`).
    DpoReferenceKeepsAdapters,
    /// The compiled training step's graph key leaves out the shared prefix length P, so an
    /// ORPO batch reuses the trace of another batch of its shape with another P. Caught by
    /// the compiled-vs-eager gate (`engine/tests/it/train_compiled.rs`).
    CompiledStepKeyWithoutPrefix,
    /// The compiled training step's graph key leaves out λ, so a batch keeps the λ of the
    /// graph's first trace after the dynamic-λ controller moves it. Caught by the
    /// compiled-vs-eager gate (`engine/tests/it/train_compiled.rs`).
    CompiledStepKeyWithoutLambda,
    /// Chunked cross-entropy: every chunk after the first reads the hidden states one row
    /// early (its first token scored from the row before it: one token dropped, one counted
    /// twice). Caught by the chunked vs plain gate (`engine/tests/it/train_chunked.rs`).
    LossChunkOffByOne,
    /// Chunked cross-entropy: the head's gradient is stopped in every chunk after the first
    /// (no dh reaches those rows). Caught by `engine/tests/it/train_chunked.rs`'s gradients.
    LossChunkHeadNoGrad,
    /// Tokenization: `encode` forgets the post-processor (no bos, no template tokens, when
    /// asked for special tokens). Caught by the tokenization gate (`tests/it/tokenize.rs`).
    EncodeSkipsPostProcessor,
    /// SentencePiece streaming detokenizer: the stream's leading space is kept where
    /// mlx-lm trims it. Caught by the detokenizer gate on the real tokenizers
    /// (`tests/it/detok.rs`).
    SpmKeepsLeadingSpace,
    /// Greedy decoding takes the argmax over the first 65 536 ids only (a u16 id, say):
    /// invisible at tiny vocabularies, caught by the L1 gate at real vocabulary sizes
    /// (`tests/it/l1_vocab.rs`).
    GreedyFirst64k,
    /// Serve: a tool call's start marker stays in the content beside the parsed call.
    /// Caught by `engine/tests/it/serve_tools.rs`.
    ToolCallTextInContent,
    /// Serve: an answer that made a tool call ends with `finish_reason: "stop"`, not
    /// `"tool_calls"`. Caught by `engine/tests/it/serve_tools.rs`.
    ToolCallFinishStaysStop,
    /// Serve: reasoning text goes to the content instead of `reasoning`. Caught by
    /// `engine/tests/it/serve_tools.rs`.
    ReasoningInContent,
    /// Serve, /v1/responses: `usage.output_tokens` is written as `completion_tokens` (the
    /// chat name). Caught by the shape gate against the openai client's schemas
    /// (`engine/tests/it/responses.rs`).
    ResponsesUsageMisnamed,
    /// Serve, /v1/responses: `previous_response_id` is looked up but its conversation is
    /// dropped from the prompt. Caught by the multi-turn gate (`engine/tests/it/responses.rs`).
    ResponsesPreviousDropped,
    /// Serve, /v1/responses: `function_call_output` input items are skipped. Caught by the
    /// tool gate (`engine/tests/it/responses.rs`).
    ResponsesToolOutputDropped,
    /// Serve, /v1/responses: `text.format` never reaches the grammar (answers are not
    /// constrained). Caught by the structured-output gate (`engine/tests/it/responses.rs`).
    ResponsesFormatIgnored,
    /// Serve, /v1/responses: `metadata` is echoed unchecked (no bounds, any value type).
    /// Caught by the hostile-input gate (`engine/tests/it/responses.rs`).
    ResponsesMetadataUnchecked,
    /// Mixture of experts: the router keeps the experts ranked 2..=k+1 instead of the top k
    /// (its top-k slice off by one). Caught by the L1 gate on tiny-qwen3-moe
    /// (`tests/it/l1_models.rs`).
    MoeTopKOffByOne,
    /// Nemotron 3's router (`group_expert_select`): the experts' weights are read from the
    /// scores with `e_score_correction_bias` added, not from the unbiased scores (the bias
    /// meant for the choice only). Caught by the L1 gate on the tiny-nemotron-h-moe
    /// fixtures (`tests/it/l1_models.rs`) and by the B=N gate on tiny-nemotron-h-moe-q4
    /// (`tests/it/batch_decode.rs`).
    MoeCorrectionBiasWeighted,
    /// Multimodal wrappers (`gemma3`, `gemma4`): the language model's prefix is kept in the
    /// tensor names (`language_model.model.…` read as the text family's `model.…`). Caught
    /// by the L1 gate on the wrapper fixtures (`tests/it/l1_models.rs`).
    WrapperPrefixKept,
    /// `engine convert`: the norms keep the source dtype when the weights are cast. Caught
    /// by the convert gate against mlx_lm.convert (`engine/tests/it/convert.rs`).
    ConvertNormsKeepDtype,
    /// Qwen 3.5 / Qwen3-Next sanitize (load and `engine convert`): Hugging Face's (1 + w)
    /// RMSNorm weights are not given their 1. Caught by the convert gate against
    /// mlx_lm.convert on tiny-qwen3-5 (`engine/tests/it/convert.rs`).
    HybridNormOffsetSkipped,
    /// Qwen 3.5 / Qwen3-Next sanitize: the (1 + w) RMSNorm weights are given their 1 also in
    /// a checkpoint already in MLX's layout (mlx-community's: [C, K, 1] conv kernels, stacked
    /// experts), where mlx-lm leaves them as they are. Caught by the L1 gate on
    /// tiny-qwen3-5-moe-mlx and tiny-qwen3-next-mlx (`tests/it/l1_models.rs`).
    HybridNormOffsetOnMlxLayout,
    /// Falcon-H1's sanitize (load and `engine convert`): in_proj is scaled by
    /// `ssm_in_multiplier` alone, its rows' µP vector (`ssm_multipliers`) left out of the
    /// fold. Caught by the convert gate against mlx_lm.convert on tiny-falcon-h1
    /// (`engine/tests/it/convert.rs`).
    FalconInProjMupSkipped,
    /// Quantization modes: a floating-point mode's (mxfp4, nvfp4, mxfp8) quantized
    /// embedding dequantizes its rows to float32 instead of MLX's bfloat16 default, so the
    /// model runs in float32. Caught by the L1 gate on the mode fixtures
    /// (`tests/it/l1_models.rs`).
    QuantFpRowsFloat32,
    /// Quantization modes: a per-module `quantization` entry without a `mode` takes the
    /// global mode instead of affine (mlx-lm's `to_quantized` default). Caught by the L1
    /// gate on tiny-llama-mixed-modes and tiny-qwen3-moe-mxfp4, which then fail to load
    /// (`tests/it/l1_models.rs`).
    QuantEntryTakesGlobalMode,
    /// LoRA on stacked experts (`LoRASwitchLinear`): the update is scaled twice. Caught by
    /// the LoRA training gate on the MoE fixtures (`tests/it/train_lora.rs`).
    SwitchLoraScaleTwice,
    /// LoRA on the hybrids: the recurrent mixers' input projections (the gated delta net's
    /// `in_proj_*`, Mamba-2's — Falcon-H1's `mamba.in_proj` too — and the short
    /// convolution's `in_proj`) are left out of the
    /// linears LoRA attaches to. Caught by the LoRA training gate on the hybrid fixtures
    /// (`tests/it/train_lora.rs`).
    RecurrentInProjLoraDropped,
    /// gpt-oss: the attention sinks never reach the SDPA (every head's softmax loses its
    /// sink column). Caught by the L1 gate on tiny-gpt-oss (`tests/it/l1_models.rs`).
    GptOssSinksDropped,
    /// Gemma 4's mixture of experts: the router's weights skip `per_expert_scale` (the
    /// softmax over the top k as it is). Caught by the L1 gate on tiny-gemma4-moe
    /// (`tests/it/l1_models.rs`).
    Gemma4PerExpertScaleDropped,
    /// The short convolution (LFM2) keeps as its state the K − 1 inputs one position early
    /// (shifted by one): every later step reads the wrong inputs. Caught by the L1 gate on
    /// tiny-lfm2 (`tests/it/l1_models.rs`).
    ShortConvStateShifted,
    /// The gated delta net decays its state by the previous token's gate (off by one step).
    /// Caught by the L1 gate on tiny-qwen3-5 (`tests/it/l1_models.rs`).
    GdnDecayOneStepLate,
    /// Qwen3-Next's fused projections split as one flat [q | k | v | z] instead of per key
    /// head (`fix_query_key_value_ordering` skipped). Caught by the L1 gate on
    /// tiny-qwen3-next (`tests/it/l1_models.rs`).
    GdnFusedOrderFlat,
    /// The Mamba-2 scan carries the previous state into a chunk without its decay. Caught by
    /// the L1 gate on tiny-mamba2 (`tests/it/l1_models.rs`).
    SsmStateUndecayed,
    /// Nemotron-H's gated norm normalizes over all channels at once (Mamba-2's), not per
    /// group. Caught by the L1 gate on tiny-nemotron-h (`tests/it/l1_models.rs`).
    SsmNormUngrouped,
    /// The Mamba-2 scan starts each of its 256-token chunks from a zero state (the state of
    /// the chunks before dropped). Only prompts past 256 tokens see it: caught by the
    /// 4,096-token L1 gate on tiny-nemotron-h, whose attention reads the positions it
    /// changed (`tests/it/l1_models.rs`).
    SsmChunkStateDropped,
    /// Tensor parallel: o_proj keeps the next rank's slice of its inputs; pipeline
    /// parallel: the stages are reversed. Caught by the distributed L1 gate
    /// (`harness/tests/it/l1_dist.rs`).
    DistShardWrongRank,
    /// Tensor parallel: the row-split linears skip their `all_sum`. Caught by the
    /// distributed L1 gate.
    DistReduceDropped,
    /// Tensor parallel: the gated delta net's conv kernel is cut as one block instead of per
    /// [q | k | v] segment (mlx-lm's `conv_sharding`), so its channels no longer meet
    /// `in_proj_qkv`'s. Caught by the distributed L1 gate on tiny-qwen3-5
    /// (`harness/tests/it/l1_dist.rs`).
    GdnConvShardUnsegmented,
    /// Tensor parallel with more ranks than K/V heads: qwen3_5's attention splits k_proj /
    /// v_proj first and repeats each rank's slice after, where mlx-lm's
    /// `repeat_kv_layer_inplace` repeats the whole heads before the split. Caught by the
    /// distributed L1 gate on tiny-qwen3-5-kv1 (`harness/tests/it/l1_dist.rs`).
    KvRepeatAfterShard,
    /// The L3 one-token decode attention dequantizes the values without their affine
    /// biases. Caught by the L3 KL gate (`tests/it/l3_kl.rs`).
    PerfDequantValueBiasesDropped,
    /// `harness eval`: the perplexity's mean loss is taken on the host in f64 instead of
    /// MLX's f32 mean. Caught by the L1 perplexity golden (`tests/it/l3_kl.rs`).
    EvalMeanOnHost,
    /// Prompt lookup: the drafts are copied from one position past the match, and the
    /// verify pass accepts every draft unchecked. Caught by the prompt-lookup trace gate
    /// (`engine/tests/it/lookup.rs`).
    LookupWrongOffsetUnverified,
    /// Constrained decoding: the grammar's token mask is never applied (the logits go to
    /// the sampler as they are). Caught by the schema gate (`engine/tests/it/constrained.rs`).
    ConstrainMaskNotApplied,
    /// Constrained decoding: the mask is written one id too high (id i's verdict lands on
    /// id i + 1). Caught by the exactness gate (`engine/tests/it/constrained.rs`).
    ConstrainMaskOffByOne,
    /// Strict tools: the request's strict tool schemas are dropped (no grammar; the model's
    /// tool calls go unconstrained). Caught by `engine/tests/it/constrained_tools.rs`.
    StrictToolsUnconstrained,
    /// Constrained speculation: the drafts are not checked against the grammar's mask and
    /// the verify rows after the first go unmasked. Caught by the drafts-under-the-mask
    /// gate (`engine/tests/it/constrained.rs`).
    SpecDraftsUnmasked,
    /// A distributed follower builds its sampler without the request's grammar. Caught by
    /// the constrained answer across ranks (`engine/tests/it/dist/serve.rs`).
    FollowerUnconstrained,
    /// The compiled decode step's attention bound is the offset rounded up, not the
    /// offset + 1 (the new token's own position is left out whenever the offset is a
    /// multiple of the bound step). Caught by `engine/tests/it/compiled_decode.rs`.
    CompiledBoundShort,
    /// The SSD store checks a stored `CacheList` (falcon_h1's layers) as a whole only, not
    /// part by part against the model's parts: a recurrent state of another shape whose
    /// bytes add up passes the scan. Caught by `engine/tests/it/ssd_hardening.rs`.
    SsdListPartsUnchecked,
    /// Multi-head latent attention (`model/mla.rs`): the query's rotated half taken from the
    /// front of each head and the unrotated half from its end (RoPE applied to the wrong
    /// part). Caught by the L1 gate on the MLA fixtures (`tests/it/l1_models/mla.rs`).
    MlaRopeOnWrongHalf,
    /// LoRA on multi-head latent attention: `kv_a_proj_with_mqa` (the latent's and the rope
    /// keys' projection) is left out of the linears LoRA attaches to. Caught by the LoRA
    /// training gate on tiny-deepseek-v3 (`tests/it/train_lora.rs`).
    MlaLatentProjLoraDropped,
    /// Tensor parallel on multi-head latent attention: `embed_q` / `unembed_out` keep the
    /// next rank's heads, not this rank's (the query and o_proj keep theirs). Caught by the
    /// distributed L1 gate on tiny-deepseek-v3 (`harness/tests/it/l1_dist.rs`).
    MlaHeadsOfOtherRank,
    /// OLMo's q/k RMSNorms, meant over the whole projection, taken per head (each head
    /// normalized on its own, then scaled by its slice of the weight). Caught by the L1
    /// gate on tiny-olmo2 and tiny-olmo3 (`tests/it/l1_models/dense.rs`).
    QkNormPerHead,
    /// Tool parsers: glm47 deserializes the arguments its tool's schema declares strings
    /// ("42" becomes 42). Caught by the tool-parser gate (`tests/it/tool_parsers.rs`).
    Glm47StringArgsDeserialized,
    /// Tool parsers: kimi_k2's call id loses its `functions.` prefix. Caught by
    /// `tests/it/tool_parsers.rs`.
    KimiK2IdWithoutPrefix,
    /// Tool parsers: minimax_m2 keeps a whole number parameter a float (2.0, not 2).
    /// Caught by `tests/it/tool_parsers.rs`.
    MinimaxWholeNumbersFloat,
    /// Tool parsers: longcat does not take a JSON object text whole. Caught by
    /// `tests/it/tool_parsers.rs`.
    LongcatJsonIgnored,
    /// DeepSeek-V3.2's indexer (`model/deepseek_v32.rs`): its scores not clamped at zero
    /// (the ReLU dropped), so other positions are kept. Caught by the L1 gate on
    /// tiny-deepseek-v32 (`tests/it/l1_models/mla.rs`).
    IndexerReluDropped,
    /// Tensor parallel on DeepSeek-V3.2: the indexer split by its heads as the attention is
    /// (`wq_b` and `weights_proj` cut by columns, each rank scoring with its half of the
    /// heads), where mlx-lm's shard leaves it whole. Caught by the distributed L1 gate on
    /// tiny-deepseek-v32 (`harness/tests/it/l1_dist.rs`).
    IndexerShardedByHeads,
    /// Tokenizer loading: tokenizer.json is read as written where transformers rebuilds it
    /// from `tokenizer_class` (Llama 2's and DeepSeek V3's LlamaTokenizer). Caught by the
    /// tokenization gate (`tests/it/tokenize.rs`).
    TokenizerClassIgnored,
    /// Tokenizer loading: every tokenizer is rebuilt as LlamaTokenizer, whatever its class
    /// (gpt-oss's PreTrainedTokenizerFast too). Caught by the tokenization gate.
    TokenizerEveryClassLlama,
    /// Chat templates: the tokenizer's special tokens (`bos_token`, …) never reach the
    /// template. Caught by the template gate (`tests/it/templates.rs`).
    TemplateSpecialTokensDropped,
    /// Chunked attention (llama4) in a cache-less forward (training's pass-through caches):
    /// the chunked layers read the plain causal mask, so every key before the query's own
    /// chunk is attended. Caught by the LoRA training gate on tiny-llama4
    /// (`tests/it/train_lora.rs`) from step 0's loss.
    ChunkedMaskCausalWithoutCache,
    /// Gemma 3n's cache-less forward (training's, mlx-lm's `model(inputs)`): the KV-shared
    /// layers still read their owners' K/V, as the cached forward does, instead of
    /// projecting their own (mlx-lm shares only through a cache). Caught by the LoRA
    /// training gate on tiny-gemma3n (`tests/it/train_lora.rs`).
    Gemma3nSharedKvWithoutCache,
    /// Tensor parallel on minimax: its sharded q/k RMSNorms (mlx-lm's `ShardedRMSNorm`) each
    /// normalize this rank's features only, without the sum of squares over the ranks.
    /// Caught by the distributed L1 gate on tiny-minimax (`harness/tests/it/l1_dist.rs`).
    ShardedNormPerRank,
    /// `engine convert`: the tensors are saved in name order, not the model's parameter
    /// order (`tree_flatten(model.parameters())`, each module's `__init__` order). Caught by
    /// the convert gate against mlx_lm.convert on every family's case
    /// (`engine/tests/it/convert.rs`).
    ConvertParamsSortedByName,
    /// `engine convert`: the MoE sanitizes stack the experts' gate projections from their
    /// up projections and the reverse (llama4's fused experts split the other way round).
    /// Caught by the convert gate on the per-expert checkpoints (deepseek_v3, glm4_moe,
    /// glm4_moe_lite, deepseek_v32, ernie4_5_moe, minimax, phimoe) and on llama4.
    ConvertExpertsGateUpSwapped,
    /// `engine convert`: the model's `quant_predicate` is ignored, so the routers it keeps
    /// at 8 bits take the top-level bits. Caught by the convert gate on qwen3_moe and
    /// minimax (and the MoE hybrids).
    ConvertRouterAtTopBits,
    /// Serve, /metrics: a sample line loses its value (a malformed exposition). Caught by
    /// the exposition parsers: `engine/tests/it/serve_metrics.rs` (prometheus-parse) and
    /// `oracles/prometheus_check.py` (prometheus_client's parser).
    MetricsMalformedLine,
    /// Serve, /metrics: generated tokens are never counted. Caught by the same two gates
    /// (engine_generation_tokens_total must equal the answers' usage).
    MetricsTokensOutUncounted,
    /// `/metrics` of a many-model server exports only the default model's request series
    /// (caught by engine/tests/it/serve_fleet.rs: the other models' counts are missing).
    MetricsDefaultModelOnly,
    /// Serve, many models: `--load-timeout` is ignored, so a load kept waiting by busy
    /// models waits on (caught by engine/tests/it/serve_fleet.rs: no 503).
    FleetLoadTimeoutIgnored,
    /// Serve, many models under a budget: a first load whose measured need is more than
    /// the estimate it made room for fails (a 500) instead of making room again and
    /// loading. Caught by `tests/it/serve_fleet.rs` (the first load of the larger model).
    FleetFirstLoadNotRetried,
    /// Serve, many models: a model thread never offers the MLX turn between steps (caught
    /// by engine/tests/it/serve_fleet.rs: two busy models' streams do not overlap).
    TurnNeverPassed,
    /// Serve: the `--grammar-*` work limits are ignored (caught by
    /// engine/tests/it/constrained_fuzz.rs: a tiny step fuel still answers 200).
    GrammarLimitsIgnored,
    /// Serve under a group: a grammar's fault on a step is taken for a lost group (caught
    /// by engine/tests/it/dist/serve.rs: the server exits instead of answering on).
    GrammarFaultLosesGroup,
    /// Serve, many models under a budget: a load counts its weights at once, beside what
    /// the other models' prompt caches hold (caught by engine/tests/it/serve_fleet.rs: the
    /// ledger's peak passes the budget).
    FleetLoadBesideCaches,
    /// Serve: a grammar's fault while generating is taken for the server's (a 500). Caught
    /// by engine/tests/it/constrained_fuzz.rs (the recursive schema must be a 400).
    GrammarFaultIsTheServers,
    /// Serve, /tokenize: chat messages are tokenized with the tokenizer's special tokens
    /// added (a second BOS before the template's). Caught by `serve_metrics.rs` (tokenize
    /// of messages must equal the chat route's prompt ids).
    TokenizeChatAddsSpecial,
    /// Serve: SSE streams get no keep-alive comments while a prompt prefills. Caught by
    /// `serve_metrics.rs` (comments must arrive before the first token).
    SseKeepAliveOff,
    /// Serve: `return_progress` sends no prompt_progress chunks. Caught by
    /// `serve_metrics.rs` (progress chunks must arrive before the first token).
    PromptProgressDropped,
    /// Serve, /v1/messages: `stop_reason` "end_turn" is written as OpenAI's "stop". Caught
    /// by the shape gate against the anthropic client's schemas (`tests/it/messages.rs`).
    MessagesStopReasonMisnamed,
    /// Serve, /v1/messages: a `tool_use` block's `input` is sent as the arguments' JSON
    /// string, not an object. Caught by the tool gate (`tests/it/messages.rs`).
    MessagesToolInputString,
    /// Serve: a request's thinking budget (`thinking.budget_tokens`) is not enforced, the
    /// thinking end never forced. Caught by the budget gate (`tests/it/messages.rs`).
    MessagesBudgetIgnored,
    /// Serve, /v1/messages: a stream's `message_delta` comes before the last
    /// `content_block_stop`. Caught by the stream-order check (`tests/it/messages.rs`).
    MessagesEventsOutOfOrder,
    /// Serve, images: a `file://` image outside `--allow-local-files DIR` (by `..` or a
    /// link) is read. Caught by `serve::images`' unit test and `tests/it/serve_images.rs`.
    ImageOutsideAllowedDir,
    /// `/v1/embeddings`' last-token pooling takes the token before the last (an off-by-one
    /// over the appended end-of-text token). Caught by the bit-exact gate against mlx-lm
    /// and the cosine gate against sentence-transformers (`tests/it/embeddings.rs`).
    EmbedPoolsBeforeLast,
    /// The model thread embeds every input of an embeddings request in one turn (a long
    /// request holds the running generations up). Caught by the interleaving check
    /// (`tests/it/embeddings.rs`: a stream sent while a long request is being embedded no
    /// longer ends first).
    EmbedHoldsTheLane,
    /// Serve, /v1/messages: `output_config.format` (structured outputs) never reaches the
    /// constrained sampler. Caught by the format gate (`tests/it/messages.rs`).
    MessagesOutputFormatIgnored,
    /// `engine serve --adapter`: every adapter's prompt-cache entries in the base model's
    /// namespace (""), so a base request reuses an adapter's KV caches. Caught by
    /// `serve_adapters::adapted_answers_match_the_cli_and_leave_the_base_alone` (RAM tier)
    /// and `serve_adapters::the_ssd_tier_keeps_adapters_apart`.
    AdapterCacheSharedWithBase,
    /// `engine serve --adapter`, serial lane: a request's adapter is put on the model at its
    /// admission only, not before each of its steps, so interleaved requests of different
    /// adapters step under each other's. Caught by the same test.
    AdapterSetOnceAtAdmission,
    /// `engine serve --adapter --batch N`: the batch lane admits rows of any adapter into
    /// the running group (stepped under the group's adapter). Caught by
    /// `serve_adapters::the_batch_lane_groups_rows_by_adapter`.
    AdapterBatchMixed,
    /// Serve, many models: the front router ignores a request's `model` and sends every
    /// request to the default model. Caught by the alternation gate
    /// (`tests/it/serve_fleet.rs`: the second model's answers differ from its own server's).
    FleetRoutesToDefault,
    /// Serve, many models: a request arriving while its model loads starts another load
    /// instead of waiting for that one. Caught by the concurrent-load gate
    /// (`tests/it/serve_fleet.rs`: /stats counts more than one load).
    FleetLoadsTwice,
    /// Serve, many models: `--model-ttl` never unloads an idle model. Caught by the TTL
    /// gate (`tests/it/serve_fleet.rs`: the model stays loaded past the wait).
    FleetTtlIgnored,
    /// The fleet loads a model without making room in the memory budget (`make_room`
    /// ignores bytes): two models stay loaded past it. Caught by serve_fleet.rs
    /// `a_shared_memory_budget_holds_one_model_at_a_time_and_both_answer`.
    FleetBudgetIgnored,
    /// Serve, `--memory-budget`: admission and prompt-cache trimming are off (every request
    /// is reserved however full the budget, the prompt cache is never trimmed). Caught by
    /// the flood gate (`tests/it/serve_budget.rs`): MLX's peak passes the budget.
    BudgetIgnored,
    /// Serve, many models: `--adapter` flags mount on every model, not just the default, so
    /// another model's load fails on an adapter that is not its own. Caught by serve_fleet.rs
    /// `the_default_models_adapters_follow_it_through_unloads`.
    FleetAdaptersOnEveryModel,
    /// Serve, `--memory-budget`: `/v1/embeddings` queues without a reservation, so its
    /// forwards run past what the budget leaves. Caught by serve_budget.rs
    /// `embeddings_reserve_their_forwards_against_the_memory_budget` (the too-big input
    /// answers 200, not 400).
    BudgetEmbeddingsUnreserved,
    /// Serve, many models under one `--memory-budget`: a model's prompt cache is trimmed,
    /// and requests reserved, as if the other models' prompt caches held nothing. Caught by
    /// serve_fleet.rs `one_models_prompt_cache_gives_way_to_anothers_requests_within_the_budget`
    /// (the ledger's peak passes the budget).
    BudgetOtherModelsCacheUncounted,
    /// Vision preprocessing: the resize samples the nearest pixel instead of the
    /// processor's filter (bilinear for gemma3). Caught by the preprocessing gate
    /// (`tests/it/vision_preprocess.rs`): the pixel tensors differ from mlx-vlm's.
    VisionResizeNearest,
    /// Vision preprocessing: the normalization mean is off by 1/255. Caught by the
    /// preprocessing gate (`tests/it/vision_preprocess.rs`).
    VisionMeanOff,
    /// Vision preprocessing: the prompt expansion writes one image token too many. Caught
    /// by the preprocessing gate (`tests/it/vision_preprocess.rs`).
    VisionTokenCountOffByOne,
    /// gemma3's vision tower: the SigLIP post-layernorm takes the layers' eps (1e-6) instead
    /// of `nn.LayerNorm`'s default 1e-5 that mlx-vlm gives it. Caught by the gemma3 vision
    /// gate (`tests/it/vision_gemma3.rs`): the tower's output differs from mlx-vlm's.
    VisionTowerNormOff,
    /// gemma3's image merge: the image features are placed one position after the image
    /// tokens. Caught by the gemma3 vision gate (`tests/it/vision_gemma3.rs`): the merged
    /// embeddings and the logits differ from mlx-vlm's.
    ImageFeaturesOffByOne,
    /// Qwen3-VL's vision tower: the 2-D rotary angles of a patch take its column for its
    /// row and its row for its column. Caught by the Qwen3-VL gate
    /// (`tests/it/vision_qwen3vl.rs`): the tower's output differs from mlx-vlm's.
    VisionRopeAxesSwapped,
    /// Qwen3-VL's image path: the deepstack features are not added to the hidden states
    /// after the first layers. Caught by the Qwen3-VL gate (`tests/it/vision_qwen3vl.rs`):
    /// the logits of the image prompts differ from mlx-vlm's.
    DeepstackSkipped,
    /// Qwen3-VL's image path: decode steps after an image prompt take their cache offset as
    /// their position, without the prompt's M-RoPE delta. Caught by the Qwen3-VL gate
    /// (`tests/it/vision_qwen3vl.rs`): the decode steps' logits differ from mlx-vlm's.
    MropeDeltaDropped,
    /// `vision::prompt`: a message's images placed on the wrong side of its text (gemma3's
    /// markers before the text, Qwen3-VL's image entries after it). Caught by the image
    /// generate gate (`tests/it/vision_generate.rs`): the templated prompt and its ids differ
    /// from mlx_vlm.generate's.
    ImageMarkerBeforeText,
    /// `vision::served`: a served Qwen message's image entries moved before its text (the
    /// CLI's order) instead of where the client put them. Caught by the served-images gate
    /// (`tests/it/serve_images.rs`): the answer to a text-then-image message differs from
    /// the one for the same prompt built in the client's order.
    ServedImageEntriesFirst,
    /// The serial lane: a request with images takes (and keeps) the prompt cache by its ids
    /// alone, so two requests with the same text and different images of one size share a
    /// cached prefix. Caught by the served-images gate (`tests/it/serve_images.rs`): the
    /// second image's answer after the first differs from its answer alone.
    ImageRequestCachedByIds,
    /// gemma4's vision tower: the 2-D RoPE's halves take the row for the column and the
    /// column for the row. Caught by the gemma4 vision gate (`tests/it/vision_gemma4.rs`):
    /// the tower's output differs from mlx-vlm's.
    Gemma4VisionRopeAxesSwapped,
    /// gemma4's image merge: the image features placed in reverse order over the image
    /// tokens. Caught by the gemma4 vision gate (`tests/it/vision_gemma4.rs`): the merged
    /// embeddings and the logits differ from mlx-vlm's.
    Gemma4ImageTokensReversed,
    /// gemma4's image prompt: no "same image block" overlay on the attention masks (image
    /// tokens attend causally). Caught by the gemma4 vision gate
    /// (`tests/it/vision_gemma4.rs`): the logits of the image prompts differ from mlx-vlm's.
    Gemma4ImageBlocksCausal,
    /// Qwen3.5's image path: the delta net's chunked prefill carries its state out of a
    /// 64-token chunk without that chunk's decay. Caught by the Qwen3.5 vision gate
    /// (`tests/it/vision_qwen35.rs`): the decode steps after the 2-image prompt (two chunks)
    /// differ from mlx-vlm's.
    Qwen35ChunkDecayDropped,
    /// Qwen3.5's image path: decode steps after an image prompt take their cache offset as
    /// their position, without the prompt's M-RoPE delta. Caught by the Qwen3.5 vision gate
    /// (`tests/it/vision_qwen35.rs`): the decode steps' logits differ from mlx-vlm's; and by
    /// the image generate gate (`tests/it/vision_generate.rs`): the greedy ids differ.
    Qwen35DeltaDropped,
    /// Qwen3.5's image path: a prompt's delta-net recurrence runs token by token (the text
    /// model's `gated_delta_ops`, mlx-lm's path) instead of mlx-vlm's chunked scan. Caught by
    /// the Qwen3.5 vision gate (`tests/it/vision_qwen35.rs`): the prompt logits differ.
    Qwen35PrefillSequential,
    /// gemma4's prompt expansion: each image marker becomes its soft tokens without the
    /// `boi` / `eoi` tokens around them. Caught by the image generate gate
    /// (`tests/it/vision_generate.rs`): the prompt ids differ from mlx_vlm.generate's.
    Gemma4ImageUnbracketed,
    /// gemma4's image prompt prefilled in `prefill_step_size` chunks as a text prompt is
    /// (its `chunked_prefill_policy` ignored; the chunks carry no image-block overlay).
    /// Caught by the image generate gate (`tests/it/vision_generate.rs`): with a prefill
    /// step shorter than the prompt, the greedy ids differ from mlx_vlm.generate's.
    Gemma4ImagePromptChunked,
    /// DoRA: the weight norm of the adapted weight is not gradient-stopped (mlx-lm's
    /// `DoRALinear` stops it), so A and B get gradients through the norm too. Caught by the
    /// DoRA training gate (`tests/it/train_lora.rs`) at step 0's gradients.
    DoraNormWithGradient,
    /// QLoRA: a quantized base's output is computed from its dequantized weight
    /// (`x @ dequantize(W).T`) instead of `quantized_matmul`, under a LoRA adapter. Caught
    /// by the LoRA training gate on the quantized rows (`tests/it/train_lora.rs`).
    QloraDequantizedBase,
    /// `engine fuse`: the adapter's scale applied twice in the fused weight. Caught by the
    /// fuse gate against mlx_lm.fuse (`engine/tests/it/fuse.rs`).
    FuseScaleTwice,
    /// Full fine-tuning unfreezes one block more than `num_layers`. Caught by the full
    /// fine-tuning gate (`tests/it/train_dora.rs`): its trainable set is not mlx-lm's.
    FullOneLayerTooMany,
    /// GRPO's micro-batched update: each micro-batch's terms are normalized by its own
    /// token and row counts instead of the whole batch's, so the accumulated loss and
    /// gradients are not the batch's. Caught by the micro-batch gate
    /// (`engine/tests/it/train_grpo.rs`).
    GrpoMicroBatchOwnTotals,
    /// Preflight's run window counts every busy CPU jiffy as the harness's own, so a
    /// neighbour that burned CPU during the run is not seen. Caught by the window's
    /// burner test (`harness/src/preflight/window.rs`).
    PreflightForeignCpuAsOurs,
    /// Preflight's run window ignores its CPU-clock samples, so a clock that fell during
    /// the run (throttling, a power cap) is not seen. Caught by the window's clock test
    /// (`harness/src/preflight/window.rs`).
    PreflightClockDropUnseen,
    /// `/stats` reads `requests` before the counters of how requests ended, so a request
    /// that starts and ends between the loads shows more ends than requests. Caught by
    /// `serve::routes`'s counter test.
    StatsRequestsReadFirst,
    /// `engine serve`'s connections never time out a blocked write, so a client that
    /// stops reading holds its connection until shutdown. Caught by
    /// `serve_limits::a_client_that_stops_reading_loses_its_connection`.
    WriteDeadlineOff,
    /// The batch lane's last row, going on alone, loses its newest cached position. Caught
    /// by `serve::a_lone_row_steps_alone_and_answers_as_the_serial_lane`.
    LoneRowLosesNewest,
    /// Not a defect: a fault the containment gate injects. A batch-lane forward fed id
    /// 1000 fails (as a forward that cannot be built or evaluated would).
    BatchFaultOnId1000,
    /// Not a defect: a condition a gate sets up. The idle batch lane takes its first job
    /// only once four are waiting (a minute at most), so that they arrive together
    /// whatever the machine's load (`serve::prompts_arriving_together_are_prefilled_together_exactly`).
    BatchGathersFour,
    /// A failed batch-lane forward fails every row (no retry alone). Caught by
    /// `serve_hardening::a_failing_row_fails_alone_and_the_batch_goes_on`.
    BatchFailureNotContained,
    /// The batch lane's all-rows greedy pick leaves the log-softmax out (its log-probabilities
    /// are the raw logits). Caught by `generate::decode`'s `greedy_rows` test.
    GreedyRowsUnnormalized,
    /// The distributed peer watch polls for nothing, so a peer's hang-up goes unseen.
    /// Caught by `dist::peers`'s hang-up test.
    PeerWatchDeaf,
    /// Tokenizer load: the one-pass BPE loader forgets the file's `byte_fallback`. Caught by
    /// `tests/it/tokenize.rs`'s one-pass loader gate. (New variants go last: the 64-bit
    /// switch's test counts on the ones before.)
    FastTokenizerNoByteFallback,
    /// Batched speculation: a batch cache gives back one token fewer than asked on every
    /// row that rejected drafts (`BatchKvCache::trim_rows`). Caught by
    /// `lookup::batched_lookup_rows_are_plain_greedy_and_a_short_row_trim_is_caught` and,
    /// through `engine serve`, by
    /// `lookup::batch_lane_lookup_rows_answer_as_plain_greedy_and_a_short_row_trim_is_caught`.
    BatchRowTrimShort,
    /// Not a defect: a fault the containment gate injects. Every batch-lane verify forward
    /// (a lookup round, `Batch::verify`) fails as it is built
    /// (`serve_hardening::a_failing_lookup_verify_is_contained_and_answers_as_plain_greedy`).
    BatchVerifyFails,
    /// Batched drafting: each drafter row keeps one rejected position while counting it as
    /// given back (`DraftBatch::settle`), so its next drafts read a stale id. Caught by
    /// `batch_draft::batch_lane_draft_rows_answer_as_plain_greedy_and_a_stale_drafter_is_caught`
    /// (drafts by the target itself stop being accepted).
    BatchDraftTrimShort,
    /// Tokenizer: the engine's BPE ranks every merge alike, so the leftmost mergeable pair of
    /// a word merges first (`Bpe::merge_all`). Caught by `tests/it/tokenize.rs`'s one-pass
    /// loader gate (ids against the crate's BPE).
    FastBpeMergesByPosition,
    /// Batched lookup: a sampled row draws over the round's longest run, not its own
    /// positions (drafts and one more; `Worker::pick_rounds`). Caught by
    /// `lookup::batch_lane_sampled_lookup_rows_answer_as_the_serial_lane_with_the_same_seeds`.
    BatchLookupDrawsPadded,
    /// Batched lookup: a lookup row's first id is sampled when it joins (`prefill_tick`; and
    /// lookup rows prefill in prompt batches, which sample it too), not drawn in its first
    /// round. Caught by the same gate.
    BatchLookupFirstIdAtAdmission,
    /// The batch lane under a group: a follower feeds rank 0's step ids to its rows in
    /// reverse order (its rows drift from rank 0's). Caught by
    /// `dist::serve::batch_lane_ranks_answer_concurrent_clients_as_one_process`.
    FollowerRowsReversed,
    /// A gate's set-up, not a defect: the batch lane's time slice is 20 ms instead of 500, so
    /// rows take turns within short answers on any machine (the `a_full_batch_lane_*`
    /// gates of `serve_limits` and `dist::serve`).
    BatchSliceShort,
    /// Chunked prefill: each chunk after the first starts again at the previous chunk's
    /// last id (the prompt sliced one short), so the caches hold that id twice. Caught by
    /// the chunked-prefill L1 gate over its compared steps (`tests/it/l1_models.rs`); a
    /// prompt prefilled in one chunk never sees it.
    PrefillChunksOverlap,
    /// A gate's set-up, not a defect: a failed collective's error never reaches the serving
    /// lane (`Leader::lose` blocks for good), as MLX's ring now and then leaves the
    /// collective on a dead peer waiting forever; the peer watch must end rank 0 and tell its
    /// requests (`dist::serve::a_lost_peer_fails_the_request_and_ends_rank_0`).
    LostCollectiveHangs,
    /// The peer watch ends a serving rank without telling its open requests of the loss
    /// (its hook skipped). Caught by `dist::serve::a_peer_watch_that_ends_rank_0_untold_is_caught`.
    LostPeerUntold,
    /// Not a defect: a condition a gate sets up. The idle serial lane admits its first job
    /// only once four are waiting (a minute at most), so that they interleave whatever the
    /// machine's load (`serve_adapters::adapted_answers_match_the_cli_and_leave_the_base_alone`'s
    /// planted half).
    SerialGathersFour,
    /// A request joining a running batch is fed its second-to-last prompt token again
    /// instead of its last (an off-by-one in the admission that joins without a step of its
    /// own). Caught by `serve::planted_joining_row_fed_the_wrong_token_is_caught`.
    JoinedRowRefeeds,
}

/// `plant::on` in a build without the `plant` feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this build carries no planted defects; build with `--features engine/plant`")]
pub struct NotCompiledIn;

/// A defect switched on; dropping it restores the state before [`on`].
#[must_use = "the defect is switched off again when the guard is dropped"]
#[derive(Debug)]
pub struct Planted {
    #[cfg(feature = "plant")]
    defect: Defect,
    #[cfg(feature = "plant")]
    was_on: bool,
    #[cfg(not(feature = "plant"))]
    _none: std::convert::Infallible,
}

/// Whether this build carries the planted defects (the `plant` feature).
pub const COMPILED_IN: bool = cfg!(feature = "plant");

#[cfg(feature = "plant")]
mod switch {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::Defect;

    /// The switch, one bit per defect (in as many words as the defects need), next to the
    /// marker: every query reads through a pointer to the whole struct, so a binary that can
    /// plant a defect carries the marker.
    #[repr(C)]
    pub(super) struct Switch {
        on: [AtomicU64; WORDS],
        marker: [u8; 34],
    }

    const WORDS: usize = 4;

    #[used]
    pub(super) static SWITCH: Switch = Switch {
        on: [const { AtomicU64::new(0) }; WORDS],
        marker: *b"ENGINE-PLANTED-DEFECTS-COMPILED-IN",
    };

    /// `d`'s word of the switch and its bit there.
    fn bit(d: Defect) -> (&'static AtomicU64, u64) {
        let i = d as usize;
        let word = switch()
            .on
            .get(i / 64)
            .expect("more planted defects than the switch has bits: widen it (WORDS)");
        (word, 1u64 << (i % 64))
    }

    fn switch() -> &'static Switch {
        std::hint::black_box(&SWITCH)
    }

    pub(super) fn is(d: Defect) -> bool {
        let (word, bit) = bit(d);
        word.load(Ordering::SeqCst) & bit != 0
    }

    /// Turns `d` on; whether it was on already.
    pub(super) fn set(d: Defect) -> bool {
        let (word, bit) = bit(d);
        word.fetch_or(bit, Ordering::SeqCst) & bit != 0
    }

    pub(super) fn any() -> bool {
        switch().on.iter().any(|w| w.load(Ordering::SeqCst) != 0)
    }

    pub(super) fn clear(d: Defect) {
        let (word, bit) = bit(d);
        word.fetch_and(!bit, Ordering::SeqCst);
    }

    #[allow(dead_code)]
    pub(super) fn marker() -> &'static [u8] {
        &switch().marker
    }
}

/// Whether `defect` is planted now.
#[cfg(feature = "plant")]
#[inline]
pub fn is(defect: Defect) -> bool {
    switch::is(defect)
}

/// Whether `defect` is planted now: never, in a build without the `plant` feature.
#[cfg(not(feature = "plant"))]
#[inline(always)]
pub const fn is(_defect: Defect) -> bool {
    false
}

/// Whether any defect is planted now (a gate run to show a plant fails it may stop at the
/// first difference).
#[cfg(feature = "plant")]
pub fn any() -> bool {
    switch::any()
}

/// Whether any defect is planted now: never, in a build without the `plant` feature.
#[cfg(not(feature = "plant"))]
pub const fn any() -> bool {
    false
}

/// Plants `defect` until the returned guard is dropped. Fails in a build without the
/// `plant` feature.
#[cfg(feature = "plant")]
pub fn on(defect: Defect) -> Result<Planted, NotCompiledIn> {
    let was_on = switch::set(defect);
    Ok(Planted { defect, was_on })
}

/// Plants `defect` until the returned guard is dropped. Fails in a build without the
/// `plant` feature.
#[cfg(not(feature = "plant"))]
pub fn on(_defect: Defect) -> Result<Planted, NotCompiledIn> {
    Err(NotCompiledIn)
}

/// Test builds only: switches on, for the life of the process, the defects named in
/// `ENGINE_PLANT=Name[,Name…]`, so that a gate can show it fails against a server process
/// that carries one (engine/tests/it/serve_tools.rs). Only the defects a process-level gate
/// needs have names here.
#[cfg(feature = "plant")]
pub fn on_from_env() -> Result<(), String> {
    let Ok(names) = std::env::var("ENGINE_PLANT") else {
        return Ok(());
    };
    for name in names.split(',').filter(|n| !n.is_empty()) {
        let defect =
            named(name).ok_or_else(|| format!("ENGINE_PLANT: no planted defect named {name}"))?;
        // On for the life of the process.
        std::mem::forget(on(defect).map_err(|e| e.to_string())?);
    }
    Ok(())
}

/// The defects a process-level gate switches on through `ENGINE_PLANT`, by their names.
#[cfg(feature = "plant")]
const NAMED: [Defect; 99] = [
    Defect::ToolCallTextInContent,
    Defect::ToolCallFinishStaysStop,
    Defect::ReasoningInContent,
    Defect::ResponsesUsageMisnamed,
    Defect::ResponsesPreviousDropped,
    Defect::ResponsesToolOutputDropped,
    Defect::MetricsMalformedLine,
    Defect::LossChunkOffByOne,
    Defect::LossChunkHeadNoGrad,
    Defect::MetricsTokensOutUncounted,
    Defect::MetricsDefaultModelOnly,
    Defect::FleetLoadTimeoutIgnored,
    Defect::FleetFirstLoadNotRetried,
    Defect::TurnNeverPassed,
    Defect::GrammarLimitsIgnored,
    Defect::GrammarFaultLosesGroup,
    Defect::FleetLoadBesideCaches,
    Defect::GrammarFaultIsTheServers,
    Defect::TokenizeChatAddsSpecial,
    Defect::SseKeepAliveOff,
    Defect::PromptProgressDropped,
    Defect::ResponsesFormatIgnored,
    Defect::ResponsesMetadataUnchecked,
    Defect::MessagesStopReasonMisnamed,
    Defect::MessagesToolInputString,
    Defect::MessagesBudgetIgnored,
    Defect::MessagesEventsOutOfOrder,
    Defect::DistShardWrongRank,
    Defect::DistReduceDropped,
    Defect::GdnConvShardUnsegmented,
    Defect::AdapterCacheSharedWithBase,
    Defect::AdapterSetOnceAtAdmission,
    Defect::AdapterBatchMixed,
    Defect::KvRepeatAfterShard,
    Defect::ShardedNormPerRank,
    Defect::MlaHeadsOfOtherRank,
    Defect::IndexerShardedByHeads,
    Defect::StrictToolsUnconstrained,
    Defect::ConstrainMaskOffByOne,
    Defect::FollowerUnconstrained,
    Defect::BatchUnmaskedPadding,
    Defect::EmbedPoolsBeforeLast,
    Defect::EmbedHoldsTheLane,
    Defect::MessagesOutputFormatIgnored,
    Defect::FleetRoutesToDefault,
    Defect::FleetLoadsTwice,
    Defect::FleetTtlIgnored,
    Defect::FleetBudgetIgnored,
    Defect::BudgetIgnored,
    Defect::FleetAdaptersOnEveryModel,
    Defect::BudgetEmbeddingsUnreserved,
    Defect::BudgetOtherModelsCacheUncounted,
    Defect::ImageOutsideAllowedDir,
    Defect::VisionResizeNearest,
    Defect::VisionMeanOff,
    Defect::VisionTokenCountOffByOne,
    Defect::VisionTowerNormOff,
    Defect::ImageFeaturesOffByOne,
    Defect::VisionRopeAxesSwapped,
    Defect::DeepstackSkipped,
    Defect::MropeDeltaDropped,
    Defect::ImageMarkerBeforeText,
    Defect::ServedImageEntriesFirst,
    Defect::ImageRequestCachedByIds,
    Defect::Gemma4VisionRopeAxesSwapped,
    Defect::Gemma4ImageTokensReversed,
    Defect::Gemma4ImageBlocksCausal,
    Defect::Qwen35ChunkDecayDropped,
    Defect::Qwen35DeltaDropped,
    Defect::Qwen35PrefillSequential,
    Defect::Gemma4ImageUnbracketed,
    Defect::Gemma4ImagePromptChunked,
    Defect::DoraNormWithGradient,
    Defect::QloraDequantizedBase,
    Defect::FuseScaleTwice,
    Defect::FullOneLayerTooMany,
    Defect::DpoBetaTwice,
    Defect::DpoReferenceFromPolicy,
    Defect::SimpoGammaNotOverBeta,
    Defect::DpoReferenceKeepsAdapters,
    Defect::CompiledStepKeyWithoutPrefix,
    Defect::CompiledStepKeyWithoutLambda,
    Defect::WriteDeadlineOff,
    Defect::LoneRowLosesNewest,
    Defect::BatchFaultOnId1000,
    Defect::BatchFailureNotContained,
    Defect::BatchGathersFour,
    Defect::SerialGathersFour,
    Defect::BatchRowTrimShort,
    Defect::BatchVerifyFails,
    Defect::BatchDraftTrimShort,
    Defect::FastBpeMergesByPosition,
    Defect::BatchLookupDrawsPadded,
    Defect::BatchLookupFirstIdAtAdmission,
    Defect::FollowerRowsReversed,
    Defect::BatchSliceShort,
    Defect::LostCollectiveHangs,
    Defect::LostPeerUntold,
    Defect::JoinedRowRefeeds,
];

/// The defect `ENGINE_PLANT` calls `name` (None: no process-level gate needs it).
#[cfg(feature = "plant")]
fn named(name: &str) -> Option<Defect> {
    NAMED.into_iter().find(|d| format!("{d:?}") == name)
}

#[cfg(feature = "plant")]
impl Drop for Planted {
    fn drop(&mut self) {
        if !self.was_on {
            switch::clear(self.defect);
        }
    }
}

#[cfg(all(test, feature = "plant"))]
mod tests {
    use super::*;

    #[test]
    fn the_guard_restores_the_previous_state_also_on_panic() {
        assert!(!is(Defect::DropCotangent));
        {
            let _outer = on(Defect::DropCotangent).unwrap();
            assert!(is(Defect::DropCotangent));
            assert!(!is(Defect::BatchUnmaskedPadding));
            {
                let _inner = on(Defect::DropCotangent).unwrap();
                assert!(is(Defect::DropCotangent));
            }
            assert!(is(Defect::DropCotangent), "the inner guard kept it on");
        }
        assert!(!is(Defect::DropCotangent));
        let caught = std::panic::catch_unwind(|| {
            let _on = on(Defect::BatchUnmaskedPadding).unwrap();
            panic!("a gate failed while planted");
        });
        assert!(caught.is_err());
        assert!(!is(Defect::BatchUnmaskedPadding), "a panic left it on");
        assert_eq!(switch::marker(), b"ENGINE-PLANTED-DEFECTS-COMPILED-IN");
    }

    /// `ENGINE_PLANT`'s names are the variants' own; a name not in the table is none.
    #[test]
    fn env_names_find_their_defects() {
        assert_eq!(named("LostPeerUntold"), Some(Defect::LostPeerUntold));
        assert_eq!(
            named("ToolCallTextInContent"),
            Some(Defect::ToolCallTextInContent)
        );
        assert_eq!(named("lostpeeruntold"), None);
        assert_eq!(
            named("PrefillChunksOverlap"),
            None,
            "no process-level gate needs it"
        );
    }

    /// A defect past the first 64 sits in the switch's second word, apart from the one
    /// 64 places before it.
    #[test]
    fn defects_past_64_have_their_own_bit() {
        let (low, high) = (Defect::SpecKeepDraftTail, Defect::KvRepeatAfterShard);
        assert_eq!(
            (low as usize, high as usize % 64),
            (0, 0),
            "pick another pair"
        );
        let _on = on(high).unwrap();
        assert!(is(high) && !is(low));
    }
}
