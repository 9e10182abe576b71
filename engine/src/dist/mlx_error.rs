//! MLX's own message for a failed mlx-c call that mlx-rs does not wrap.
//!
//! mlx-c reports an error through one process-wide handler. Until mlx-rs installs its own
//! (on its first guarded op), mlx-c's default handler prints the message and exits the
//! process with status 255, so a failed `mlx_distributed_init` (an address MLX cannot
//! parse, a peer that refused every connect) ended a rank before it could say which
//! addresses it tried. [`captured`] installs a handler that keeps the message for the
//! call, then hands the handler back to mlx-rs.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

static MESSAGE: Mutex<Option<String>> = Mutex::new(None);

extern "C" fn keep(msg: *const c_char, _data: *mut c_void) {
    let text = if msg.is_null() {
        String::new()
    } else {
        // SAFETY: mlx-c hands a NUL-terminated string that lives for the call.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    *MESSAGE.lock().unwrap_or_else(|e| e.into_inner()) = Some(text);
}

extern "C" {
    /// mlx-rs 0.33.0's handler (exported unmangled): it stashes the message for the
    /// calling thread's next mlx-rs result.
    fn default_mlx_error_handler(msg: *const c_char, data: *mut c_void);
}

/// Runs `f` (mlx-c calls) with MLX's errors kept instead of ending the process: `f`'s
/// result and the last message MLX reported during it, if any.
pub(super) fn captured<T>(f: impl FnOnce() -> T) -> (T, Option<String>) {
    *MESSAGE.lock().unwrap_or_else(|e| e.into_inner()) = None;
    // SAFETY: both handlers are plain functions that outlive the process; no data pointer.
    unsafe { mlx_sys::mlx_set_error_handler(Some(keep), std::ptr::null_mut(), None) };
    let out = f();
    // SAFETY: as above; mlx-rs registers this same handler (again, harmlessly) on its
    // first guarded op, and every mlx-rs op after this one reads its errors through it.
    unsafe {
        mlx_sys::mlx_set_error_handler(Some(default_mlx_error_handler), std::ptr::null_mut(), None)
    };
    let message = MESSAGE.lock().unwrap_or_else(|e| e.into_inner()).take();
    (out, message)
}
