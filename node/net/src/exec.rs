//! Remote expert execution, the serving side: running an expert this node holds for a peer
//! ([`stormo_wire::Exec`] in, [`stormo_wire::ExecResult`] out), on a compute budget of its
//! own; and the error type of the requesting side ([`ExecError`], the call itself is
//! [`super::tier::PeerTier::exec`]).
//!
//! # What is run, and for whom
//! Only an expert the node holds verified (its inventory: its disk, its kept experts, its RAM
//! cache's verified records; never one it merely offers to fetch), of the model it serves,
//! for a peer its admission let connect (the TLS handshake refuses everyone else before any
//! request is read). The expert is computed with the engine's own kernels
//! ([`ExpertSchema::compute`]: [`stormo_engine::moe::expert_forward`] over the layer's view), the same
//! code a node runs for itself; the rows come back as exact f32.
//!
//! # The budget, and the share left to generation
//! - Compute runs on a rayon pool of its own of `--exec-threads N` threads (default 1; 0 turns
//!   remote execution off: every `Exec` is answered `forbidden`). The engine's pool (rayon's
//!   global pool, `--threads`) is never used for a peer: the kernels' parallel loops run on
//!   whichever pool they are called from, and an exec job is always called from this one.
//! - Calls admitted at once are bounded per peer (`--exec-per-peer`, default 8) and node-wide
//!   (`--exec-max`, default 16); a call beyond either is answered `busy` at once, before its
//!   rows are looked at again, and never queued. An admitted call holds its slots until its
//!   computation ends (also when its peer gave up), so the work queued on the pool is bounded
//!   by `--exec-max` calls of at most [`stormo_wire::MAX_EXEC_ROWS_LEN`] bytes of rows each.
//! - The share: generation runs on the engine's pool of C threads (one per core by default),
//!   remote execution on N more. With every exec thread busy, the kernel's fair scheduler
//!   gives each runnable thread an equal share of the cores, so the engine keeps at least
//!   C / (C + N) of the CPU time it would have alone: 2/3 on a 2-core machine with the default
//!   N = 1, 8/9 on 8 cores. That bound is the stated share; to keep more, lower N. (A lower
//!   scheduling priority for the exec threads would keep more still; it needs a per-thread
//!   `setpriority`, i.e. `unsafe` or a new dependency in this `forbid(unsafe_code)` crate, and
//!   is not done.)
//! - Reading the expert's record (RAM cache or disk) runs on tokio's blocking threads like
//!   the expert serving does, not on the exec pool.
//!
//! # Non-goals
//! The choice between fetching and executing, spot-checks of a peer's results and the
//! fallback after a failed call belong to the requesting node (the engine seam and its
//! policy), not here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use stormo_engine::moe::{ExpertData, ExpertSchema};
use stormo_manifests::ExpertId;
use stormo_wire::{ErrorCode, ErrorMessage, Exec, ExecResult, Message};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::serve::Holdings;

/// The compute budget a node gives its peers (`--exec-threads`, `--exec-per-peer`,
/// `--exec-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecConfig {
    /// Threads of the exec pool; 0: remote execution off (answered `forbidden`).
    pub threads: usize,
    /// Calls of one peer admitted at once; more are answered `busy`. At least 1.
    pub per_peer: u32,
    /// Calls of all peers admitted at once; more are answered `busy`. At least 1.
    pub total: usize,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            threads: 1,
            per_peer: 8,
            total: 16,
        }
    }
}

/// Counters of remote execution served.
#[derive(Debug, Default)]
pub struct ExecStats {
    /// Calls answered with rows.
    pub answered: AtomicU64,
    /// Positions computed for peers.
    pub positions: AtomicU64,
    /// Calls answered `busy`.
    pub busy: AtomicU64,
    /// Calls refused (not held, bad shape, off) or failed.
    pub refused: AtomicU64,
}

/// The serving side's executor: the pool, the node-wide slots and the counters. One per
/// server.
pub struct Executor {
    cfg: ExecConfig,
    pool: Option<rayon::ThreadPool>,
    slots: Arc<Semaphore>,
    /// Its counters.
    pub stats: Arc<ExecStats>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// Starts the exec pool of `cfg.threads` threads (none for 0).
    pub fn new(cfg: ExecConfig) -> anyhow::Result<Self> {
        // The kernels' instruction set is decided once, on first use, by a self-check that
        // runs on a rayon pool of its own. Decided here, on the calling thread: decided on
        // first use by an exec job, the job's thread waits for the self-check inside the
        // one-time initialisation, steals the next exec job meanwhile (rayon's waiting
        // threads run queued jobs), and that job waits for the same initialisation on the
        // same thread: a deadlock (seen as every call of a prefill timing out).
        let _ = stormo_engine::kernels::Isa::process();
        let pool = match cfg.threads {
            0 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("stormo-exec-{i}"))
                    .build()
                    .map_err(|e| anyhow::anyhow!("starting {n} exec threads: {e}"))?,
            ),
        };
        Ok(Self {
            cfg,
            pool,
            slots: Arc::new(Semaphore::new(cfg.total.max(1))),
            stats: Arc::default(),
        })
    }

    /// The per-peer slots of a new connection.
    pub fn peer_slots(&self) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(self.cfg.per_peer.max(1) as usize))
    }

    /// Answers `exec` from a peer whose slots are `peer_slots`: the message to send back
    /// (an `ExecResult`, or an `Error` naming what is wrong). Never panics on the peer's bytes.
    pub async fn answer(
        &self,
        holdings: &Holdings,
        peer_slots: &Arc<Semaphore>,
        exec: Exec,
    ) -> Message {
        let id = exec.request_id;
        match self.run(holdings, peer_slots, exec).await {
            Ok((rows, positions)) => {
                self.stats.answered.fetch_add(1, Ordering::Relaxed);
                self.stats.positions.fetch_add(positions, Ordering::Relaxed);
                Message::ExecResult(ExecResult::new(id, &rows))
            }
            Err((code, why)) => {
                let counter = if code == ErrorCode::BUSY {
                    &self.stats.busy
                } else {
                    &self.stats.refused
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Message::Error(ErrorMessage::new(Some(id), code, why))
            }
        }
    }

    async fn run(
        &self,
        holdings: &Holdings,
        peer_slots: &Arc<Semaphore>,
        exec: Exec,
    ) -> Result<(Vec<f32>, u64), (ErrorCode, String)> {
        let Some(pool) = &self.pool else {
            return Err((
                ErrorCode::FORBIDDEN,
                "this node runs no experts for peers (--exec-threads 0)".into(),
            ));
        };
        let id = exec.expert;
        let schema = check(holdings, &exec)?;
        // Slots before any work: beyond either limit the answer is `busy`, now.
        let peer = peer_slots.clone().try_acquire_owned().map_err(|_| {
            (
                ErrorCode::BUSY,
                format!(
                    "running {} calls of this peer, its limit",
                    self.cfg.per_peer
                ),
            )
        })?;
        let node = self.slots.clone().try_acquire_owned().map_err(|_| {
            (
                ErrorCode::BUSY,
                format!("running {} calls, the node's limit", self.cfg.total),
            )
        })?;
        let data = fetch(holdings, id).await?;
        let positions = u64::from(exec.positions);
        let xs = exec.rows_f32();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let permits: (OwnedSemaphorePermit, OwnedSemaphorePermit) = (peer, node);
        pool.spawn(move || {
            // The slots are held until the computation ends, whether or not the peer still
            // waits for it: the pool's queue stays within the limits.
            // Mapped bytes (`--mmap-experts`) are checked against their file after the
            // computation too: a file truncated meanwhile reads as zeros, not as a fault.
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let rows = schema.compute(&data, &xs);
                data.check_mapped().map(|()| rows)
            }));
            // Free before the answer leaves: a requester that sends its next call as soon as
            // this answer arrives finds the slots free.
            drop(permits);
            let _ = tx.send(out);
        });
        match rx.await {
            Ok(Ok(Ok(rows))) => Ok((rows, positions)),
            Ok(Ok(Err(e))) => {
                tracing::error!("expert {id} cannot be run for a peer: {e}");
                Err((
                    ErrorCode::INTERNAL,
                    format!("expert {id} cannot be read: its file changed under this node"),
                ))
            }
            Ok(Err(_)) => {
                tracing::error!("running expert {id} for a peer panicked");
                Err((ErrorCode::INTERNAL, format!("running expert {id} failed")))
            }
            Err(_) => Err((ErrorCode::INTERNAL, "the exec pool dropped the call".into())),
        }
    }
}

/// Checks that `exec` asks for an expert this node holds verified, of its model, in whole rows
/// of the layer's width; returns the layer's schema.
fn check(holdings: &Holdings, exec: &Exec) -> Result<ExpertSchema, (ErrorCode, String)> {
    let id = exec.expert;
    if exec.model != holdings.model_id() {
        return Err((
            ErrorCode::NOT_FOUND,
            format!("model {} is not served here", exec.model.short()),
        ));
    }
    let schema = holdings
        .schemas
        .get(id.layer as usize)
        .and_then(Option::as_ref);
    let in_model = holdings.manifest.expert(id).is_some();
    let (Some(schema), true) = (schema, in_model) else {
        return Err((
            ErrorCode::NOT_FOUND,
            format!("expert {id} is not an expert of this model"),
        ));
    };
    if !holdings.announce.borrow().held.contains(id) {
        return Err((
            ErrorCode::NOT_FOUND,
            format!("expert {id} is not held here"),
        ));
    }
    holdings.demand.record(id);
    stormo_wire::check_shape(exec, schema.hidden).map_err(|why| (ErrorCode::BAD_REQUEST, why))?;
    Ok(schema.clone())
}

/// Expert `id`'s record from the node's provider, on a blocking thread, checked against the
/// manifest the first time this node runs it (remembered in [`Holdings::verified`]): a copy
/// that does not match (a corrupt disk, a tampered file) is neither run nor served, so a
/// peer never gets a result computed from wrong weights from this node.
async fn fetch(holdings: &Holdings, id: ExpertId) -> Result<Arc<ExpertData>, (ErrorCode, String)> {
    let refused = || {
        (
            ErrorCode::INTERNAL,
            format!("expert {id}: this node's copy does not match the manifest"),
        )
    };

    let experts = holdings.experts.clone();
    let manifest = holdings.manifest.clone();
    let verified = holdings.verified.clone();
    let got = tokio::task::spawn_blocking(move || {
        let mut out = Vec::with_capacity(1);
        experts
            .fetch(id.layer as usize, &[id.expert as usize], &mut out)
            .map_err(|e| format!("{e}"))?;
        let data = out
            .pop()
            .ok_or_else(|| "the provider returned no expert".to_string())?;
        let known = verified.lock().expect("verified lock").get(&id).copied();
        let ok = match known {
            Some(ok) => ok,
            None => {
                let record: Vec<u8> = data.parts().flatten().copied().collect();
                let check = manifest.verify_record(id, &record);
                if let Err(e) = &check {
                    tracing::error!(
                        "expert {id}: this node's copy does not match the manifest ({e}); it \
                         is not run for peers nor served (`stormo manifest verify` lists the \
                         mismatches)"
                    );
                }
                verified
                    .lock()
                    .expect("verified lock")
                    .insert(id, check.is_ok());
                check.is_ok()
            }
        };
        Ok((data, ok))
    })
    .await
    .map_err(|e| format!("the expert reader failed: {e}"))
    .and_then(|r| r);
    match got {
        Ok((data, true)) => Ok(data),
        Ok((_, false)) => Err(refused()),
        Err(e) => {
            tracing::warn!("reading expert {id} to run it for a peer: {e}");
            Err((ErrorCode::INTERNAL, format!("reading expert {id} failed")))
        }
    }
}

/// Why a remote execution gave no rows (see [`super::tier::PeerTier::exec`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The peer is at a compute limit: ask later or elsewhere (not its fault).
    #[error("busy: {0}")]
    Busy(String),
    /// The peer refused or failed the call (not held, forbidden, bad request, internal).
    #[error("refused ({code}): {message}")]
    Refused {
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// No answer within the call's deadline.
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The connection could not be had or was lost during the call.
    #[error("connection lost: {0}")]
    Lost(String),
    /// The answer broke the protocol (another length, another request, an undecodable frame).
    #[error("malformed answer: {0}")]
    Malformed(String),
    /// The call cannot be made: rows not of the layer's width, a layer with no experts, a
    /// peer not in the set.
    #[error("{0}")]
    Invalid(String),
}

impl From<stormo_wire::ExecAnswerError> for ExecError {
    fn from(e: stormo_wire::ExecAnswerError) -> Self {
        match e {
            stormo_wire::ExecAnswerError::Busy(m) => Self::Busy(m),
            stormo_wire::ExecAnswerError::Refused { code, message } => {
                Self::Refused { code, message }
            }
            stormo_wire::ExecAnswerError::Malformed(m) => Self::Malformed(m),
            other => Self::Malformed(other.to_string()),
        }
    }
}
