//! The driver of one expert load: it runs the load's state machine ([`Load`]) and turns
//! its actions into QUIC calls: dials ([`link`]), tries (a task each: [`Inner::attempt`]),
//! cancels, a race against the local disk. Every decision (which holder, when to hedge, the
//! rounds, the stripes, a straggler moved, a silent connection) is the machine's; this module
//! only moves bytes and buffers and reports what happened, and turns the machine's typed error
//! into words at the tier's edge ([`FetchFailure::describe`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use stormo_engine::huge::{HugeBuf, HugePart};
use stormo_engine::moe::ExpertData;
use stormo_engine::tiers::{ExpertId, Priority};
use stormo_wire::{ByteRange, Fetch, FetchError};
use tokio::sync::{mpsc, oneshot, watch};

use super::link::{connection_lost, link};
use super::request::{run_request, ChunkCheck, Prefix, RecordBuf, StripeBuf, TryCtl, TryLimit};
use super::{Inner, Peer};
use crate::load::{
    Action, BufferFrom, Event, Load, LoadConfig, LoadError, LoadSpec, Loaded, Request, TryError,
    TryId,
};

/// Why a load from peers gave no expert, as the tier's edge names it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchFailure {
    /// Not an expert of the manifest.
    #[error("expert {0} is not in the manifest")]
    NotInManifest(ExpertId),
    /// The layer has no experts.
    #[error("layer {0} has no experts")]
    NoExperts(u16),
    /// The tier closed meanwhile.
    #[error("the network tier is closed")]
    Closed,
    /// The record's buffer could not be made (allocated, split, joined, copied).
    #[error("{0}")]
    Buffer(String),
    /// Every source failed.
    #[error(transparent)]
    Load(#[from] LoadError),
}

impl FetchFailure {
    /// The failure in words, naming each peer by its address.
    pub(crate) fn describe(&self, inner: &Inner) -> String {
        match self {
            Self::Load(e) => {
                let peers = inner.peers();
                let name = |i: usize| {
                    peers
                        .get(i)
                        .map_or_else(|| format!("peer #{i}"), |p| p.addr.to_string())
                };
                let text = e.named(&name).to_string();
                text
            }
            e => e.to_string(),
        }
    }
}

/// What a try's task or a dial reports to its load: an event, with the buffer a try hands
/// back when it ends.
struct Report {
    span: usize,
    event: Event,
    prefix: Option<Prefix>,
}

/// A try running on a task of its own.
struct Running {
    task: tokio::task::JoinHandle<()>,
    /// Set to make it give up, handing back what verified.
    cancel: watch::Sender<bool>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What woke a load's driver.
enum Woke {
    Report(Report),
    Local(Result<stormo_engine::Result<Arc<ExpertData>>, oneshot::error::RecvError>),
    Timer,
}

/// One load being driven.
struct Driver {
    inner: Arc<Inner>,
    load: Load,
    id: ExpertId,
    len: u64,
    priority: Priority,
    tx: mpsc::UnboundedSender<Report>,
    rx: mpsc::UnboundedReceiver<Report>,
    /// The kept buffer of each span (its longest verified prefix), while no try holds it.
    kept: Vec<Option<Prefix>>,
    /// The record is striped: its spans are parts of one buffer.
    striped: bool,
    /// A copy of a whole record's prefix for a racing try.
    spare: Option<Prefix>,
    tries: HashMap<TryId, Running>,
    local: Option<oneshot::Receiver<stormo_engine::Result<Arc<ExpertData>>>>,
    local_data: Option<Arc<ExpertData>>,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Ended early (the tier closing, a buffer that could not be made, the task dropped):
        // its tries are no longer in flight.
        if !self.load.is_done() {
            let peers = self.inner.peers();
            // Never a panic here, not even while unwinding from one that poisoned a lock.
            let mut views: Vec<_> = peers
                .iter()
                .map(|p| {
                    p.state
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                })
                .collect();
            self.load.abandon(&mut views);
        }
    }
}

impl Inner {
    /// Loads `key` from the peers: the record, verified, on huge pages (as the disk tier
    /// reads experts: where an expert came from decides nothing, not even how fast the
    /// kernels stream it), or the local disk's expert when it won a race. Counts the load's
    /// races, stripes and failed tries that another try followed ([`Tier::retried_failures`]).
    ///
    /// [`Tier::retried_failures`]: stormo_engine::tiers::Tier::retried_failures
    pub(crate) async fn fetch(
        self: &Arc<Self>,
        key: ExpertId,
        priority: Priority,
    ) -> Result<Arc<ExpertData>, FetchFailure> {
        let id = key;
        let len = self
            .manifest
            .expert(id)
            .ok_or(FetchFailure::NotInManifest(id))?
            .len;
        let schema = self
            .schemas
            .get(key.layer as usize)
            .and_then(Option::as_ref)
            .ok_or(FetchFailure::NoExperts(key.layer))?;
        let spec = LoadSpec {
            id,
            len,
            chunk: u64::from(self.manifest.chunk_size),
            demand: priority == Priority::Demand,
            local: self.local.get().is_some_and(|l| l.holds(id)),
        };
        let c = &self.cfg;
        let cfg = LoadConfig {
            request_timeout: c.request_timeout,
            hedge_min: c.hedge_min,
            hedge_max: c.hedge_max,
            stripe_min: c.stripe_min,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let mut d = Driver {
            inner: self.clone(),
            load: Load::new(spec, cfg),
            id,
            len,
            priority,
            tx,
            rx,
            kept: vec![None],
            striped: false,
            spare: None,
            tries: HashMap::new(),
            local: None,
            local_data: None,
        };
        let r = d.run().await;
        let stats = d.load.stats();
        self.count(|h| {
            h.hedges += stats.hedges;
            h.hedge_wins += stats.hedge_wins;
            h.local_wins += stats.local_wins;
        });
        if !matches!(r, Err(FetchFailure::Closed)) {
            self.retried
                .fetch_add(stats.retried(r.is_ok()), Ordering::Relaxed);
        }
        let record = match r? {
            Loaded::Local => {
                return d
                    .local_data
                    .take()
                    .ok_or_else(|| FetchFailure::Buffer("the local disk's expert went".into()))
            }
            Loaded::Peers => d.record()?,
        };
        if stats.striped {
            // Counted once loaded, as the loads it is a share of are.
            self.striped.fetch_add(1, Ordering::Relaxed);
        }
        let buf = Arc::new(record);
        if let Some(dir) = self.store.get() {
            let (dir, buf) = (dir.clone(), buf.clone());
            tokio::task::spawn_blocking(move || dir.store(id, &buf));
        }
        Ok(Arc::new(ExpertData::from_buffer(buf, schema)))
    }

    /// Starts loading `key` from the local tier, if there is one and it holds the key.
    pub(crate) fn local_load(
        &self,
        key: ExpertId,
    ) -> Option<oneshot::Receiver<stormo_engine::Result<Arc<ExpertData>>>> {
        let local = self.local.get()?;
        if !local.holds(key) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let tx = Mutex::new(Some(tx));
        local.load(
            &[key],
            Priority::Demand,
            Arc::new(
                move |_: ExpertId, r: stormo_engine::Result<Arc<ExpertData>>| {
                    if let Some(tx) = tx.lock().expect("oneshot lock").take() {
                        let _ = tx.send(r);
                    }
                },
            ),
        );
        Some(rx)
    }

    /// One try at `peer` within `limit`, resuming after `prefix` (see [`Self::attempt`]): the
    /// span verified whole, or why not, with the prefix it leaves (its buffer, if kept). A
    /// span that completes at the wrong length fails as [`TryError::Short`], keeping nothing.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn run_try(
        &self,
        peer: &Arc<Peer>,
        id: ExpertId,
        len: u64,
        mut prefix: Prefix,
        priority: Priority,
        limit: TryLimit,
        ctl: Option<&mut TryCtl<'_>>,
    ) -> (Result<(), TryError>, Prefix) {
        let r = self
            .attempt(peer, id, len, &mut prefix, priority, limit, ctl)
            .await;
        if r.is_ok() {
            // Every chunk of the span passed `ChunkCheck` as it arrived (this attempt's and the
            // verified prefix of earlier ones), and the chunk hashes are part of the same
            // manifest as the record's hash (one canonical encoding, named by the model id or
            // signed): the span is verified without hashing it again. Its length is the one
            // thing left to check.
            let span = prefix.end - prefix.start;
            let have = prefix.buffer.as_mut().map_or(0, |b| b.bytes_mut().len()) as u64;
            if have != span {
                prefix.keep(None, 0);
                return (Err(TryError::Short { have, span, len }), prefix);
            }
        }
        (r, prefix)
    }

    /// One attempt at `peer`: fetches the bytes of `prefix`'s span after its verified prefix
    /// (from an earlier attempt) into its buffer (a whole record's is allocated here on the
    /// first try) and leaves the span verified in `prefix`, or extends `prefix` with what
    /// verified. A request that fails because its link was replaced (the peer restarted and
    /// a probe's new connection took the silent one's place: [`Link::replaced`]) is not the
    /// peer's failure: it is sent again on the new link, resuming after what verified, at
    /// most [`MAX_REPLACED`] times.
    ///
    /// [`Link::replaced`]: super::link::Link::replaced
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn attempt(
        &self,
        peer: &Arc<Peer>,
        id: ExpertId,
        len: u64,
        prefix: &mut Prefix,
        priority: Priority,
        limit: TryLimit,
        mut ctl: Option<&mut TryCtl<'_>>,
    ) -> Result<(), TryError> {
        let mut again = 0;
        loop {
            let r = self
                .attempt_once(peer, id, len, prefix, priority, limit, ctl.as_deref_mut())
                .await;
            match r {
                Err(Attempt::Replaced(e)) if again < MAX_REPLACED => {
                    again += 1;
                    tracing::debug!(
                        "peer {}: expert {id}'s request failed on a replaced connection ({e}); \
                         sending it again on the new one",
                        peer.addr
                    );
                }
                Err(Attempt::Replaced(e)) => return Err(TryError::Lost(Box::new(e))),
                Err(Attempt::Failed(e)) => return Err(e),
                Ok(()) => return Ok(()),
            }
        }
    }

    /// One request of [`Self::attempt`], on the peer's link as it is.
    #[allow(clippy::too_many_arguments)]
    async fn attempt_once(
        &self,
        peer: &Arc<Peer>,
        id: ExpertId,
        len: u64,
        prefix: &mut Prefix,
        priority: Priority,
        limit: TryLimit,
        ctl: Option<&mut TryCtl<'_>>,
    ) -> Result<(), Attempt> {
        // `limit` bounds the request from when it is sent. Connecting has its own bound (the
        // connect timeout), and waiting for one of the link's request slots is not counted:
        // that queue is this node's own loads, not the peer's doing, and every request holding
        // a slot is bounded.
        let l = link(self, peer).await.map_err(TryError::from)?;
        let _permit = match l.slots.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) if l.was_replaced() => {
                return Err(Attempt::Replaced(TryError::Other("link replaced".into())))
            }
            Err(_) => return Err(TryError::Other("link closed".into()).into()),
        };
        let wire_priority = match priority {
            Priority::Demand => stormo_wire::Priority::Now,
            Priority::Prefetch => stormo_wire::Priority::Prefetch,
        };
        let mut fetch = Fetch::expert(self.model, id, len)
            .priority(wire_priority)
            .timeout(limit.timeout)
            .verifier(Box::new(ChunkCheck {
                manifest: self.manifest.clone(),
                id,
                len,
            }));
        if let Some(until) = limit.extend_until {
            fetch = fetch.extend_on_progress(until.saturating_duration_since(Instant::now()));
        }
        // On huge pages, as the disk tier reads experts: where an expert came from decides
        // nothing, not even how fast the kernels stream it.
        let whole = prefix.start == 0 && prefix.end == len;
        let buffer = match prefix.buffer.take() {
            Some(b) => b,
            None if whole => {
                prefix.verified = 0;
                let b =
                    HugeBuf::recycled(len as usize).map_err(|e| TryError::Other(e.to_string()))?;
                Box::new(RecordBuf(b))
            }
            None => {
                return Err(TryError::Other(format!(
                    "the buffer of bytes {}..{} was lost",
                    prefix.start, prefix.end
                ))
                .into())
            }
        };
        fetch = fetch.into_buffer(buffer);
        let have = prefix.verified.max(prefix.start);
        if have > 0 || prefix.end != len {
            fetch = fetch.range(ByteRange {
                offset: have,
                len: prefix.end - have,
            });
        }
        let stream_priority = match priority {
            Priority::Demand => 1,
            Priority::Prefetch => 0,
        };
        let idle = self.cfg.idle_timeout;
        let mut lost = false;
        let r = run_request(
            &l.conn,
            &l.reqs,
            fetch,
            Some(stream_priority),
            idle,
            Some(&l.live),
            prefix,
            ctl,
        )
        .await;
        if r.is_err() && prefix.buffer.is_none() {
            // The buffer went with a request that never started: begin again from scratch.
            prefix.verified = prefix.start;
        }
        let r = match r {
            Ok(c) => {
                prefix.buffer = Some(
                    c.buffer
                        .expect("a request into a buffer completes with the buffer"),
                );
                prefix.verified = prefix.end;
                return Ok(());
            }
            Err(e) if l.was_replaced() && !matches!(e, TryError::Moved) => {
                return Err(Attempt::Replaced(e))
            }
            Err(TryError::Fetch { error: e, heard }) => {
                let stalled = matches!(e, FetchError::Stalled { .. });
                if !heard && (stalled || l.live.silent(&l.conn, Instant::now())) {
                    // Silent on the whole connection for the silence deadline, or nothing at
                    // all received for `SILENT_CONNECTION`: presumed gone (killed, stopped,
                    // restarted). Closing the link now makes the next try reconnect instead
                    // of waiting out QUIC's own idle timeout on it.
                    l.conn.close(0u32.into(), b"silent");
                    lost = true;
                }
                TryError::Fetch { error: e, heard }
            }
            Err(e) => e,
        };
        if !(lost || connection_lost(&l.conn)) {
            return Err(r.into());
        }
        if peer.state().lose(Instant::now()) {
            tracing::info!(
                "peer {}: connection lost on expert {id} ({r}); it will be redialled",
                peer.addr
            );
        }
        Err(TryError::Lost(Box::new(r)).into())
    }
}

/// The most times one try's request is sent again because its link was replaced
/// ([`Inner::attempt`]).
const MAX_REPLACED: u32 = 2;

/// How one request of a try ended, if not well.
enum Attempt {
    /// The peer's link was replaced under it (the peer restarted): worth sending again on
    /// the new link.
    Replaced(TryError),
    /// Failed otherwise.
    Failed(TryError),
}

impl From<TryError> for Attempt {
    fn from(e: TryError) -> Self {
        Self::Failed(e)
    }
}

impl Driver {
    /// Runs the load to its end.
    async fn run(&mut self) -> Result<Loaded, FetchFailure> {
        loop {
            if self.inner.closing.load(Ordering::SeqCst) {
                return Err(FetchFailure::Closed);
            }
            let actions = {
                let peers = self.inner.peers();
                let mut views: Vec<_> = peers.iter().map(|p| p.state()).collect();
                let now = Instant::now();
                let mut out = Vec::new();
                while let Some(a) = self.load.poll_action(&mut views, now) {
                    out.push(a);
                }
                out
            };
            for a in actions {
                if let Action::Done(r) = a {
                    return r.map_err(FetchFailure::from);
                }
                self.perform(a)?;
            }
            let wake = self.load.poll_timeout();
            let (rx, local) = (&mut self.rx, &mut self.local);
            let woke = tokio::select! {
                r = rx.recv() => Woke::Report(r.expect("the driver holds a sender")),
                l = async { local.as_mut().expect("a local load").await }, if local.is_some() => {
                    Woke::Local(l)
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now).into()),
                    if wake.is_some() => Woke::Timer,
            };
            match woke {
                Woke::Report(r) => {
                    self.take(r);
                    while let Ok(r) = self.rx.try_recv() {
                        self.take(r);
                    }
                }
                Woke::Local(l) => {
                    self.local = None;
                    let r = match l {
                        Ok(Ok(d)) => {
                            self.local_data = Some(d);
                            Ok(())
                        }
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("dropped the load".into()),
                    };
                    self.load.handle(Event::LocalEnded(r), Instant::now());
                }
                Woke::Timer => {}
            }
        }
    }

    /// Passes a report on to the load, keeping the buffer an ending try hands back. Reports
    /// of tries the load no longer waits on are dropped.
    fn take(&mut self, r: Report) {
        match &r.event {
            Event::Progress { try_id, .. } if !self.tries.contains_key(try_id) => return,
            Event::Ended { try_id, .. } => {
                if self.tries.remove(try_id).is_none() {
                    return;
                }
                // The longer of what two racing tries hand back, as the load counts on.
                if let Some(p) = r.prefix.filter(|p| p.buffer.is_some()) {
                    let slot = &mut self.kept[r.span];
                    if slot.as_ref().is_none_or(|k| p.verified > k.verified) {
                        *slot = Some(p);
                    }
                }
            }
            _ => {}
        }
        self.load.handle(r.event, Instant::now());
    }

    fn perform(&mut self, a: Action) -> Result<(), FetchFailure> {
        match a {
            Action::Stripe(spans) => {
                let buf = HugeBuf::recycled(self.len as usize)
                    .map_err(|e| FetchFailure::Buffer(e.to_string()))?;
                let cuts: Vec<usize> = spans.iter().skip(1).map(|s| s.start as usize).collect();
                let parts = buf
                    .split(&cuts)
                    .map_err(|(_, e)| FetchFailure::Buffer(e.to_string()))?;
                self.kept = parts
                    .into_iter()
                    .zip(&spans)
                    .map(|(part, s)| {
                        Some(Prefix {
                            buffer: Some(Box::new(StripeBuf {
                                part,
                                offset: s.start,
                            })),
                            start: s.start,
                            end: s.end,
                            verified: s.start,
                        })
                    })
                    .collect();
                self.striped = true;
                tracing::debug!("expert {}: striped in {} spans", self.id, spans.len());
            }
            Action::Dial { peer } => {
                let (inner, tx) = (self.inner.clone(), self.tx.clone());
                let Some(p) = inner.peers().get(peer).cloned() else {
                    return Ok(());
                };
                tokio::spawn(async move {
                    let result = link(&inner, &p).await.map(|_| ());
                    let event = Event::Dialed { peer, result };
                    let _ = tx.send(Report {
                        span: 0,
                        event,
                        prefix: None,
                    });
                });
            }
            Action::Send(s) => self.send(s)?,
            Action::Cancel { try_id, keep } => {
                if keep {
                    if let Some(t) = self.tries.get(&try_id) {
                        let _ = t.cancel.send(true);
                    }
                } else {
                    self.tries.remove(&try_id);
                }
            }
            Action::LoadLocal => {
                self.local = self.inner.local_load(self.id);
                if self.local.is_none() {
                    let r = Err("does not hold it".into());
                    self.load.handle(Event::LocalEnded(r), Instant::now());
                }
            }
            Action::Warn { peer, message } => {
                if let Some(p) = self.inner.peers().get(peer) {
                    tracing::warn!("peer {} {message}", p.addr);
                }
            }
            Action::Done(_) => unreachable!("the run loop takes the end"),
        }
        Ok(())
    }

    /// Starts a try on a task of its own, with the buffer the load says.
    fn send(&mut self, s: Request) -> Result<(), FetchFailure> {
        let len = self.len;
        let empty = || Prefix {
            buffer: None,
            start: s.range.start,
            end: s.range.end,
            verified: s.range.start,
        };
        let mut prefix = match s.buffer {
            BufferFrom::Kept => self.kept[s.span].take().unwrap_or_else(empty),
            BufferFrom::Spare => self.spare.take().unwrap_or_else(|| Prefix::whole(len)),
            BufferFrom::Fresh => Prefix::whole(len),
        };
        if s.buffer == BufferFrom::Kept {
            self.spare = match s.keep_spare {
                true => Some(prefix.copy(len).map_err(FetchFailure::Buffer)?),
                false => None,
            };
        }
        let Some(peer) = self.inner.peers().get(s.peer).cloned() else {
            return Ok(());
        };
        let (inner, tx, id, priority) =
            (self.inner.clone(), self.tx.clone(), self.id, self.priority);
        let (cancel, cancel_rx) = watch::channel(false);
        let (try_id, span) = (s.try_id, s.span);
        let limit = TryLimit {
            timeout: s.timeout,
            extend_until: s.extend_until,
        };
        let report_progress = s.progress;
        let task = tokio::spawn(async move {
            let progress_tx = tx.clone();
            let progress = move |verified_end: u64| {
                let _ = progress_tx.send(Report {
                    span,
                    event: Event::Progress {
                        try_id,
                        verified_end,
                    },
                    prefix: None,
                });
            };
            let mut ctl = TryCtl {
                cancel: cancel_rx,
                progress: report_progress.then_some(&progress as &(dyn Fn(u64) + Send + Sync)),
            };
            let (result, prefix) = inner
                .run_try(&peer, id, len, prefix, priority, limit, Some(&mut ctl))
                .await;
            let event = Event::Ended {
                try_id,
                result,
                verified_end: prefix.verified,
                kept: prefix.buffer.is_some(),
            };
            let _ = tx.send(Report {
                span,
                event,
                prefix: Some(prefix),
            });
        });
        self.tries.insert(try_id, Running { task, cancel });
        Ok(())
    }

    /// The record, once every span verified: the whole record's buffer, or the stripes'
    /// parts joined without a copy.
    fn record(&mut self) -> Result<HugeBuf, FetchFailure> {
        let kept: Option<Vec<Prefix>> = std::mem::take(&mut self.kept).into_iter().collect();
        let kept = kept.ok_or_else(|| FetchFailure::Buffer("a span's buffer went".into()))?;
        if !self.striped {
            let whole = kept.into_iter().next();
            return whole
                .map(Prefix::into_record)
                .ok_or_else(|| FetchFailure::Buffer("the record's buffer went".into()));
        }
        let parts: Vec<HugePart> = kept.into_iter().map(Prefix::into_part).collect();
        HugePart::join(parts).map_err(|(_, e)| FetchFailure::Buffer(e.to_string()))
    }
}
