//! Weights from `*.safetensors` via memmap2: headers are parsed in place and each tensor is
//! copied once, straight from the mapped file into an MLX array of the same dtype. A rank of
//! a distributed group loads lazily instead (MLX reads a tensor when it is evaluated).
//!
//! The loader states the shape of every tensor it takes (`take_shaped`), computed from
//! config.json as mlx-lm's modules are built from it; a tensor of another shape is refused
//! at load, naming it, as MLX's strict `load_weights` refuses it in mlx-lm. A probe
//! (`Weights::probe`) holds no tensors and records what the loader asks for instead: the
//! names and shapes a checkpoint of a config must have (`model::expected_weights`).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use mlx_rs::{Array, Dtype};
use safetensors::{Dtype as StDtype, SafeTensors};

use super::config::{QuantConfig, QuantMode, QuantParams};
use super::LoadError;

/// All tensors of a model directory by name (plus the checkpoint's quantization map, so
/// layers can tell whether they were stored quantized).
pub struct Weights {
    tensors: HashMap<String, Array>,
    quantization: Option<QuantConfig>,
    /// Set for a probe: no tensors; every `take_shaped` is recorded.
    probe: Option<Probe>,
}

/// Tensors by name and shape, in the order they were taken.
pub type Shapes = Vec<(String, Vec<i32>)>;

/// What a probe was asked for: each tensor's name (under the probe's prefix) and stated
/// shape, in the order the loader took them. Shared with whoever made the probe, since a
/// family's build consumes the `Weights`.
#[derive(Clone, Default)]
pub struct Probe {
    taken: Arc<Mutex<Shapes>>,
    /// Put before every recorded name (a wrapper's language-model prefix).
    prefix: String,
}

impl Probe {
    /// The (name, shape) pairs taken so far, in load order.
    pub fn tensors(&self) -> Shapes {
        self.taken.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Records `name` and returns lazy zeros of `shape` (never evaluated by a build).
    fn take(&self, name: &str, shape: &[i32]) -> Result<Array, LoadError> {
        let name = format!("{}{name}", self.prefix);
        let mut taken = self
            .taken
            .lock()
            .map_err(|_| LoadError::Weights("the probe's record is poisoned".into()))?;
        if taken.iter().any(|(n, _)| *n == name) {
            return Err(LoadError::Weights(format!(
                "probe: `{name}` is taken twice (each tensor has one owner)"
            )));
        }
        taken.push((name, shape.to_vec()));
        Ok(mlx_rs::ops::zeros::<f32>(shape)?)
    }
}

/// The refusal of a tensor whose shape is not the one config.json gives it; `how` says how
/// the expected shape was derived (a quantized weight's packing), or is empty.
pub(crate) fn check_shape(
    name: &str,
    found: &[i32],
    expected: &[i32],
    how: &str,
) -> Result<(), LoadError> {
    if found == expected {
        return Ok(());
    }
    Err(LoadError::Weights(format!(
        "`{name}` has shape {found:?}, but config.json makes it {expected:?}{how}: the \
         checkpoint does not fit its config.json"
    )))
}

fn mlx_dtype(dtype: StDtype) -> Option<Dtype> {
    Some(match dtype {
        StDtype::F32 => Dtype::Float32,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::F64 => Dtype::Float64,
        StDtype::U8 => Dtype::Uint8,
        StDtype::U16 => Dtype::Uint16,
        StDtype::U32 => Dtype::Uint32,
        StDtype::U64 => Dtype::Uint64,
        StDtype::I8 => Dtype::Int8,
        StDtype::I16 => Dtype::Int16,
        StDtype::I32 => Dtype::Int32,
        StDtype::I64 => Dtype::Int64,
        StDtype::BOOL => Dtype::Bool,
        _ => return None,
    })
}

/// The weight files of a directory as mlx-lm's `load_model` globs them:
/// `model*.safetensors` (one file or the shards). Other safetensors files — a mistralai
/// repo's `consolidated.safetensors`, adapters — are not weights of the model.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| LoadError::Io {
            path: dir.to_owned(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadError::Weights(format!(
            "no model*.safetensors files in {} (the weights are read from model.safetensors or \
             its shards model-00001-of-000NN.safetensors, as mlx-lm reads them)",
            dir.display()
        )));
    }
    Ok(files)
}

impl Weights {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        Self::load_files(dir, false)
    }

    /// MLX's lazy safetensors arrays, read when evaluated: a rank of a distributed group
    /// reads the slices and layers it keeps and never the rest, so its peak stays near its
    /// share of the model (as with mlx-lm's lazy `sharded_load`).
    pub fn load_lazy(dir: &Path) -> Result<Self, LoadError> {
        Self::load_files(dir, true)
    }

    fn load_files(dir: &Path, lazy: bool) -> Result<Self, LoadError> {
        let mut tensors = HashMap::new();
        for path in weight_files(dir)? {
            if lazy {
                load_file_lazy(&path, &mut tensors)?;
            } else {
                load_file(&path, &mut tensors)?;
            }
        }
        Ok(Weights {
            tensors,
            quantization: None,
            probe: None,
        })
    }

    /// A probe: no files, no tensors. `take_shaped` records each name and stated shape (see
    /// `probe_record`) and gives lazy zeros of that shape; a plain `take` is an error (a
    /// probe lists only tensors whose shape the loader states). The probe holds nothing, so
    /// `contains` is false for every name: a loader that branches on the checkpoint's layout
    /// takes the MLX layout (stacked experts under `switch_mlp`/`switch_glu`, not Hugging
    /// Face's per-expert or fused tensors), and a family that ties its head when `lm_head`
    /// is absent (gemma3_text) ties it. Nothing is quantized (`quant_params` is None): a
    /// probe lists the dense, logical shapes, also for a quantized config.
    pub fn probe() -> Self {
        Weights {
            tensors: HashMap::new(),
            quantization: None,
            probe: Some(Probe::default()),
        }
    }

    /// The record of a probe (None for weights read from files).
    pub fn probe_record(&self) -> Option<Probe> {
        self.probe.clone()
    }

    pub fn is_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// A probe records the names under `prefix` from here on (a wrapper's checkpoint keeps
    /// its language model there); no effect on weights read from files.
    pub fn set_probe_prefix(&mut self, prefix: &str) {
        if let Some(p) = &mut self.probe {
            p.prefix = prefix.to_owned();
        }
    }

    /// Weights over tensors already in memory: `engine convert` runs a family's sanitize
    /// (the loader's own) on the checkpoint's tensors through this.
    pub fn from_tensors(tensors: impl IntoIterator<Item = (String, Array)>) -> Self {
        Weights {
            tensors: tensors.into_iter().collect(),
            quantization: None,
            probe: None,
        }
    }

    /// The tensors left, by name (what a sanitize made of them, for `engine convert`).
    pub fn into_tensors(self) -> HashMap<String, Array> {
        self.tensors
    }

    /// The quantization map the checkpoint's config declares.
    pub fn set_quantization(&mut self, quantization: Option<QuantConfig>) {
        self.quantization = quantization;
    }

    /// How module `path` (with `in_dims` inputs) is stored, as mlx-lm's loader decides
    /// (`load_model`'s class_predicate): an explicit per-path entry wins; otherwise a
    /// module is quantized iff `<path>.scales` exists, with group size and bits inferred
    /// from the stored shapes and the mode from the scales (`infer_quant_config`): float
    /// scales are affine, uint8 ones the one floating-point mode with that (bits, group).
    pub fn quant_params(&self, path: &str, in_dims: i32) -> Result<Option<QuantParams>, LoadError> {
        let Some(q) = self.quantization.as_ref().filter(|_| self.probe.is_none()) else {
            return Ok(None);
        };
        if self.tensors.contains_key(&format!("{path}.global_scale")) {
            return Err(LoadError::Unsupported(format!(
                "`{path}.global_scale`: nvfp4 with a per-tensor global scale is not supported \
                 (MLX 0.32.2's gather_qmm takes none, so mlx-lm 0.32.2 cannot run it either)"
            )));
        }
        if let Some(explicit) = q.per_path.get(path) {
            return Ok(*explicit);
        }
        let Some(scales) = self.tensors.get(&format!("{path}.scales")) else {
            return Ok(None);
        };
        let weight = self
            .tensors
            .get(&format!("{path}.weight"))
            .ok_or_else(|| LoadError::Weights(format!("missing tensor `{path}.weight`")))?;
        let groups = *scales.shape().last().unwrap_or(&1);
        let packed = *weight.shape().last().unwrap_or(&0);
        let group_size = in_dims / groups.max(1);
        let bits = packed * 32 / in_dims.max(1);
        let mode = if scales.dtype() != Dtype::Uint8 {
            QuantMode::Affine
        } else {
            match (bits, group_size) {
                (4, 16) => QuantMode::Nvfp4,
                (4, 32) => QuantMode::Mxfp4,
                (8, 32) => QuantMode::Mxfp8,
                _ => {
                    return Err(LoadError::Unsupported(format!(
                        "Cannot infer the quantization mode of {path}: {bits} bits with group \
                         size {group_size} (uint8 scales are mxfp4 4/32, nvfp4 4/16 or mxfp8 \
                         8/32)"
                    )))
                }
            }
        };
        Ok(Some(QuantParams {
            group_size,
            bits,
            mode,
        }))
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored shape of tensor `name`, if present (for a loader that reads a width from
    /// the checkpoint rather than config.json: the assistant drafter's).
    pub fn stored_shape(&self, name: &str) -> Option<Vec<i32>> {
        self.tensors.get(name).map(|a| a.shape().to_vec())
    }

    /// Takes tensor `name` out of the set (each weight has one owner: its layer), whatever
    /// its shape. The model loaders state shapes (`take_shaped`); a probe refuses this.
    pub fn take(&mut self, name: &str) -> Result<Array, LoadError> {
        if self.probe.is_some() {
            return Err(LoadError::Weights(format!(
                "probe: `{name}` is taken without a stated shape (a probe lists only tensors \
                 whose shape the loader states: take_shaped)"
            )));
        }
        self.tensors
            .remove(name)
            .ok_or_else(|| LoadError::Weights(format!("missing tensor `{name}`")))
    }

    /// Takes tensor `name`, which config.json makes `shape`: a tensor of another shape is
    /// refused, naming it and both shapes (MLX's strict `load_weights` refuses it in mlx-lm
    /// too). A probe records it instead and gives lazy zeros of `shape`.
    pub fn take_shaped(&mut self, name: &str, shape: &[i32]) -> Result<Array, LoadError> {
        self.take_stored(name, shape, "")
    }

    /// As `take_shaped` for a tensor stored as `shape`, which `how` derives from the
    /// config's (a quantized weight's packing, named in the refusal).
    pub(crate) fn take_stored(
        &mut self,
        name: &str,
        shape: &[i32],
        how: &str,
    ) -> Result<Array, LoadError> {
        if let Some(probe) = &self.probe {
            return probe.take(name, shape);
        }
        let a = self.take(name)?;
        check_shape(name, a.shape(), shape, how)?;
        Ok(a)
    }

    /// Renames every tensor by `f`, dropping those it maps to None (a wrapper's sanitize:
    /// the language model's prefix stripped, vision/audio towers dropped).
    pub fn rename(&mut self, f: impl Fn(&str) -> Option<String>) {
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .filter_map(|(name, a)| f(&name).map(|n| (n, a)))
            .collect();
    }

    /// Adds tensor `name` (a sanitize's split of a fused tensor).
    pub fn insert(&mut self, name: String, a: Array) {
        self.tensors.insert(name, a);
    }

    /// The shape of tensor `name`, if the set holds it.
    pub fn shape_of(&self, name: &str) -> Option<Vec<i32>> {
        self.tensors.get(name).map(|a| a.shape().to_vec())
    }

    /// Replaces each tensor `f` gives a new value for (a family's sanitize: a kernel moved
    /// to MLX's layout, a norm's stored offset given its 1).
    pub fn transform(
        &mut self,
        f: impl Fn(&str, &Array) -> Result<Option<Array>, mlx_rs::error::Exception>,
    ) -> Result<(), LoadError> {
        for (name, a) in self.tensors.iter_mut() {
            if let Some(new) =
                f(name, a).map_err(|e| LoadError::Weights(format!("`{name}`: {e}")))?
            {
                *a = new;
            }
        }
        Ok(())
    }

    /// Drops tensors a family ignores (e.g. precomputed rotary frequencies).
    pub fn discard(&mut self, pred: impl Fn(&str) -> bool) {
        self.tensors.retain(|name, _| !pred(name));
    }

    /// Names left over after a model took what it needs; non-empty means a mismatch.
    /// Errs if tensors are left that `model_type` did not take (a checkpoint of another
    /// layout must not load silently); `ignored` names those its sanitize drops.
    pub fn ensure_consumed(
        &self,
        model_type: &str,
        ignored: impl Fn(&str) -> bool,
    ) -> Result<(), LoadError> {
        let left: Vec<String> = self
            .remaining()
            .into_iter()
            .filter(|n| !ignored(n))
            .collect();
        match left.first() {
            None => Ok(()),
            Some(first) => Err(LoadError::Weights(format!(
                "{} tensors this {model_type} config does not use, e.g. `{first}`",
                left.len()
            ))),
        }
    }

    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }
}

fn load_file(path: &Path, out: &mut HashMap<String, Array>) -> Result<(), LoadError> {
    let file = File::open(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: the mapping is read-only and lives only while we copy out of it; a file
    // truncated under us would fault, as with any mmap reader (mlx and safetensors alike).
    let map = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    let st = SafeTensors::deserialize(&map).map_err(|e| LoadError::Safetensors {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    for (name, view) in st.tensors() {
        let dtype = mlx_dtype(view.dtype()).ok_or_else(|| LoadError::Safetensors {
            path: path.to_owned(),
            message: format!("tensor `{name}` has unsupported dtype {:?}", view.dtype()),
        })?;
        let shape: Vec<i32> = view.shape().iter().map(|&d| d as i32).collect();
        let data = view.data();
        // SAFETY: `data` holds exactly prod(shape) elements of `dtype` (safetensors checked
        // the byte length against shape and dtype); MLX copies them before we unmap.
        let array = unsafe { Array::from_raw_data(data.as_ptr().cast(), &shape, dtype) };
        out.insert(name, array);
    }
    Ok(())
}

/// `mx.load(path)` through mlx-c: arrays whose data MLX reads from the file when they are
/// evaluated (on the CPU stream, where MLX's loads run).
fn load_file_lazy(path: &Path, out: &mut HashMap<String, Array>) -> Result<(), LoadError> {
    let fail = |message: String| LoadError::Safetensors {
        path: path.to_owned(),
        message,
    };
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| fail("the path has a NUL byte".into()))?;
    // SAFETY: every handle is created here and freed before returning; each value handle
    // is fresh before `next` sets it and is taken over by `Array::from_ptr`; `key` points
    // into the map, which outlives its copy into a String.
    unsafe {
        let stream = mlx_sys::mlx_default_cpu_stream_new();
        let mut map = mlx_sys::mlx_map_string_to_array_new();
        let mut meta = mlx_sys::mlx_map_string_to_string_new();
        let status = mlx_sys::mlx_load_safetensors(&mut map, &mut meta, c_path.as_ptr(), stream);
        mlx_sys::mlx_stream_free(stream);
        mlx_sys::mlx_map_string_to_string_free(meta);
        if status != 0 {
            mlx_sys::mlx_map_string_to_array_free(map);
            return Err(fail("MLX could not read it".into()));
        }
        let it = mlx_sys::mlx_map_string_to_array_iterator_new(map);
        loop {
            let mut key: *const std::os::raw::c_char = std::ptr::null();
            let mut value = mlx_sys::mlx_array_new();
            if mlx_sys::mlx_map_string_to_array_iterator_next(&mut key, &mut value, it) != 0 {
                mlx_sys::mlx_array_free(value);
                break;
            }
            let name = std::ffi::CStr::from_ptr(key).to_string_lossy().into_owned();
            out.insert(name, Array::from_ptr(value));
        }
        mlx_sys::mlx_map_string_to_array_iterator_free(it);
        mlx_sys::mlx_map_string_to_array_free(map);
    }
    Ok(())
}
