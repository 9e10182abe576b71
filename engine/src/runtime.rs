//! Process-wide MLX facts: the runtime's version, backend, default device, where libmlx
//! was loaded from, memory counters and a tiny self-check. The one module that touches
//! process-wide MLX state.

use std::ffi::CStr;
use std::path::PathBuf;

use mlx_rs::{Array, Device, DeviceType};

/// Errors from the MLX runtime layer.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("MLX call failed: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("MLX self-check failed: {0}")]
    SelfCheck(String),
}

/// The MLX version the loaded libmlx reports (not the version we built against).
pub fn mlx_version() -> String {
    // SAFETY: mlx_string is created, filled by mlx_version and freed here; the C string it
    // points to is copied before the free.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let status = mlx_sys::mlx_version(&mut s);
        let text = if status == 0 {
            CStr::from_ptr(mlx_sys::mlx_string_data(s))
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".to_owned()
        };
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// The MLX version and source the build linked (from mlx-sys's build script).
pub const BUILD_MLX_VERSION: &str = env!("MLX_RUNTIME_VERSION");
/// Where the build found libmlx: the wheel and its cache dir, or `MLX_DIR`.
pub const BUILD_MLX_SOURCE: &str = env!("MLX_RUNTIME_SOURCE");
/// The lib dir the binary's rpath points at.
pub const BUILD_MLX_LIB_DIR: &str = env!("MLX_RUNTIME_LIB_DIR");

/// Which MLX backend this binary was built for: the wheel decides it.
pub fn backend() -> &'static str {
    if cfg!(feature = "cuda") {
        "cuda"
    } else if cfg!(target_os = "macos") {
        "metal"
    } else {
        "cpu"
    }
}

/// Whether the backend's accelerator is usable right now (always true for cpu).
pub fn accelerator_available() -> bool {
    let mut available = false;
    // SAFETY: both calls only write the bool they are given.
    let status = unsafe {
        match backend() {
            "cuda" => mlx_sys::mlx_cuda_is_available(&mut available),
            "metal" => mlx_sys::mlx_metal_is_available(&mut available),
            _ => return true,
        }
    };
    status == 0 && available
}

/// The default device, as `cpu` or `gpu` (with its index when not 0).
pub fn default_device() -> String {
    let device = match Device::try_default() {
        Ok(device) => device,
        Err(_) => return "unknown".to_owned(),
    };
    let kind = match device.get_type() {
        Ok(DeviceType::Cpu) => "cpu",
        Ok(DeviceType::Gpu) => "gpu",
        Err(_) => "unknown",
    };
    match device.get_index() {
        Ok(0) | Err(_) => kind.to_owned(),
        Ok(i) => format!("{kind}:{i}"),
    }
}

/// The file libmlx was actually loaded from in this process, where the OS tells us.
pub fn loaded_library_path() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            let name = path.rsplit('/').next().unwrap_or_default();
            name == "libmlx.so" || name == "libmlx.dylib"
        })
        .map(PathBuf::from)
}

/// MLX's allocator counters, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryCounters {
    pub active: usize,
    pub peak: usize,
    pub cache: usize,
}

pub fn memory() -> Result<MemoryCounters, RuntimeError> {
    Ok(MemoryCounters {
        active: mlx_rs::memory::active_memory()?,
        peak: mlx_rs::memory::peak_memory()?,
        cache: mlx_rs::memory::cache_memory()?,
    })
}

pub fn reset_peak_memory() -> Result<(), RuntimeError> {
    Ok(mlx_rs::memory::reset_peak_memory()?)
}

/// Three ops whose exact results are known: [[1,2],[3,4]]² = [[7,10],[15,22]], +1, sum = 58.
pub fn self_check() -> Result<(), RuntimeError> {
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let squared = x.matmul(&x)?;
    let shifted = squared.add(Array::from_f32(1.0))?;
    let total = shifted.sum(None)?;
    let got: Vec<f32> = squared.as_slice::<f32>().to_vec();
    let sum = total
        .try_item_exact::<f32>()
        .map_err(|e| RuntimeError::SelfCheck(e.to_string()))?;
    if got != [7.0, 10.0, 15.0, 22.0] || sum != 58.0 {
        return Err(RuntimeError::SelfCheck(format!(
            "matmul gave {got:?} and sum {sum}, expected [7, 10, 15, 22] and 58"
        )));
    }
    Ok(())
}
