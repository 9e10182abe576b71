//! The harness binary's integration tests, in one test binary.
//! Run one module with `cargo test -p harness --test it MODULE::`.

mod cli;
mod l1_dist;
