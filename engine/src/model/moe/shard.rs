//! Tensor parallel on stacked experts, as mlx-lm 0.32.2 shards its MoE blocks (mlx's
//! `shard_inplace` on each `SwitchLinear` of a `SwitchGLU`): every rank keeps **all**
//! experts, each narrowed to its part of the intermediate features, and the router stays
//! whole, so every rank routes the same tokens to the same experts:
//!
//!   gate, up  [E, I, D] → [E, I/N, D]   (all-to-sharded: axis 1, a bias [E, I] on -1)
//!   down      [E, D, I] → [E, D, I/N]   (sharded-to-all: axis -1, a bias kept whole)
//!
//! Quantized scales and biases are cut as the packed weight is. A narrowed down projection
//! yields this rank's partial sums; the block that owns the experts combines the k experts'
//! outputs as usual, then sums the combination over the ranks (`sum_partials`) — one
//! `all_sum` per sparse block, after the weighing, as mlx-lm's blocks do.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::{SwitchGlu, SwitchLinear};
use crate::load::LoadError;
use crate::model::shard::{shard_params, Part, Split};
use crate::plant::{self, Defect};

impl SwitchLinear {
    /// Keeps this rank's part of every expert (mlx's `shard_inplace`), in place.
    pub fn shard(&mut self, split: Split, part: Part, what: &str) -> Result<(), LoadError> {
        if self.lora.borrow().is_some() {
            return Err(LoadError::Unsupported(format!(
                "`{what}`: LoRA adapters on a tensor-parallel model are not supported (as in \
                 mlx-lm)"
            )));
        }
        // [experts, out, in]: the outputs are axis 1, the inputs -1.
        shard_params(
            &mut self.weight,
            &mut self.quantized,
            &mut self.bias,
            (split, part),
            what,
        )?;
        self.partial_sums = split == Split::Rows;
        Ok(())
    }
}

impl SwitchGlu {
    /// gate and up by columns, down by rows (`qwen3_moe.Model.shard`, `gpt_oss.Model.shard`);
    /// `experts` names the module (`model.layers.3.mlp.switch_mlp`).
    pub fn shard(&mut self, part: Part, experts: &str) -> Result<(), LoadError> {
        self.gate_proj
            .shard(Split::Columns, part, &format!("{experts}.gate_proj"))?;
        self.down_proj
            .shard(Split::Rows, part, &format!("{experts}.down_proj"))?;
        self.up_proj
            .shard(Split::Columns, part, &format!("{experts}.up_proj"))
    }

    /// The block's combined output `y` summed over the ranks when the experts are sharded
    /// (their down projection gives partial sums), else `y` as it is.
    pub fn sum_partials(&self, y: Array) -> Result<Array, Exception> {
        if !self.down_proj.partial_sums || plant::is(Defect::DistReduceDropped) {
            return Ok(y);
        }
        crate::dist::all_sum(&y)
    }
}
