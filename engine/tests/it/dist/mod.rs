//! Distributed inference on loopback ranks (MLX's ring backend, started as mlx.launch starts
//! them: MLX_RANK, MLX_HOSTFILE), in one test binary: `engine generate` fault cases ending in
//! bounded time (faults), pipeline parallel against one process (pipeline), and `engine serve`
//! as two ranks answering as one server (serve).
#![cfg(unix)]

mod faults;
mod pipeline;
mod ranks;
mod serve;
