//! The KV cache as a compiled decode step sees it: whole fixed-capacity buffers and the
//! offset as an MLX array, so one traced graph serves every position until the buffers
//! grow. New keys land with a dynamic slice update; attention runs over the whole buffer
//! with a boolean mask of the live positions. On the CPU backend that masked attention
//! equals, bit for bit, attention over the sliced keys (measured; the L1 gate re-checks it
//! through every compiled step).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

use super::{Cache, Kv, Mask, RopeOffset};

pub struct FixedKv {
    pub keys: Array,
    pub values: Array,
    /// int32 scalar: the position of the token being added.
    pub offset: Array,
}

/// `src` with `update` written at `start` (an array) along `axis`.
pub fn slice_update_dynamic(
    src: &Array,
    update: &Array,
    start: &Array,
    axis: i32,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let axes = [axis];
    // SAFETY: every handle passed is live for the call; on success `res` owns a new array
    // that `Array::from_ptr` takes over, on failure it is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update_dynamic(
            &mut res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            axes.as_ptr(),
            axes.len(),
            stream.as_ptr(),
        );
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom("mlx_slice_update_dynamic failed"));
        }
        Ok(Array::from_ptr(res))
    }
}

impl Cache for FixedKv {
    fn offset(&self) -> i32 {
        // Only meaningful as an array inside the compiled graph.
        -1
    }

    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Array(self.offset.clone())
    }

    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        self.keys = slice_update_dynamic(&self.keys, &keys, &self.offset, 2)?;
        self.values = slice_update_dynamic(&self.values, &values, &self.offset, 2)?;
        Ok(Kv::Dense(self.keys.clone(), self.values.clone()))
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn state(&self) -> Vec<&Array> {
        vec![&self.keys, &self.values]
    }

    /// Positions 0..=offset of the buffer are live.
    fn make_mask(&self, n: i32, _window: Option<i32>) -> Result<Mask, Exception> {
        if n != 1 {
            return Err(Exception::custom(
                "the fixed-capacity cache serves one-token decode steps only",
            ));
        }
        let capacity = self.keys.shape()[2];
        let positions = mlx_rs::ops::arange::<_, i32>(0, capacity, 1)?;
        Ok(Mask::Array(positions.le(&self.offset)?))
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
