//! The adapters on the model thread: the loaded adapters by name (their arrays), which one
//! is on the model now, and the work the HTTP side sends to mount and unmount them (run
//! between two steps: `Worker::divert`). Every path that runs a request's MLX work — its
//! prefill, each decode or speculative step, the batch lane's tick, an embeddings forward —
//! first calls `use_adapter` with the request's adapter, so requests of different adapters
//! that take turns each get their own math. The prompt cache is keyed by the adapter on
//! the model (`namespace`): NAME@<fingerprint prefix>, "" for the base.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use tokio::sync::oneshot;

use super::Worker;
use crate::generate::{CompileDecode, SessionOptions};
use crate::plant::{self, Defect};
use crate::serve::adapters::Use;
use crate::serve::error::ApiError;
use crate::train::lora::{apply, OwnedAdapter};

/// Mount or unmount work for the model thread.
pub enum Op {
    /// Loads `dir` (checked against the model) under `name`; the adapter's fingerprint.
    Mount {
        name: String,
        dir: PathBuf,
        reply: oneshot::Sender<Result<String, ApiError>>,
    },
    /// Drops `name`, unless requests still hold it (`uses`): then a 409 saying how many.
    Unmount {
        name: String,
        uses: Arc<AtomicUsize>,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
}

/// The model thread's adapters.
#[derive(Default)]
pub struct Loaded {
    by_name: RefCell<BTreeMap<String, OwnedAdapter>>,
    /// The adapter on the model now (None: the base model).
    on: RefCell<Option<String>>,
    /// The session options of adapted requests: eager decoding, since the compiled decode
    /// step is traced with the arrays on the model at trace time.
    eager: RefCell<Option<SessionOptions>>,
}

impl Loaded {
    /// Loads the `--adapter` flags' adapters, each checked against `model`.
    pub fn load(
        model: &dyn crate::model::LanguageModel,
        flags: &[crate::serve::adapters::Flag],
    ) -> anyhow::Result<Self> {
        let loaded = Loaded::default();
        for f in flags {
            let a = OwnedAdapter::load(model, &f.dir)
                .map_err(|e| anyhow::anyhow!("--adapter {}={}: {e}", f.name, f.dir.display()))?;
            anyhow::ensure!(
                loaded
                    .by_name
                    .borrow_mut()
                    .insert(f.name.clone(), a)
                    .is_none(),
                "--adapter {}: the name is given twice; give each adapter its own name",
                f.name
            );
        }
        Ok(loaded)
    }
}

impl Worker {
    /// Puts `adapter` (None: no adapter) on the model, unless it is on already.
    pub(in crate::serve) fn use_adapter(&self, adapter: Option<&Use>) -> Result<(), ApiError> {
        self.use_named(adapter.map(Use::name))
    }

    /// `use_adapter` by name.
    pub(in crate::serve) fn use_named(&self, want: Option<&str>) -> Result<(), ApiError> {
        if self.adapters.on.borrow().as_deref() == want {
            return Ok(());
        }
        let by_name = self.adapters.by_name.borrow();
        let chosen = match want {
            None => None,
            Some(name) => Some(by_name.get(name).ok_or_else(|| {
                ApiError::invalid(format!("the adapter `{name}` is no longer mounted"))
                    .with_status(StatusCode::NOT_FOUND)
            })?),
        };
        apply(self.model.as_ref(), chosen);
        *self.adapters.on.borrow_mut() = want.map(str::to_owned);
        Ok(())
    }

    /// The prompt cache's namespace of the adapter on the model: NAME@<first 16 hex digits
    /// of its fingerprint>, "" for the base model.
    pub(in crate::serve) fn namespace(&self) -> String {
        if plant::is(Defect::AdapterCacheSharedWithBase) {
            return String::new();
        }
        let on = self.adapters.on.borrow();
        let by_name = self.adapters.by_name.borrow();
        match on.as_deref().and_then(|n| Some((n, by_name.get(n)?))) {
            None => String::new(),
            Some((name, a)) => format!("{name}@{}", &a.fingerprint[..16]),
        }
    }

    /// The session options of a request with `adapter`: the server's, or eager decoding.
    pub(in crate::serve) fn opts_for(&self, adapter: Option<&Use>) -> SessionOptions {
        match adapter {
            None => self.opts.clone(),
            Some(_) => self
                .adapters
                .eager
                .borrow_mut()
                .get_or_insert_with(|| SessionOptions {
                    compile: CompileDecode::Off,
                    ..self.opts.clone()
                })
                .clone(),
        }
    }

    /// Runs a mount or unmount, between two steps.
    pub(in crate::serve) fn adapter_op(&self, op: Op) {
        match op {
            Op::Mount { name, dir, reply } => {
                let _ = reply.send(self.mount(name, &dir));
            }
            Op::Unmount { name, uses, reply } => {
                let n = uses.load(Ordering::Acquire);
                let answer = if n > 0 {
                    Err(ApiError::invalid(format!(
                        "the adapter `{name}` is in use by {n} request{}: unmount it once \
                         they are done",
                        if n == 1 { "" } else { "s" }
                    ))
                    .with_status(StatusCode::CONFLICT))
                } else {
                    if self.adapters.on.borrow().as_deref() == Some(name.as_str()) {
                        apply(self.model.as_ref(), None);
                        *self.adapters.on.borrow_mut() = None;
                    }
                    self.adapters.by_name.borrow_mut().remove(&name);
                    Ok(())
                };
                let _ = reply.send(answer);
            }
        }
    }

    fn mount(&self, name: String, dir: &std::path::Path) -> Result<String, ApiError> {
        if self.dist.is_some() {
            return Err(ApiError::invalid(
                "adapters are not served by a distributed group (mlx.launch)",
            ));
        }
        if self.adapters.by_name.borrow().contains_key(&name) {
            return Err(
                ApiError::field("name", format!("an adapter named `{name}` is mounted"))
                    .with_status(StatusCode::CONFLICT),
            );
        }
        let adapter = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            OwnedAdapter::load(self.model.as_ref(), dir)
        }))
        .map_err(crate::serve::worker::panic_error)?
        .map_err(|e| ApiError::field("path", format!("cannot mount `{name}`: {e}")))?;
        let fingerprint = adapter.fingerprint.clone();
        self.adapters.by_name.borrow_mut().insert(name, adapter);
        Ok(fingerprint)
    }
}
