//! Distributed inference on MLX's own distributed layer (ring over TCP, MPI, NCCL), started
//! by `mlx.launch` as mlx-lm's ranks are: `MLX_RANK` and `MLX_HOSTFILE` in each rank's
//! environment. One group per process, made once on the model thread before the model
//! loads; the collectives below are the mlx-c calls mlx-rs does not wrap.
//!
//! A ring that loses a peer fails the next eval once and then hangs any later collective,
//! and a peer that never connects leaves `accept()` waiting forever: so a rank exits on the
//! first failed collective ([`fatal`]), and two watchdogs bound the waits (connect, and a
//! step that makes no progress).

mod fingerprint;
mod mlx_error;
mod peers;
mod watchdog;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

pub use fingerprint::{check_fingerprints, Fingerprint};
pub use peers::{done, on_lost};
pub use watchdog::{arm, bound, tick};

type R<T> = Result<T, Exception>;

/// Exit statuses of a rank that gives up, so a launcher (or a test) tells the causes apart.
pub mod exit {
    /// Ranks disagree on model, engine or mode (fingerprints differ).
    pub const MISMATCH: i32 = 2;
    /// The group did not form in time (a peer is missing or unreachable).
    pub const CONNECT: i32 = 3;
    /// A collective failed (a peer died).
    pub const PEER_LOST: i32 = 4;
    /// A step made no progress in time (a peer stalled).
    pub const STALLED: i32 = 5;
}

/// How this process takes part, from the command line (`engine generate` / `engine serve`).
#[derive(clap::Args, Debug, Clone)]
pub struct DistArgs {
    /// Under mlx.launch: split the layers across the ranks (mlx-lm's `--pipeline`) instead
    /// of splitting every layer's heads and features (tensor parallel, the default).
    #[arg(long)]
    pub pipeline: bool,
    /// MLX's distributed backend (ring, mpi, nccl, jaccl; any = the first that works).
    #[arg(long, default_value = "any")]
    pub dist_backend: String,
    /// Seconds a rank waits for the group to form before it gives up, naming the addresses.
    #[arg(long, default_value_t = 60.0, value_parser = seconds)]
    pub dist_connect_timeout: f64,
    /// Seconds a step may wait on the other ranks before this rank gives up (a stalled peer).
    #[arg(long, default_value_t = 60.0, value_parser = seconds)]
    pub dist_timeout: f64,
}

/// The longest timeout a flag takes: a week (a bound, where `inf` would never fire).
const MAX_TIMEOUT_S: f64 = 7.0 * 24.0 * 3600.0;

/// A timeout flag's value: seconds, finite, positive, at most a week (the parser of every
/// distributed timeout flag, the harness's rank commands' too).
pub fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v > 0.0 && v <= MAX_TIMEOUT_S) {
        return Err(format!(
            "{s} s: a timeout is a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a week)"
        ));
    }
    Ok(v)
}

/// A timeout from seconds that a caller may have built without `seconds` (a struct literal):
/// clamped to 0.1 s … a week (NaN: a week), so neither `Duration` nor a deadline overflows.
fn timeout(secs: f64) -> Duration {
    let secs = if secs.is_nan() {
        MAX_TIMEOUT_S
    } else {
        secs.clamp(0.1, MAX_TIMEOUT_S)
    };
    Duration::from_secs_f64(secs)
}

impl Default for DistArgs {
    fn default() -> Self {
        DistArgs {
            pipeline: false,
            dist_backend: "any".into(),
            dist_connect_timeout: 60.0,
            dist_timeout: 60.0,
        }
    }
}

/// Tensor parallel (every layer split) or pipeline parallel (layers split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Tensor,
    Pipeline,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Tensor => "tensor",
            Mode::Pipeline => "pipeline",
        }
    }
}

/// The process's group: an mlx-c handle, immutable once made.
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    pub rank: usize,
    pub size: usize,
    pub mode: Mode,
    /// "listening on …; connecting to rank k at …" for error messages.
    pub addresses: String,
    /// The ring's addresses per rank, from `MLX_HOSTFILE` (empty for other backends): the
    /// peer watch finds the ring's sockets by them.
    ring_hosts: Vec<Vec<String>>,
}

// SAFETY: the handle is created once and never mutated; mlx-c only reads it, and every
// collective runs on the model thread.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

static GROUP: OnceLock<Group> = OnceLock::new();

/// The group, once [`init`] made one of more than one rank.
pub fn group() -> Option<&'static Group> {
    GROUP.get()
}

/// Whether this process is a rank of a group larger than one.
pub fn active() -> bool {
    GROUP.get().is_some()
}

/// Only rank 0 writes output (as mlx-lm's distributed entry points print on rank 0 only).
pub fn is_writer() -> bool {
    GROUP.get().is_none_or(|g| g.rank == 0)
}

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("{0}")]
    Env(String),
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Mismatch(String),
    #[error("{0}")]
    Unsupported(String),
}

/// Where a ring rank listens and whom it connects to, read from `MLX_HOSTFILE` (a JSON list
/// per rank of `ip:port` strings, as mlx.launch writes it).
fn ring_addresses(rank: usize) -> Result<(Vec<Vec<String>>, String), DistError> {
    let path = PathBuf::from(std::env::var("MLX_HOSTFILE").unwrap_or_default());
    let text = std::fs::read_to_string(&path).map_err(|e| {
        DistError::Env(format!(
            "MLX_HOSTFILE={}: {e} (mlx.launch writes it; set MLX_HOSTFILE to a JSON list of \
             [\"ip:port\", …] per rank)",
            path.display()
        ))
    })?;
    let hosts: Vec<Vec<String>> = serde_json::from_str(&text).map_err(|e| {
        DistError::Env(format!(
            "MLX_HOSTFILE={}: {e} (expected a JSON list of [\"ip:port\", …] per rank)",
            path.display()
        ))
    })?;
    let size = hosts.len();
    if rank >= size {
        return Err(DistError::Env(format!(
            "MLX_RANK={rank} but MLX_HOSTFILE={} lists {size} ranks",
            path.display()
        )));
    }
    let next = (rank + 1) % size;
    let addresses = format!(
        "rank {rank} listening on {}; connecting to rank {next} at {}",
        hosts[rank].join(", "),
        hosts[next].join(", ")
    );
    Ok((hosts, addresses))
}

/// Joins the group `mlx.launch` describes in the environment, once, before the model loads.
/// None when the process was not launched as a rank (or the group has one rank): nothing
/// changes then. A group that does not form within `--dist-connect-timeout`, or that MLX
/// fails to form (an address it cannot parse, a peer that refused every connect), ends the
/// process with [`exit::CONNECT`], naming the addresses and MLX's reason.
pub fn init(args: &DistArgs) -> Result<Option<&'static Group>, DistError> {
    if let Some(g) = GROUP.get() {
        return Ok(Some(g));
    }
    let Ok(rank) = std::env::var("MLX_RANK") else {
        return Ok(None);
    };
    let rank: usize = rank
        .trim()
        .parse()
        .map_err(|_| DistError::Env(format!("MLX_RANK=`{rank}` is not a rank number")))?;
    let ring = std::env::var("MLX_HOSTFILE").is_ok_and(|h| !h.is_empty());
    let (ring_hosts, addresses) = if ring {
        let (hosts, addresses) = ring_addresses(rank)?;
        if hosts.len() == 1 {
            return Ok(None);
        }
        (hosts, addresses)
    } else {
        let addresses = format!("rank {rank} (backend {})", args.dist_backend);
        (Vec::new(), addresses)
    };
    let what = addresses.clone();
    let connect = watchdog::Deadline::start(timeout(args.dist_connect_timeout), move || {
        eprintln!(
            "error: the distributed group did not form ({what}): is every rank started, \
                 with the same hostfile, and is the port reachable? (--dist-connect-timeout)"
        );
        exit::CONNECT
    });
    let backend = std::ffi::CString::new(args.dist_backend.as_str())
        .map_err(|_| DistError::Env("--dist-backend has a NUL byte".into()))?;
    // SAFETY: `raw` is a fresh handle written by init; the backend string outlives the call.
    let ((status, raw), mlx) = mlx_error::captured(|| unsafe {
        let mut raw = mlx_sys::mlx_distributed_group_new();
        let bk = if args.dist_backend == "any" {
            std::ptr::null()
        } else {
            backend.as_ptr()
        };
        (mlx_sys::mlx_distributed_init(&mut raw, true, bk), raw)
    });
    drop(connect);
    if status != 0 {
        // As a group that does not form in time: the same status, the addresses tried.
        let mlx = mlx.map_or_else(String::new, |m| format!(": {}", strip_location(&m)));
        exit_with(
            exit::CONNECT,
            &format!(
                "could not join the distributed group ({addresses}, backend {}){mlx}: is \
                 every rank started, with the same hostfile, and is the port reachable?",
                args.dist_backend
            ),
        );
    }
    // SAFETY: `raw` is a live group handle.
    let (rank, size) = unsafe {
        (
            mlx_sys::mlx_distributed_group_rank(raw) as usize,
            mlx_sys::mlx_distributed_group_size(raw) as usize,
        )
    };
    if size < 2 {
        return Ok(None);
    }
    watchdog::set_timeout(timeout(args.dist_timeout));
    let _ = GROUP.set(Group {
        raw,
        rank,
        size,
        mode: if args.pipeline {
            Mode::Pipeline
        } else {
            Mode::Tensor
        },
        addresses,
        ring_hosts,
    });
    Ok(GROUP.get())
}

/// MLX's message without the " at <source file>:<line>" mlx-c appends.
fn strip_location(m: &str) -> &str {
    m.rsplit_once(" at /").map_or(m, |(head, _)| head)
}

/// Ends a rank whose collective failed: the ring cannot recover (a later collective hangs),
/// so the process exits with [`exit::PEER_LOST`] after saying why.
pub fn fatal(err: &dyn std::fmt::Display) -> ! {
    eprintln!("error: a distributed step failed ({err}); this rank exits (a peer was lost)");
    std::process::exit(exit::PEER_LOST)
}

/// Ends a rank that must not go on (its peers disagree, or a collective failed), with
/// `status` from [`exit`], after saying why.
pub fn exit_with(status: i32, why: &dyn std::fmt::Display) -> ! {
    eprintln!("error: {why}");
    std::process::exit(status)
}

/// Before the weights load: every rank checks that the others run the same engine, MLX,
/// model and mode; on a mismatch every rank exits with [`exit::MISMATCH`].
pub fn agree_on_model(
    dir: &std::path::Path,
    weight_files: &[std::path::PathBuf],
) -> Result<(), DistError> {
    let Some(g) = group() else { return Ok(()) };
    // A peer that joined the ring but never gets here (stopped, or another program) would
    // leave the exchange waiting forever.
    let _bound = watchdog::bound("the fingerprint exchange before the model loads");
    let mine = Fingerprint::new((dir, weight_files), g.mode, g.rank, g.size)?;
    match check_fingerprints(&mine) {
        Err(DistError::Mismatch(m)) => exit_with(exit::MISMATCH, &m),
        other => other,
    }
}

/// Runs one mlx-c collective that writes `res`.
fn call(
    op: &str,
    f: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_distributed_group, mlx_sys::mlx_stream) -> i32,
) -> R<Array> {
    let g = GROUP
        .get()
        .ok_or_else(|| Exception::custom(format!("{op}: no distributed group")))?;
    let stream = Stream::thread_local_or_default();
    // SAFETY: `res` is a fresh handle, taken over on success and freed on failure; the
    // group and stream handles are live for the call.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = f(&mut res, g.raw, stream.as_ptr());
        if status != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!("{op} failed")));
        }
        Ok(Array::from_ptr(res))
    }
}

/// `mx.distributed.all_sum(x)`: the elementwise sum over the ranks, in x's dtype.
pub fn all_sum(x: &Array) -> R<Array> {
    // SAFETY: see `call`.
    call("all_sum", |res, g, s| unsafe {
        mlx_sys::mlx_distributed_all_sum(res, x.as_ptr(), g, s)
    })
}

/// `mx.distributed.all_gather(x)`: the ranks' arrays concatenated on axis 0, rank order.
pub fn all_gather(x: &Array) -> R<Array> {
    // SAFETY: see `call`.
    call("all_gather", |res, g, s| unsafe {
        mlx_sys::mlx_distributed_all_gather(res, x.as_ptr(), g, s)
    })
}

/// `mx.distributed.send(x, dst)`: an array that, once evaluated, has sent x.
pub fn send(x: &Array, dst: usize) -> R<Array> {
    // SAFETY: see `call`.
    call("send", |res, g, s| unsafe {
        mlx_sys::mlx_distributed_send(res, x.as_ptr(), dst as i32, g, s)
    })
}

/// `mx.distributed.recv_like(x, src)`: an array of x's shape and dtype received from src.
pub fn recv_like(x: &Array, src: usize) -> R<Array> {
    // SAFETY: see `call`.
    call("recv_like", |res, g, s| unsafe {
        mlx_sys::mlx_distributed_recv_like(res, x.as_ptr(), src as i32, g, s)
    })
}

/// `mx.depends(x, dep)`: x, which now also waits for dep when it is evaluated.
pub fn depends(x: &Array, dep: &Array) -> R<Array> {
    // SAFETY: the vectors are fresh handles freed here; the result vector's one array is
    // copied out (mlx-c hands a new reference) before the vector is freed.
    unsafe {
        let inputs = mlx_sys::mlx_vector_array_new_value(x.as_ptr());
        let deps = mlx_sys::mlx_vector_array_new_value(dep.as_ptr());
        let mut res = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::mlx_depends(&mut res, inputs, deps);
        mlx_sys::mlx_vector_array_free(inputs);
        mlx_sys::mlx_vector_array_free(deps);
        if status != 0 {
            mlx_sys::mlx_vector_array_free(res);
            return Err(Exception::custom("depends failed"));
        }
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_vector_array_get(&mut out, res, 0);
        mlx_sys::mlx_vector_array_free(res);
        if status != 0 {
            mlx_sys::mlx_array_free(out);
            return Err(Exception::custom("depends: no result"));
        }
        Ok(Array::from_ptr(out))
    }
}

/// The ranks' orderly end: a barrier (an `all_sum` of one, evaluated), then [`done`]. Ranks
/// that ran without a collective for a while (a planted defect drops them, or each rank
/// works alone after its last step) would otherwise end apart, and the first to exit would
/// look like a lost peer to the others. A no-op outside a group.
pub fn finish() -> R<()> {
    if active() {
        all_sum(&Array::from_f32(1.0))?.eval()?;
    }
    done();
    Ok(())
}

/// Rank 0's bytes on every rank, in mlx_lm.server's framing: an `all_sum` of the length
/// (the others add 0), then of the bytes (the others add zeros). Every rank calls it; only
/// rank 0's `bytes` are read.
pub fn share_bytes(bytes: &[u8]) -> R<Vec<u8>> {
    let rank0 = is_writer();
    let len = if rank0 { bytes.len() as i32 } else { 0 };
    let len = all_sum(&Array::from_slice(&[len], &[1]))?;
    len.eval()?;
    let n = len.as_slice::<i32>()[0];
    if n < 0 {
        return Err(Exception::custom("share_bytes: a negative length"));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let data = if rank0 {
        Array::from_slice(bytes, &[n])
    } else {
        mlx_rs::ops::zeros::<u8>(&[n])?
    };
    let data = all_sum(&data)?;
    data.eval()?;
    Ok(data.as_slice::<u8>().to_vec())
}

#[cfg(test)]
mod tests {
    use super::seconds;

    #[test]
    fn timeouts_are_bounded_positive_seconds() {
        assert_eq!(seconds("2.5"), Ok(2.5));
        for bad in ["inf", "nan", "0", "-1", "1e9", "soon"] {
            let err = seconds(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }
}
