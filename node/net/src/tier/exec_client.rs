//! The exec client: runs an expert at a peer that holds it ([`PeerTier::exec`]), over the
//! tier's link to that peer, at most [`EXEC_IN_FLIGHT`] calls at once on one connection. The
//! serving side and the messages are [`crate::exec`] and `stormo_wire::exec`; the choice
//! between fetching and executing is [`crate::remote_policy`]'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stormo_engine::tiers::ExpertId;
use stormo_manifests::{Hash, PublicKey};
use stormo_wire::Message;

use super::link::{link, Link, LIVENESS_SAMPLE};
use super::{Inner, Peer, PeerTier};
use crate::exec::ExecError;
use crate::policy;
use crate::{FramedRecv, ReadError};

/// The most `Exec` calls this node has in flight on one peer's connection at once (a serving
/// node admits `--exec-per-peer` of them, 8 by default; more would only be answered `busy`).
pub const EXEC_IN_FLIGHT: usize = 8;

/// One call of [`PeerTier::exec_all`]: run `expert` at `peer` over `rows`.
#[derive(Clone, Debug)]
pub struct ExecRequest {
    /// The peer's key.
    pub peer: PublicKey,
    /// The expert.
    pub expert: ExpertId,
    /// The input rows, `[n, hidden]`.
    pub rows: Vec<f32>,
}

/// A holder of an expert that remote execution may call ([`PeerTier::exec_links`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExecLink {
    /// The peer's key.
    pub key: PublicKey,
    /// Its connection's round trip (`None`: not measured yet).
    pub rtt: Option<Duration>,
    /// Its measured throughput, bytes a second (`None`: not measured yet).
    pub rate: Option<f64>,
    /// It presented a membership of this node's swarm.
    pub member: bool,
}

/// [`PeerTier::exec`] on `inner`.
async fn exec_at(
    inner: &Arc<Inner>,
    peer: &PublicKey,
    expert: ExpertId,
    rows: &[f32],
    deadline: Duration,
) -> Result<Vec<f32>, ExecError> {
    let hidden = inner
        .schemas
        .get(expert.layer as usize)
        .and_then(Option::as_ref)
        .map(|s| s.hidden)
        .ok_or_else(|| ExecError::Invalid(format!("layer {} has no experts", expert.layer)))?;
    if rows.is_empty() || !rows.len().is_multiple_of(hidden) {
        return Err(ExecError::Invalid(format!(
            "{} floats are not whole rows of {hidden}",
            rows.len()
        )));
    }
    let peers = inner.peers();
    let p = peers
        .iter()
        .find(|p| p.addr.key == *peer && p.state().usable())
        .cloned()
        .ok_or_else(|| {
            ExecError::Invalid(format!("peer {} is not in the set", crate::short_key(peer)))
        })?;
    // Not up (lost, or never reached) while another holder is connected: the call fails at
    // once rather than wait out a dial, which goes on in the background.
    let other_up = || {
        let now = Instant::now();
        peers.iter().filter(|q| q.addr.key != *peer).any(|q| {
            let s = q.state();
            s.up && s.usable() && s.holds(expert) && !s.suspect(now)
        })
    };
    let up = p.state().up;
    if !up && other_up() {
        let (inner, q) = (inner.clone(), p.clone());
        tokio::spawn(async move { link(&inner, &q).await });
        return Err(ExecError::Lost(format!(
            "{}: not connected (dialling it; another holder is connected)",
            p.addr
        )));
    }
    let per_call = stormo_wire::max_positions(hidden).max(1) * hidden;
    let work = async {
        let l = link(inner, &p)
            .await
            .map_err(|e| ExecError::Lost(format!("{}: {e}", p.addr)))?;
        let calls = async {
            let mut out = Vec::with_capacity(rows.len());
            for chunk in rows.chunks(per_call) {
                out.extend(exec_call(&l, &p, inner.model, expert, chunk, hidden).await?);
            }
            Ok(out)
        };
        let limit = policy::silence_limit(p.state().rtt);
        tokio::select! {
            r = calls => r,
            quiet = silence(&l, &p, limit) => {
                p.state().suspect_silent(Instant::now());
                Err(ExecError::Lost(format!(
                    "{}: its connection heard nothing for {:.1}s",
                    p.addr,
                    quiet.as_secs_f64()
                )))
            }
        }
    };
    match tokio::time::timeout(deadline, work).await {
        Ok(r) => r,
        Err(_) => {
            // Silent or slow, the peer is suspect until its connection is heard again.
            p.state().suspect_silent(Instant::now());
            Err(ExecError::Timeout(deadline))
        }
    }
}

/// Resolves, with how long, once `l`'s connection (to `peer`) has heard nothing for `limit`
/// since this call began or since an earlier request was sent on it
/// ([`policy::PeerView::unanswered`]: a call sent to a connection that already owes a datagram
/// is not given a whole limit of its own).
async fn silence(l: &Link, peer: &Peer, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        tokio::time::sleep(LIVENESS_SAMPLE).await;
        let now = Instant::now();
        // Silent since the call began at least, whatever the connection heard before.
        let owed = peer.state().unanswered(now).unwrap_or_default();
        let quiet = l.live.silent_for(now).min((now - started).max(owed));
        if quiet >= limit && l.live.silent_beyond(&l.conn, now, limit) {
            return quiet;
        }
    }
}

/// One `Exec` call on `l`'s connection: sends the rows on a stream of its own and reads the
/// one answer.
async fn exec_call(
    l: &Link,
    peer: &Peer,
    model: Hash,
    expert: ExpertId,
    rows: &[f32],
    hidden: usize,
) -> Result<Vec<f32>, ExecError> {
    let _slot = l
        .exec_slots
        .acquire()
        .await
        .map_err(|_| ExecError::Lost("the link is closed".into()))?;
    let id = stormo_wire::RequestId(l.exec_ids.fetch_add(1, Ordering::Relaxed));
    let (call, msg) = stormo_wire::ExecCall::start(id, model, expert, rows, hidden)
        .map_err(|e| ExecError::Invalid(e.to_string()))?;
    let (mut send, recv) = l
        .conn
        .open_bi()
        .await
        .map_err(|e| ExecError::Lost(format!("opening a stream: {e}")))?;
    let _ = send.set_priority(crate::serve::EXEC_PRIORITY);
    crate::write_message(&mut send, &Message::Exec(msg))
        .await
        .map_err(|e| ExecError::Lost(format!("{e:#}")))?;
    peer.state().request_sent(Instant::now());
    let _ = send.finish();
    let mut frames = FramedRecv::new(recv, stormo_wire::MAX_EXEC_FRAME_LEN);
    match frames.next().await {
        Ok(Some(m)) => call.answer(m).map_err(ExecError::from),
        Ok(None) => Err(ExecError::Malformed(
            "the stream ended without an answer".into(),
        )),
        Err(ReadError::Decode(e)) => {
            l.conn.close(
                u32::from(stormo_wire::ErrorCode::PROTOCOL_VIOLATION.0).into(),
                e.to_string().as_bytes(),
            );
            Err(ExecError::Malformed(e.to_string()))
        }
        Err(ReadError::Stream(e)) => Err(ExecError::Lost(e.to_string())),
    }
}

impl PeerTier {
    /// The peers in the set that hold expert `id` verified by their inventory (not those that
    /// only offer to fetch it), and may be asked: where [`Self::exec`] can run it. A peer whose
    /// connection went silent with a call or fetch waiting on it is left out until it is heard
    /// again ([`policy::PeerView::suspect`]).
    pub fn exec_holders(&self, id: ExpertId) -> Vec<PublicKey> {
        let now = Instant::now();
        self.inner
            .peers()
            .iter()
            .filter(|p| {
                let s = p.state();
                s.usable() && s.holds(id) && !s.suspect(now)
            })
            .map(|p| p.addr.key)
            .collect()
    }

    /// [`Self::exec_holders`] with each one's measured link, for remote execution's choice.
    pub fn exec_links(&self, id: ExpertId) -> Vec<ExecLink> {
        let now = Instant::now();
        self.inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                (s.usable() && s.holds(id) && !s.suspect(now)).then(|| ExecLink {
                    key: p.addr.key,
                    rtt: s.rtt,
                    rate: s.rate,
                    member: s.member,
                })
            })
            .collect()
    }

    /// Runs expert `expert` at the peer with key `peer` over `rows` (`[n, hidden]` f32, the
    /// layer's hidden width) and returns its output rows (`[n, hidden]`), within `deadline`
    /// (connecting included). More positions than one call carries
    /// ([`stormo_wire::max_positions`]) go as several calls, one after another. The answer's
    /// length is checked before its rows are returned; whether they are right is the
    /// caller's to check (spot-checks). Uses the tier's connection to the peer (dialling it if
    /// there is none, as a fetch would, unless another holder of the expert is connected: then
    /// it fails at once and the dial goes on in the background, so that no call waits on a
    /// redial). A call whose connection hears nothing for longer than the peer's latency
    /// explains ([`policy::silence_limit`]) fails at once as lost and leaves the peer suspect
    /// (so does a call that times out), so that the caller asks another holder; a lost
    /// connection is redialled later as for fetches.
    pub async fn exec(
        &self,
        peer: &PublicKey,
        expert: ExpertId,
        rows: &[f32],
        deadline: Duration,
    ) -> Result<Vec<f32>, ExecError> {
        exec_at(&self.inner, peer, expert, rows, deadline).await
    }

    /// Runs every call of `calls` at its peer, all at once (each on a task of its own; at most
    /// [`EXEC_IN_FLIGHT`] at a time on one peer's connection, the others wait their turn
    /// within the deadline), and returns their outputs in the same order. Each call is as
    /// [`Self::exec`], with the same `deadline` from now.
    pub async fn exec_all(
        &self,
        calls: Vec<ExecRequest>,
        deadline: Duration,
    ) -> Vec<Result<Vec<f32>, ExecError>> {
        let tasks: Vec<_> = calls
            .into_iter()
            .map(|c| {
                let inner = self.inner.clone();
                tokio::spawn(
                    async move { exec_at(&inner, &c.peer, c.expert, &c.rows, deadline).await },
                )
            })
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(
                t.await.unwrap_or_else(|e| {
                    Err(ExecError::Lost(format!("the call's task ended: {e}")))
                }),
            );
        }
        out
    }

    /// [`Self::exec_all`] from a thread outside the tier's runtime, blocking it until every
    /// call ended. Must not be called from within an async task.
    pub fn exec_all_blocking(
        &self,
        calls: Vec<ExecRequest>,
        deadline: Duration,
    ) -> Vec<Result<Vec<f32>, ExecError>> {
        self.rt.block_on(self.exec_all(calls, deadline))
    }

    /// [`Self::exec`] from a thread outside the tier's runtime (an engine thread), blocking
    /// it until the call ends. Must not be called from within an async task.
    pub fn exec_blocking(
        &self,
        peer: &PublicKey,
        expert: ExpertId,
        rows: &[f32],
        deadline: Duration,
    ) -> Result<Vec<f32>, ExecError> {
        self.rt.block_on(self.exec(peer, expert, rows, deadline))
    }
}
