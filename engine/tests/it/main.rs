//! The engine's integration tests, one module per subsystem, linked into one test binary
//! (one link instead of one per file: the test build's time goes to linking on a small
//! machine). Run one module with `cargo test -p engine --test it MODULE::`.

mod chat_e2e;
mod cli;
mod common;
mod compiled_decode;
mod constrained;
mod constrained_fuzz;
mod constrained_tools;
mod convert;
mod dist;
mod embeddings;
mod hub;
mod kvstore;
mod loading;
mod lookup;
mod messages;
mod mlx_runtime;
mod orpo_prefix;
mod prompt_cache;
mod prompt_store;
mod responses;
mod segmented;
mod serve;
mod serve_adapters;
mod serve_budget;
mod serve_fleet;
mod serve_hardening;
mod serve_images;
mod serve_limits;
mod serve_metrics;
mod serve_tools;
mod spec_hybrid;
mod speculative;
mod ssd_hardening;
mod ssd_store;
mod tool_parsers;
mod train;
mod train_families;
mod train_moe2;
mod vision_gemma3;
mod vision_gemma4;
mod vision_generate;
mod vision_preprocess;
mod vision_qwen35;
mod vision_qwen3vl;
