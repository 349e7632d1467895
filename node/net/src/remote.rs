//! Remote expert execution, the node's side of the engine's seam: an
//! [`ExpertExecutor`] that asks peers holding an expert to compute it.
//!
//! The engine calls [`RemoteExperts`] from its own threads. An expert this machine holds (its
//! disk, its kept experts) is always computed here; for the others `choose` asks the sans-IO
//! [`RemotePolicy`] (is it in the RAM cache? who holds it, over which link?). `submit` starts
//! the call as a task on the node's runtime and returns at once, and `collect` blocks the
//! engine thread on that task's answer (never an async thread: the engine runs outside the
//! runtime, as the network tier's loads do). A call carrying more positions than one wire
//! message allows is split into several, sent at once, and joined in order. Each call is
//! bounded by `--peer-timeout` or [`EXEC_TIMEOUT`], whichever is shorter. Busy answers,
//! failures and time-outs go back to the policy (which pauses that peer); a busy or failed
//! call is asked of another holder the policy still takes while the call's time lasts, and
//! otherwise (a time-out, no other holder) the engine gets [`ExecFailed`] and fetches and
//! computes that expert itself. A spot-check's verdict goes to the policy, which bans a peer
//! whose rows differed for the rest of the session.
//!
//! Deferred checks ([`RemoteExperts::with_deferred_checks`]): while a generation that can roll
//! back asks for them ([`ExpertExecutor::defer_checks`]), an answer drawn for a spot-check is
//! handed to the engine at once and checked on one of the runtime's blocking threads: the
//! expert fetched through the tiers (RAM cache, disk, peers, verified as every fetch is),
//! computed with the engine's kernels on the same rows ([`ExpertSchema::compute`], the code a serving
//! peer runs) and compared bit for bit. The verdict goes to the policy as an inline check's
//! does (a disagreeing peer is banned as soon as it is known), and to the step the answer
//! belongs to, which the generation reads with [`ExpertExecutor::settle`]. A check that cannot
//! be made (the expert can be had nowhere verified) fails its step as a disagreement does,
//! and the peer is not asked again this session. The check's thread
//! holds the expert only while it computes, so it never keeps a full RAM cache from the
//! engine's own loads.
//!
//! The calls themselves go through an [`ExecClient`] (the network tier's connections in the
//! node; a fake in this module's tests).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use stormo_engine::moe::{
    Demand, ExecFailed, Executed, ExpertExecutor, ExpertSchema, Settled, Ticket, Verdict,
};
use stormo_engine::tiers::{ExpertId, Tier, TieredExperts};

use stormo_manifests::PublicKey;

use super::exec::ExecError;
use super::remote_policy::{
    self, Choice, Holder, Link, RemoteConfig, RemotePolicy, RemoteStats, Want, UNMEASURED_RTT,
};
use super::tier::PeerTier;

mod deferred;

use deferred::{Book, Due, Next};

/// Why one call gave no rows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The peer is at its compute limit.
    #[error("busy: {0}")]
    Busy(String),
    /// No answer in time.
    #[error("timed out")]
    TimedOut,
    /// The peer refused, failed, broke the protocol, or the connection did.
    #[error("{0}")]
    Failed(String),
}

/// A call's future.
pub type CallFuture = Pin<Box<dyn Future<Output = Result<Vec<f32>, CallError>> + Send>>;

/// How the executor reaches peers.
pub trait ExecClient: Send + Sync + fmt::Debug + 'static {
    /// The peers that hold `id` now and could run it, with their links.
    fn holders(&self, id: ExpertId) -> Vec<Holder>;

    /// Asks `peer` to compute `id` on `rows` (`[n, H]`); resolves to `[n, H]` output rows.
    /// Called on the runtime.
    fn call(&self, peer: usize, id: ExpertId, rows: Vec<f32>) -> CallFuture;

    /// The most positions one call may carry.
    fn max_positions(&self) -> usize;

    /// `peer`'s name in logs.
    fn name(&self, peer: usize) -> String {
        format!("#{peer}")
    }
}

/// Which peers may compute experts for this node (`--exec-trust`). A remote result is
/// spot-checked, not proven (a peer that lies now and then gets each lie past the checks
/// with probability `1 - p`), so by default only peers the user lets compute are asked:
/// members of this node's swarm (their certificate signed by the swarm's key, checked in the
/// handshake) and keys named for it. Fetched experts are verified whoever sends them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecTrust {
    /// Swarm members, and these keys (the default: none).
    Members(Vec<PublicKey>),
    /// Every peer this node connects to (each one's results spot-checked).
    Any,
}

impl Default for ExecTrust {
    fn default() -> Self {
        Self::Members(Vec::new())
    }
}

impl ExecTrust {
    /// Whether the peer with `key` (`member`: it presented a membership of this node's
    /// swarm) may compute experts for this node.
    pub fn allows(&self, key: &PublicKey, member: bool) -> bool {
        match self {
            Self::Any => true,
            Self::Members(keys) => member || keys.contains(key),
        }
    }

    /// Whether a peer outside any swarm may compute (`any` or a key named).
    pub fn names_peers(&self) -> bool {
        *self != Self::default()
    }
}

/// The network tier as an [`ExecClient`]: its peers numbered in the order first seen here;
/// only the holders [`ExecTrust`] allows are offered.
#[derive(Debug)]
pub struct PeerExec {
    tier: Arc<PeerTier>,
    keys: Mutex<Vec<PublicKey>>,
    hidden: usize,
    deadline: Duration,
    trust: ExecTrust,
}

impl PeerExec {
    /// Calls through `tier` for a model of row width `hidden`, each bounded by `deadline`,
    /// to the peers `trust` allows.
    pub fn new(tier: Arc<PeerTier>, hidden: usize, deadline: Duration, trust: ExecTrust) -> Self {
        Self {
            tier,
            keys: Mutex::default(),
            hidden,
            deadline,
            trust,
        }
    }

    fn index(&self, key: PublicKey) -> usize {
        let mut keys = self.keys.lock().expect("peer keys lock");
        match keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                keys.push(key);
                keys.len() - 1
            }
        }
    }

    fn key(&self, peer: usize) -> Option<PublicKey> {
        self.keys.lock().expect("peer keys lock").get(peer).copied()
    }
}

impl ExecClient for PeerExec {
    fn holders(&self, id: ExpertId) -> Vec<Holder> {
        self.tier
            .exec_links(id)
            .into_iter()
            .filter(|l| self.trust.allows(&l.key, l.member))
            .map(|l| Holder {
                peer: self.index(l.key),
                link: Link {
                    rtt: l.rtt,
                    rate: l.rate,
                },
            })
            .collect()
    }

    fn call(&self, peer: usize, id: ExpertId, rows: Vec<f32>) -> CallFuture {
        let (tier, deadline, key) = (self.tier.clone(), self.deadline, self.key(peer));
        Box::pin(async move {
            let key = key.ok_or_else(|| CallError::Failed(format!("no peer #{peer}")))?;
            tier.exec(&key, id, &rows, deadline)
                .await
                .map_err(|e| match e {
                    ExecError::Busy(m) => CallError::Busy(m),
                    ExecError::Timeout(_) => CallError::TimedOut,
                    other => CallError::Failed(other.to_string()),
                })
        })
    }

    fn max_positions(&self) -> usize {
        stormo_wire::max_positions(self.hidden)
    }

    fn name(&self, peer: usize) -> String {
        self.key(peer)
            .map_or_else(|| format!("#{peer}"), |k| super::short_key(&k))
    }
}

/// The longest one call may take when `--peer-timeout` is longer.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(5);

/// A call in flight.
struct Pending {
    peer: usize,
    check: bool,
    /// Answers the deferred-check book had recorded when the call was sent
    /// ([`Book::collected`]).
    sent_after: u64,
    started: Instant,
    bytes: u64,
    /// The peer's round trip, and the calls sent to it together with this one
    /// ([`remote_policy::alone`]).
    rtt: Duration,
    together: u32,
    rx: tokio::sync::oneshot::Receiver<Answer>,
    /// What another holder is asked if this one fails: the expert, its rows, the choice's
    /// inputs, and the call's deadline (`None`: no call was made).
    retry: Option<Retry>,
    /// The same call at a second holder (`--verify-exec dual`).
    second: Option<Second>,
}

/// The second holder's call of a [`Pending`] one (`--verify-exec dual`).
struct Second {
    peer: usize,
    check: bool,
    started: Instant,
    rtt: Duration,
    rx: tokio::sync::oneshot::Receiver<Answer>,
}

/// A call's outcome and when it came: the call's time is measured to its arrival, not to when
/// the engine, busy with the block's other experts meanwhile, collects it.
type Answer = (Result<Vec<f32>, CallError>, Instant);

/// An expert of the block being planned that the choice gave a peer.
struct Chosen {
    peer: usize,
    /// The second holder asked (`--verify-exec dual`), and its link.
    second: Option<(usize, Link)>,
    /// What the choice weighed.
    want: Want,
    /// The peer's link as the choice saw it.
    link: Link,
    /// Calls of this block given the same peer (filled in when the block's choice ends).
    together: u32,
}

/// See [`Pending::retry`].
struct Retry {
    id: ExpertId,
    rows: Arc<Vec<f32>>,
    want: Want,
    deadline: Instant,
}

/// An answer kept for a check: the expert, its rows and what the peer answered.
#[derive(Debug)]
struct Kept {
    id: ExpertId,
    rows: Arc<Vec<f32>>,
    answer: Vec<f32>,
}

/// The deferred checks' [`Book`], shared with the threads that make them, and the signal of
/// a check's end.
#[derive(Debug)]
struct Deferred {
    book: Mutex<Book<Kept>>,
    ended: Condvar,
}

impl Deferred {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book<Kept>> {
        self.book.lock().expect("deferred checks lock")
    }
}

/// The engine's executor over a node's peers. See the module docs.
pub struct RemoteExperts {
    client: Arc<dyn ExecClient>,
    rt: tokio::runtime::Handle,
    policy: Arc<Mutex<RemotePolicy>>,
    cache: Option<Arc<TieredExperts>>,
    /// The tiers that hold experts on this machine (the disk, the kept experts): an expert
    /// one of them holds is never delegated.
    local: Vec<Arc<dyn Tier>>,
    /// Bytes of every expert, `[layer][expert]`.
    sizes: Vec<Vec<u64>>,
    hidden: usize,
    timeout: Duration,
    /// The peer chosen for each expert of the block being planned, and what was weighed,
    /// until it is submitted.
    chosen: Mutex<HashMap<(usize, usize), Chosen>>,
    next: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    /// The peer of each collected answer awaiting a spot-check's verdict.
    /// With a second holder whose answer differed from the first's (`--verify-exec dual`):
    /// the verdict on the first says which of the two was wrong.
    checking: Mutex<HashMap<u64, (usize, Option<usize>)>>,
    /// Each layer's expert schema, when checks may be deferred
    /// ([`with_deferred_checks`](Self::with_deferred_checks)).
    schemas: Option<Arc<Vec<Option<ExpertSchema>>>>,
    deferred: Arc<Deferred>,
}

impl fmt::Debug for RemoteExperts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteExperts")
            .field("client", &self.client)
            .field("config", &self.lock_policy().config())
            .finish_non_exhaustive()
    }
}

impl RemoteExperts {
    /// An executor calling peers through `client` on `rt`, for a model of row width `hidden`
    /// whose experts are `sizes[layer][expert]` bytes; `cache` (the RAM cache, when tiered)
    /// tells which experts are at hand, and an expert one of the `local` tiers (this
    /// machine's disk and kept experts) holds is always computed here. Each call may take
    /// `timeout` (at most [`EXEC_TIMEOUT`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Arc<dyn ExecClient>,
        rt: tokio::runtime::Handle,
        cfg: RemoteConfig,
        cache: Option<Arc<TieredExperts>>,
        local: Vec<Arc<dyn Tier>>,
        sizes: Vec<Vec<u64>>,
        hidden: usize,
        timeout: Duration,
    ) -> Self {
        let counts: Vec<usize> = sizes.iter().map(Vec::len).collect();
        let track = cfg.spot_check > 0.0;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self {
            client,
            rt,
            policy: Arc::new(Mutex::new(RemotePolicy::new(cfg, &counts, seed))),
            cache,
            local,
            sizes,
            hidden,
            timeout: timeout.min(EXEC_TIMEOUT),
            chosen: Mutex::default(),
            next: AtomicU64::new(0),
            pending: Mutex::default(),
            checking: Mutex::default(),
            schemas: None,
            deferred: Arc::new(Deferred {
                book: Mutex::new(Book::new(track)),
                ended: Condvar::new(),
            }),
        }
    }

    /// Lets a generation that can roll back defer its spot-checks (see the module docs):
    /// `schemas` are each layer's expert schema, for computing a checked expert here. Without
    /// a RAM cache to fetch through, checks stay inline.
    pub fn with_deferred_checks(mut self, schemas: Vec<Option<ExpertSchema>>) -> Self {
        self.schemas = Some(Arc::new(schemas));
        self
    }

    /// Checks `c` on a blocking thread of the runtime: its expert fetched through the tiers,
    /// computed on its rows and compared with the answer bit for bit. However it ends, the
    /// book hears of it ([`Book::ended`]; a generation waits on it).
    fn check_later(&self, due: Due<Kept>) {
        let (cache, schemas) = (self.cache.clone(), self.schemas.clone());
        let (policy, deferred, name) = (
            self.policy.clone(),
            self.deferred.clone(),
            self.client.name(due.peer),
        );
        self.rt.spawn_blocking(move || {
            let (peer, seq, own, step, c) = (due.peer, due.seq, due.own, due.step, due.answer);
            let computed = match (&cache, &schemas) {
                (Some(cache), Some(schemas)) => {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        compute(cache, schemas, c.id, &c.rows)
                    }))
                    .unwrap_or_else(|_| Err("computing it panicked".into()))
                }
                _ => Err("no RAM cache to fetch it through".into()),
            };
            let agreed = match computed {
                Ok(rows) => {
                    let agree = rows.len() == c.answer.len()
                        && rows
                            .iter()
                            .zip(&c.answer)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                    let verdict = if agree {
                        Verdict::Agreed
                    } else {
                        tracing::warn!(
                            "remote execution: peer {name} computed expert {} wrong (a deferred \
                             spot-check disagreed); it is not asked again this session, and the \
                             generation goes back to the first step that used its answers \
                             unchecked",
                            c.id
                        );
                        Verdict::Disagreed
                    };
                    policy
                        .lock()
                        .expect("remote policy lock")
                        .verdict(peer, verdict);
                    agree
                }
                Err(e) => {
                    // An answer drawn for a check that cannot be made is not used: a peer
                    // whose expert can be had nowhere verified (it serves corrupt bytes, say)
                    // would otherwise have its first answer used unchecked. Its step is made
                    // again without it; costing time, never a token.
                    tracing::warn!(
                        "remote execution: a deferred spot-check of expert {} (peer {name}) \
                         could not be made: {e}; its answer is not used (the step is made \
                         again) and the peer is not asked again this session",
                        c.id
                    );
                    policy
                        .lock()
                        .expect("remote policy lock")
                        .unverifiable(peer);
                    false
                }
            };
            deferred.lock().ended(peer, seq, own, step, agreed);
            deferred.ended.notify_all();
        });
    }

    fn lock_policy(&self) -> std::sync::MutexGuard<'_, RemotePolicy> {
        self.policy.lock().expect("remote policy lock")
    }

    /// The counters so far.
    pub fn stats(&self) -> RemoteStats {
        self.lock_policy().stats()
    }

    /// Tells the choice how long a fetched expert would stay cached: the RAM cache's `budget`
    /// in bytes beside the bytes of experts one decoded token routes over all layers
    /// ([`RemotePolicy::set_cache`]).
    pub fn set_cache(&self, budget: u64, per_block: u64) {
        self.lock_policy().set_cache(budget, per_block);
    }

    /// Starts computing `id` at `peer` on `rows`, split into calls of at most the wire's
    /// positions sent at once, bounded by `timeout`; the answer comes on the receiver.
    fn start(
        &self,
        peer: usize,
        id: ExpertId,
        rows: Arc<Vec<f32>>,
        timeout: Duration,
    ) -> tokio::sync::oneshot::Receiver<Answer> {
        let per_call = self.client.max_positions().max(1) * self.hidden.max(1);
        let calls: Vec<CallFuture> = rows
            .chunks(per_call)
            .map(|r| self.client.call(peer, id, r.to_vec()))
            .collect();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let want = rows.len();
        self.rt.spawn(async move {
            let all = async {
                let mut out = Vec::with_capacity(want);
                for r in futures_join_in_order(calls).await {
                    out.extend(r?);
                }
                if out.len() != want {
                    return Err(CallError::Failed(format!(
                        "{} output values for {want} inputs",
                        out.len()
                    )));
                }
                Ok(out)
            };
            let r = match tokio::time::timeout(timeout, all).await {
                Ok(r) => r,
                Err(_) => Err(CallError::TimedOut),
            };
            let _ = tx.send((r, Instant::now()));
        });
        rx
    }

    /// A ticket whose collect fails with `why`.
    fn failed_ticket(&self, why: CallError) -> Ticket {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = tx.send((Err(why), Instant::now()));
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().expect("pending lock").insert(
            t,
            Pending {
                peer: usize::MAX,
                check: false,
                sent_after: 0,
                started: Instant::now(),
                bytes: 0,
                rtt: UNMEASURED_RTT,
                together: 1,
                rx,
                retry: None,
                second: None,
            },
        );
        Ticket(t)
    }
}

impl RemoteExperts {
    /// `--verify-exec dual`: waits for both holders' answers to `p`'s call. Both answered:
    /// equal rows go on as the first holder's answer (`Err`, for [`collect`]'s single path,
    /// which records it); differing rows are handed to the engine to check (it computes the
    /// expert here and reports which was right, see [`report`]). One answered: that one's,
    /// for the single path (the other's failure recorded). Neither: the first's failure, for
    /// the single path (which may ask another holder).
    ///
    /// [`collect`]: ExpertExecutor::collect
    /// [`report`]: ExpertExecutor::report
    fn compare(
        &self,
        ticket: Ticket,
        p: &mut Pending,
        second: Second,
    ) -> Result<Result<Executed, ExecFailed>, Answer> {
        let first = receive(&mut p.rx);
        let mut second_rx = second.rx;
        let other = receive(&mut second_rx);
        let mut policy = self.lock_policy();
        let now = Instant::now();
        let answered = |policy: &mut RemotePolicy, peer, arrived: Instant, started, rtt, n| {
            let alone = remote_policy::alone(arrived.saturating_duration_since(started), rtt, n);
            policy.answered(peer, arrived, alone, p.bytes);
        };
        match (first, other) {
            ((Ok(a), t), (Ok(b), u)) => {
                answered(&mut policy, second.peer, u, second.started, second.rtt, 1);
                let same =
                    a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                policy.compared(same);
                if same {
                    return Err((Ok(a), t));
                }
                answered(&mut policy, p.peer, t, p.started, p.rtt, p.together);
                drop(policy);
                tracing::warn!(
                    "remote execution: peers {} and {} computed expert {} differently; \
                     computing it here to find which was wrong",
                    self.client.name(p.peer),
                    self.client.name(second.peer),
                    p.retry
                        .as_ref()
                        .map_or_else(String::new, |r| r.id.to_string())
                );
                self.checking
                    .lock()
                    .expect("checking lock")
                    .insert(ticket.0, (p.peer, Some(second.peer)));
                Ok(Ok(Executed {
                    rows: a,
                    check: true,
                }))
            }
            (first, (Ok(b), u)) => {
                if let Err(e) = &first.0 {
                    note_failure(&mut policy, p.peer, now, e);
                }
                p.peer = second.peer;
                p.check = second.check;
                p.started = second.started;
                p.rtt = second.rtt;
                p.together = 1;
                Err((Ok(b), u))
            }
            (first, (Err(e), _)) => {
                note_failure(&mut policy, second.peer, now, &e);
                Err(first)
            }
        }
    }
}

/// A call's answer from `rx` (a failure if its task ended without one).
fn receive(rx: &mut tokio::sync::oneshot::Receiver<Answer>) -> Answer {
    let (_tx, done) = tokio::sync::oneshot::channel();
    std::mem::replace(rx, done)
        .blocking_recv()
        .unwrap_or_else(|_| {
            (
                Err(CallError::Failed("the call's task ended".into())),
                Instant::now(),
            )
        })
}

/// A failed call of `peer` told to `policy`: a busy peer is paused briefly, a failed one longer.
fn note_failure(policy: &mut RemotePolicy, peer: usize, now: Instant, e: &CallError) {
    match e {
        CallError::Busy(_) => policy.busy(peer, now),
        _ => policy.failed(peer, now),
    }
}

impl ExpertExecutor for RemoteExperts {
    fn choose(&self, layer: usize, demand: &[Demand], delegate: &mut [bool]) {
        let now = Instant::now();
        let mut p = self.lock_policy();
        p.observe(layer, demand.iter().map(|d| d.expert));
        let mut chosen = self.chosen.lock().expect("chosen lock");
        // This block's (expert, peer) choices.
        let mut mine = Vec::new();
        for (d, x) in demand.iter().zip(delegate) {
            let (Ok(l), Ok(e)) = (u16::try_from(layer), u16::try_from(d.expert)) else {
                continue;
            };
            let id = ExpertId::new(l, e);
            if self.local.iter().any(|t| t.holds(id)) {
                continue;
            }
            let holders = self.client.holders(id);
            if holders.is_empty() {
                continue;
            }
            let want = Want {
                layer,
                expert: d.expert,
                positions: d.positions,
                expert_bytes: self
                    .sizes
                    .get(layer)
                    .and_then(|s| s.get(d.expert))
                    .copied()
                    .unwrap_or(0),
                cached: self.cache.as_ref().is_some_and(|c| c.is_resident(id)),
            };
            if let Choice::Execute { peer } = p.choose(now, &want, self.hidden, &holders) {
                p.begin(peer);
                let second = p.second(now, peer, &want, self.hidden, &holders);
                if let Some(s) = second {
                    p.begin(s);
                }
                chosen.insert(
                    (layer, d.expert),
                    Chosen {
                        peer,
                        second: second.map(|s| (s, link_of(&holders, s))),
                        want,
                        link: link_of(&holders, peer),
                        together: 1,
                    },
                );
                mine.push((d.expert, peer));
                *x = true;
            }
        }
        for &(e, peer) in &mine {
            let n = mine.iter().filter(|&&(_, q)| q == peer).count();
            if let Some(c) = chosen.get_mut(&(layer, e)) {
                c.together = u32::try_from(n).unwrap_or(u32::MAX);
            }
        }
    }

    fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket {
        let chosen = self
            .chosen
            .lock()
            .expect("chosen lock")
            .remove(&(layer, expert));
        let (
            Some(Chosen {
                peer,
                second,
                want,
                link,
                together,
            }),
            Ok(l),
            Ok(e),
        ) = (chosen, u16::try_from(layer), u16::try_from(expert))
        else {
            return self.failed_ticket(CallError::Failed(format!(
                "expert {expert} of layer {layer} was not chosen for a peer"
            )));
        };
        let h = self.hidden.max(1);
        if inputs.is_empty() || !inputs.len().is_multiple_of(h) {
            let mut policy = self.lock_policy();
            policy.cancel(peer);
            if let Some((s, _)) = second {
                policy.cancel(s);
            }
            drop(policy);
            return self.failed_ticket(CallError::Failed(format!(
                "{} inputs are not rows of {h}",
                inputs.len()
            )));
        }
        let check = self.lock_policy().check(peer);
        let id = ExpertId::new(l, e);
        let rows = Arc::new(inputs.to_vec());
        let started = Instant::now();
        let sent_after = self.deferred.lock().collected();
        let rx = self.start(peer, id, rows.clone(), self.timeout);
        let second = second.map(|(s, link)| Second {
            peer: s,
            check: self.lock_policy().check(s),
            started,
            rtt: link.rtt(),
            rx: self.start(s, id, rows.clone(), self.timeout),
        });
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().expect("pending lock").insert(
            t,
            Pending {
                peer,
                check,
                sent_after,
                started,
                bytes: 2 * 4 * inputs.len() as u64,
                rtt: link.rtt(),
                together,
                rx,
                retry: Some(Retry {
                    id,
                    rows,
                    want,
                    deadline: started + self.timeout,
                }),
                second,
            },
        );
        Ticket(t)
    }

    fn collect(&self, ticket: Ticket) -> Result<Executed, ExecFailed> {
        let Some(mut p) = self.pending.lock().expect("pending lock").remove(&ticket.0) else {
            return Err(ExecFailed::Failed(format!("no call {}", ticket.0)));
        };
        // Two holders asked: compared, or one answer left for the single path below.
        let mut ready = None;
        if let Some(second) = p.second.take() {
            match self.compare(ticket, &mut p, second) {
                Ok(done) => return done,
                Err(one) => ready = Some(one),
            }
        }
        loop {
            let (answer, arrived) = ready.take().unwrap_or_else(|| receive(&mut p.rx));
            let Some(retry) = &p.retry else {
                return Err(match answer {
                    Err(CallError::Failed(m)) => ExecFailed::Unavailable(m),
                    _ => ExecFailed::Unavailable("no peer".into()),
                });
            };
            let mut policy = self.lock_policy();
            let now = Instant::now();
            let failed = match answer {
                Ok(rows) => {
                    policy.answered(
                        p.peer,
                        arrived,
                        remote_policy::alone(
                            arrived.saturating_duration_since(p.started),
                            p.rtt,
                            p.together,
                        ),
                        p.bytes,
                    );
                    // Deferred checks (`on` only with a cache and schemas to make them): an
                    // answer drawn for a check is checked on another thread, counted as
                    // running in the current step until it ends; one not drawn is recorded as
                    // unconfirmed until a later check of its peer agrees (see `deferred`).
                    let keep = || Kept {
                        id: retry.id,
                        rows: retry.rows.clone(),
                        answer: rows.clone(),
                    };
                    let check = self
                        .deferred
                        .lock()
                        .answered(p.peer, p.check, keep, p.sent_after);
                    if let Some((seq, step)) = check {
                        policy.deferred();
                        drop(policy);
                        self.check_later(Due {
                            peer: p.peer,
                            seq,
                            own: None,
                            step,
                            answer: keep(),
                        });
                        return Ok(Executed { rows, check: false });
                    }
                    drop(policy);
                    if p.check {
                        self.checking
                            .lock()
                            .expect("checking lock")
                            .insert(ticket.0, (p.peer, None));
                    }
                    return Ok(Executed {
                        rows,
                        check: p.check,
                    });
                }
                Err(CallError::Busy(m)) => {
                    policy.busy(p.peer, now);
                    tracing::debug!(
                        "remote execution: peer {} busy ({m})",
                        self.client.name(p.peer)
                    );
                    ExecFailed::Busy
                }
                Err(CallError::TimedOut) => {
                    policy.failed(p.peer, now);
                    tracing::warn!(
                        "remote execution: peer {} gave no answer in time; computing here",
                        self.client.name(p.peer)
                    );
                    // The call's time is spent: no other holder is tried.
                    return Err(ExecFailed::TimedOut);
                }
                Err(CallError::Failed(m)) => {
                    policy.failed(p.peer, now);
                    tracing::warn!(
                        "remote execution: peer {} failed ({m})",
                        self.client.name(p.peer)
                    );
                    ExecFailed::Failed(m)
                }
            };
            // Another holder while the call's time lasts, if the choice still delegates (the
            // failed peer is paused now, so it is not chosen again).
            let left = retry.deadline.saturating_duration_since(now);
            if left.is_zero() {
                return Err(failed);
            }
            let holders = self.client.holders(retry.id);
            let Choice::Execute { peer } = policy.choose(now, &retry.want, self.hidden, &holders)
            else {
                return Err(failed);
            };
            policy.begin(peer);
            p.check |= policy.check(peer);
            drop(policy);
            tracing::debug!(
                "remote execution: expert {} asked of peer {} instead",
                retry.id,
                self.client.name(peer)
            );
            p.sent_after = self.deferred.lock().collected();
            p.rx = self.start(peer, retry.id, retry.rows.clone(), left);
            p.peer = peer;
            p.started = now;
            p.rtt = link_of(&holders, peer).rtt();
            p.together = 1;
        }
    }

    fn report(&self, ticket: Ticket, verdict: Verdict) {
        let Some((peer, other)) = self
            .checking
            .lock()
            .expect("checking lock")
            .remove(&ticket.0)
        else {
            return;
        };
        // Of two holders that disagreed, the first was right: the second was wrong.
        let (peer, verdict) = match (verdict, other) {
            (Verdict::Agreed, Some(o)) => {
                self.lock_policy().verdict(peer, Verdict::Agreed);
                (o, Verdict::Disagreed)
            }
            _ => (peer, verdict),
        };
        if verdict == Verdict::Disagreed {
            tracing::warn!(
                "remote execution: peer {} computed an expert wrong (a spot-check \
                 disagreed); it is not asked again this session",
                self.client.name(peer)
            );
        }
        self.lock_policy().verdict(peer, verdict);
    }

    fn defer_checks(&self, on: bool) -> bool {
        let on = on && self.schemas.is_some() && self.cache.is_some();
        self.deferred.lock().set_on(on);
        on
    }

    fn begin_step(&self) -> u64 {
        self.deferred.lock().begin_step()
    }

    fn settle(&self, wait: bool) -> Settled {
        let mut due = Vec::new();
        let mut book = self.deferred.lock();
        loop {
            let next = book.settle(wait, &mut due);
            if !due.is_empty() {
                // Forced checks (a peer's unchecked answers waiting on a check): run them
                // outside the lock.
                drop(book);
                for d in due.drain(..) {
                    self.lock_policy().deferred();
                    self.check_later(d);
                }
                book = self.deferred.lock();
                continue;
            }
            match next {
                Next::Done(s) => return s,
                Next::Wait => {
                    book = self
                        .deferred
                        .ended
                        .wait(book)
                        .expect("deferred checks lock")
                }
            }
        }
    }

    fn forget(&self, step: u64) {
        self.deferred.lock().forget(step);
    }
}

/// `id` computed here on `rows` (`[n, H]`): fetched through `cache` and run with the engine's
/// kernels, as a serving peer runs it.
fn compute(
    cache: &TieredExperts,
    schemas: &[Option<ExpertSchema>],
    id: ExpertId,
    rows: &[f32],
) -> Result<Vec<f32>, String> {
    let (layer, expert) = (usize::from(id.layer), usize::from(id.expert));
    let schema = schemas
        .get(layer)
        .and_then(Option::as_ref)
        .ok_or_else(|| format!("layer {layer} has no experts"))?;
    let mut data = Vec::with_capacity(1);
    // Behind the engine's own loads: nobody waits on a check.
    cache
        .fetch_behind(layer, &[expert], &mut data)
        .map_err(|e| e.to_string())?;
    let data = data.pop().ok_or("the tiers returned no expert")?;
    Ok(schema.compute(&data, rows))
}

/// `peer`'s link among `holders` (unmeasured if it is not one of them).
fn link_of(holders: &[Holder], peer: usize) -> Link {
    holders
        .iter()
        .find(|h| h.peer == peer)
        .map_or(Link::default(), |h| h.link)
}

/// Runs `calls` at once and returns their results in order. Dropped early (a time-out), it
/// cancels the calls still running.
async fn futures_join_in_order(calls: Vec<CallFuture>) -> Vec<Result<Vec<f32>, CallError>> {
    /// Aborts the tasks left when dropped.
    struct Calls(Vec<tokio::task::JoinHandle<Result<Vec<f32>, CallError>>>);
    impl Drop for Calls {
        fn drop(&mut self) {
            for h in &self.0 {
                h.abort();
            }
        }
    }
    let mut running = Calls(calls.into_iter().map(tokio::spawn).collect());
    let mut out = Vec::with_capacity(running.0.len());
    for h in &mut running.0 {
        out.push(
            h.await
                .unwrap_or_else(|e| Err(CallError::Failed(format!("the call's task: {e}")))),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::remote_policy::{RemoteExec, VerifyExec};
    use super::*;

    /// How the fake peers answer.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Peer {
        /// `2 x` each input.
        Doubles,
        /// Never answers.
        Stalls,
        /// `busy`.
        Busy,
        /// One value short.
        Short,
        /// `3 x` each input (wrong).
        Triples,
    }

    /// Peers 0.. each behaving as given, all holding every expert.
    #[derive(Debug)]
    struct Fake {
        peers: Vec<Peer>,
        max_positions: usize,
        calls: Arc<AtomicU64>,
        /// Held by each stalled call while it runs.
        live: Arc<()>,
    }

    impl ExecClient for Fake {
        fn holders(&self, _id: ExpertId) -> Vec<Holder> {
            (0..self.peers.len())
                .map(|peer| Holder {
                    peer,
                    link: Link {
                        rtt: Some(Duration::from_millis(1 + peer as u64)),
                        rate: None,
                    },
                })
                .collect()
        }

        fn call(&self, peer: usize, _id: ExpertId, rows: Vec<f32>) -> CallFuture {
            assert!(rows.len() <= self.max_positions * H);
            self.calls.fetch_add(1, Ordering::Relaxed);
            let how = self.peers[peer];
            let live = self.live.clone();
            Box::pin(async move {
                match how {
                    Peer::Doubles => Ok(rows.iter().map(|x| 2.0 * x).collect()),
                    Peer::Stalls => {
                        let _live = live;
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        unreachable!("cancelled by the time-out")
                    }
                    Peer::Busy => Err(CallError::Busy("full".into())),
                    Peer::Short => Ok(rows[1..].to_vec()),
                    Peer::Triples => Ok(rows.iter().map(|x| 3.0 * x).collect()),
                }
            })
        }

        fn max_positions(&self) -> usize {
            self.max_positions
        }
    }

    const H: usize = 4;

    fn executor(
        rt: &tokio::runtime::Runtime,
        peers: Vec<Peer>,
        mode: RemoteExec,
    ) -> (RemoteExperts, Arc<AtomicU64>, Arc<()>) {
        executor_verifying(rt, peers, mode, VerifyExec::Single)
    }

    fn executor_verifying(
        rt: &tokio::runtime::Runtime,
        peers: Vec<Peer>,
        mode: RemoteExec,
        verify: VerifyExec,
    ) -> (RemoteExperts, Arc<AtomicU64>, Arc<()>) {
        let calls = Arc::new(AtomicU64::new(0));
        let live = Arc::new(());
        let fake = Fake {
            peers,
            max_positions: 2,
            calls: calls.clone(),
            live: live.clone(),
        };
        let x = RemoteExperts::new(
            Arc::new(fake),
            rt.handle().clone(),
            RemoteConfig {
                mode,
                spot_check: 0.0,
                inline: false,
                verify,
            },
            None,
            Vec::new(),
            vec![vec![1 << 20; 8]; 2],
            H,
            Duration::from_millis(200),
        );
        (x, calls, live)
    }

    use stormo_testing::runtime;

    /// Delegates what the policy takes and submits to the peer chosen; returns the tickets.
    fn plan(x: &RemoteExperts, layer: usize, demand: &[Demand], rows: &[f32]) -> Vec<Ticket> {
        let mut delegate = vec![false; demand.len()];
        x.choose(layer, demand, &mut delegate);
        demand
            .iter()
            .zip(&delegate)
            .filter(|(_, &d)| d)
            .map(|(d, _)| x.submit(layer, d.expert, &rows[..d.positions * H]))
            .collect()
    }

    /// A call's time is measured to its answer's arrival: an engine that collects it late
    /// (busy with the block's other experts meanwhile) does not make the peer look slow, so
    /// the next cold expert is still delegated. (Timed at collection, this peer measured
    /// 300 ms a call against a 33 ms share of a fetch, and was not asked again.)
    #[test]
    fn a_call_collected_late_is_timed_to_its_arrival() {
        let rt = runtime();
        let (x, _, _) = executor(&rt, vec![Peer::Doubles], RemoteExec::Auto);
        let rows = vec![1.0f32; H];
        let one = |expert| {
            [Demand {
                expert,
                positions: 1,
            }]
        };
        let t = plan(&x, 0, &one(1), &rows);
        assert_eq!(t.len(), 1, "an unmeasured peer is asked");
        std::thread::sleep(Duration::from_millis(300));
        x.collect(t[0]).unwrap();
        let t = plan(&x, 0, &one(2), &rows);
        assert_eq!(t.len(), 1, "the peer answered at once: asked again");
        x.collect(t[0]).unwrap();
    }

    /// A call of 5 positions goes out as three (at most 2 each) and comes back whole and in
    /// order; the first answer of a peer is to be spot-checked and an agreeing verdict counts.
    #[test]
    fn calls_are_split_and_joined_in_order() {
        let rt = runtime();
        let (x, calls, _) = executor(&rt, vec![Peer::Doubles], RemoteExec::Always);
        let rows: Vec<f32> = (0..5 * H).map(|i| i as f32).collect();
        let t = plan(
            &x,
            1,
            &[Demand {
                expert: 3,
                positions: 5,
            }],
            &rows,
        );
        assert_eq!(t.len(), 1);
        let a = x.collect(t[0]).unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        let want: Vec<f32> = rows.iter().map(|v| 2.0 * v).collect();
        assert_eq!(a.rows, want);
        assert!(a.check, "a peer's first answer is checked");
        x.report(t[0], Verdict::Agreed);
        let s = x.stats();
        assert_eq!(
            (s.calls, s.bytes, s.spot_checks),
            (1, 2 * 4 * 5 * H as u64, 1)
        );
        // The next answer is not checked (spot_check 0).
        let t = plan(
            &x,
            1,
            &[Demand {
                expert: 3,
                positions: 1,
            }],
            &rows,
        );
        assert!(!x.collect(t[0]).unwrap().check);
    }

    /// `never` delegates nothing; an unchosen expert's ticket fails without a call.
    #[test]
    fn never_delegates_and_unchosen_submits_fail() {
        let rt = runtime();
        let (x, calls, _) = executor(&rt, vec![Peer::Doubles], RemoteExec::Never);
        let rows = vec![1.0; H];
        assert!(plan(
            &x,
            0,
            &[Demand {
                expert: 1,
                positions: 1
            }],
            &rows
        )
        .is_empty());
        let t = x.submit(0, 1, &rows);
        assert!(matches!(x.collect(t), Err(ExecFailed::Unavailable(_))));
        assert_eq!(calls.load(Ordering::Relaxed), 0);
    }

    /// One expert of layer 0 over one position, delegated and collected.
    fn one_call(x: &RemoteExperts) -> Result<Executed, ExecFailed> {
        let d = Demand {
            expert: 1,
            positions: 1,
        };
        let t = plan(x, 0, &[d], &[1.0; H]);
        assert_eq!(t.len(), 1, "delegated");
        x.collect(t[0])
    }

    /// A peer that stalls is given up on at the time-out (its call cancelled, no other holder
    /// tried: the time is spent) and paused, so the next block's call goes to another holder.
    #[test]
    fn a_stalled_call_times_out_is_cancelled_and_the_next_goes_elsewhere() {
        let rt = runtime();
        let (x, _, live) = executor(&rt, vec![Peer::Stalls, Peer::Doubles], RemoteExec::Always);
        let start = Instant::now();
        assert_eq!(one_call(&x), Err(ExecFailed::TimedOut));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(x.stats().failures, 1);
        // The stalled call was cancelled, not left running.
        let until = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&live) > 2 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(Arc::strong_count(&live), 2, "the fake's and this test's");
        // Peer 0 (the shorter round trip) is paused: peer 1 answers.
        assert_eq!(one_call(&x).unwrap().rows, vec![2.0; H]);
    }

    /// A busy answer or a short one is made up for by another holder within the same call;
    /// with no other holder the call fails and the engine fetches.
    #[test]
    fn a_busy_or_short_answer_goes_to_another_holder_within_the_call() {
        let rt = runtime();
        for (bad, alone) in [
            (Peer::Busy, ExecFailed::Busy),
            (
                Peer::Short,
                ExecFailed::Failed(format!("{} output values for {H} inputs", H - 1)),
            ),
        ] {
            let (x, calls, _) = executor(&rt, vec![bad, Peer::Doubles], RemoteExec::Always);
            let a = one_call(&x).unwrap();
            assert_eq!(a.rows, vec![2.0; H], "{bad:?}");
            assert!(a.check, "peer 1's first answer is checked");
            assert_eq!(calls.load(Ordering::Relaxed), 2, "{bad:?}");
            let s = x.stats();
            assert_eq!((s.calls, s.failures), (1, 1), "{bad:?}");
            let (x, _, _) = executor(&rt, vec![bad], RemoteExec::Always);
            assert_eq!(one_call(&x), Err(alone), "{bad:?} alone");
        }
    }

    /// A disagreeing spot-check bans the peer: the next block goes to the other holder, and
    /// with no other holder nothing is delegated.
    #[test]
    fn a_disagreeing_peer_is_not_asked_again() {
        let rt = runtime();
        let (x, _, _) = executor(&rt, vec![Peer::Doubles, Peer::Doubles], RemoteExec::Always);
        let rows = vec![1.0; H];
        let t = plan(
            &x,
            0,
            &[Demand {
                expert: 1,
                positions: 1,
            }],
            &rows,
        );
        assert!(x.collect(t[0]).unwrap().check);
        x.report(t[0], Verdict::Disagreed);
        let s = x.stats();
        assert_eq!((s.spot_checks, s.spot_check_failures), (1, 1));
        let t = plan(
            &x,
            0,
            &[Demand {
                expert: 1,
                positions: 1,
            }],
            &rows,
        );
        // Peer 1's first answer: checked, so it was peer 1 that answered.
        assert!(x.collect(t[0]).unwrap().check);
        x.report(t[0], Verdict::Disagreed);
        assert!(plan(
            &x,
            0,
            &[Demand {
                expert: 1,
                positions: 1
            }],
            &rows
        )
        .is_empty());
        let s = x.stats();
        assert_eq!((s.calls, s.spot_check_failures), (2, 2));
    }

    /// `--verify-exec dual`: every call goes to two holders. Equal rows are used as one
    /// answer; differing rows are handed to the engine to check, and its verdict on the
    /// first holder's rows bans whichever was wrong. A busy second holder leaves the first's
    /// answer.
    #[test]
    fn dual_calls_compare_two_holders() {
        let rt = runtime();
        let (x, calls, _) = executor_verifying(
            &rt,
            vec![Peer::Doubles, Peer::Doubles],
            RemoteExec::Always,
            VerifyExec::Dual,
        );
        assert_eq!(one_call(&x).unwrap().rows, vec![2.0; H]);
        assert_eq!(calls.load(Ordering::Relaxed), 2, "both holders asked");
        let s = x.stats();
        assert_eq!((s.dual_calls, s.dual_disagreements, s.calls), (1, 0, 2));
        for (peers, liar) in [
            (vec![Peer::Doubles, Peer::Triples], 1),
            (vec![Peer::Triples, Peer::Doubles], 0),
        ] {
            let (x, _, _) =
                executor_verifying(&rt, peers.clone(), RemoteExec::Always, VerifyExec::Dual);
            let t = plan(
                &x,
                0,
                &[Demand {
                    expert: 1,
                    positions: 1,
                }],
                &[1.0; H],
            );
            let a = x.collect(t[0]).unwrap();
            assert!(a.check, "{peers:?}: a disagreement is checked here");
            // The engine's verdict on the rows handed over (the first holder's, peer 0).
            let first_right = a.rows == vec![2.0; H];
            x.report(
                t[0],
                if first_right {
                    Verdict::Agreed
                } else {
                    Verdict::Disagreed
                },
            );
            assert_eq!(x.stats().dual_disagreements, 1, "{peers:?}");
            // The liar is banned: the next call goes to the honest one alone.
            let t = plan(
                &x,
                0,
                &[Demand {
                    expert: 1,
                    positions: 1,
                }],
                &[1.0; H],
            );
            assert_eq!(x.collect(t[0]).unwrap().rows, vec![2.0; H], "{peers:?}");
            assert!(!x.lock_policy().usable(liar, Instant::now()), "{peers:?}");
        }
        let (x, _, _) = executor_verifying(
            &rt,
            vec![Peer::Doubles, Peer::Busy],
            RemoteExec::Always,
            VerifyExec::Dual,
        );
        assert_eq!(one_call(&x).unwrap().rows, vec![2.0; H]);
        assert_eq!(x.stats().failures, 1);
    }
}
