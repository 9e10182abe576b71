//! The top-level gates (they need engine + goldens), one module per gate, linked into one
//! test binary. Run one gate with `cargo test --test it GATE::` (e.g. `l1_models::`).

mod batch_decode;
mod detok;
mod l1_models;
mod l1_sampling;
mod l1_vocab;
mod l2_models;
mod l3_envelope;
mod l3_kl;
mod runtime_golden;
mod shard_refusals;
mod spec_decode;
mod spec_l2;
mod templates;
mod tokenize;
mod train_dora;
mod train_lora;
