//! Connections of the HTTP API: how many may be open at once, and how long a client may
//! stall one.
//!
//! Owns: the connection caps, in all and per client address (a connection beyond either gets
//! a canned 503 and is closed, so a flood of idle connections cannot use up the process's file
//! descriptors, and one address cannot take every slot), and the write stall timeout (a
//! client that stops taking the response loses its connection). The other timeouts live where
//! the reading happens: hyper's header read timeout, which also closes an idle keep-alive
//! connection, and the body read timeout in `read_json`.
//!
//! A connection is counted under both caps from its accept until it is closed, by the
//! [`Slot`] its task holds, whatever ends it. The per-address counts live in a map under a
//! plain mutex, taken only for a lookup (never across an await); an address leaves the map
//! when its last connection closes, so the map holds at most one entry per open connection.
//!
//! Non-goals: fairness between clients beyond the per-address cap; telling clients apart
//! behind a proxy (they all have its address) or within an IPv6 prefix (each address of a
//! host's /64 counts as a client of its own).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// How long a client may take, by default: to send a request's headers (counted from the
/// connection's start or the end of the previous response, so it is also how long an idle
/// keep-alive connection is kept), then its body, or to take the next part of a response.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections open at once, by default. Well under the common soft limit of 1024 open
/// files, leaving room for the model's files and the peers' sockets; far more than one
/// engine running one request at a time needs.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Connections one client address may have open at once, by default: more than a client
/// needs with one request running and a few waiting (a browser opens at most 6 per host),
/// few enough that 16 addresses are needed to take every slot of the default cap.
pub const DEFAULT_MAX_PER_CLIENT: usize = 16;

/// Connections beyond the cap being answered 503 at once; beyond this they are closed
/// without an answer, so answering cannot itself use up file descriptors.
const MAX_REJECTING: usize = 64;

/// How long a refused connection is kept for its 503 to be written and the client's
/// request to be read and discarded (closing with unread input would reset the connection,
/// and the client might lose the 503).
const REJECT_LINGER: Duration = Duration::from_secs(1);

/// Admits connections up to the cap, and up to the per-address cap from each address.
#[derive(Debug)]
pub(super) struct Gate {
    open: Arc<Semaphore>,
    rejecting: Arc<Semaphore>,
    max: usize,
    /// The per-address counts; `None` when the per-address cap is no lower than `max`.
    clients: Option<Arc<Clients>>,
    /// The whole 503 response a connection beyond `max` gets.
    refusal: Arc<[u8]>,
    /// The whole 503 response a connection beyond the per-address cap gets.
    client_refusal: Arc<[u8]>,
    /// Whether the last connection was refused (to warn once each time the cap is reached).
    full: bool,
}

/// A connection's place under the caps, given back when dropped: held by the connection's
/// task until the connection is closed.
#[derive(Debug)]
pub(super) struct Slot {
    _open: OwnedSemaphorePermit,
    _client: Option<ClientSlot>,
}

impl Gate {
    /// A gate for at most `max` connections (at least 1, at most [`Semaphore::MAX_PERMITS`]),
    /// at most `per_client` of them from one address (at least 1; at or above `max`, only
    /// `max` applies). A connection beyond `max` gets the JSON error `body` with status 503,
    /// one beyond `per_client` the JSON error `client_body`.
    pub(super) fn new(max: usize, per_client: usize, body: &str, client_body: &str) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        let per_client = per_client.max(1);
        Self {
            open: Arc::new(Semaphore::new(max)),
            rejecting: Arc::new(Semaphore::new(MAX_REJECTING)),
            max,
            clients: (per_client < max).then(|| {
                Arc::new(Clients {
                    max: per_client,
                    open: Mutex::new(HashMap::new()),
                })
            }),
            refusal: refusal(body),
            client_refusal: refusal(client_body),
            full: false,
        }
    }

    /// The semaphore of the connection slots and their number: all permits are free when no
    /// admitted connection is open.
    pub(super) fn slots(&self) -> (Arc<Semaphore>, usize) {
        (self.open.clone(), self.max)
    }

    /// A slot for `stream` to be served, held while it is; or `None` when a cap is reached,
    /// in which case the connection is answered 503 and closed in the background.
    pub(super) fn admit(
        &mut self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> Option<(TcpStream, Slot)> {
        // The address's own cap first, so that a client holding its share is told so even
        // when all connections are taken; its place is given back if the cap in all refuses.
        let client = match &self.clients {
            None => None,
            Some(clients) => match Clients::enter(clients, peer.ip()) {
                Ok(slot) => Some(slot),
                Err(first) => {
                    if first {
                        tracing::warn!(
                            "HTTP: {} has {} connections open, the most one address may have; \
                             refusing more from it until some close",
                            peer.ip().to_canonical(),
                            clients.max
                        );
                    }
                    tracing::debug!(
                        "HTTP connection from {peer} refused: too many connections from it"
                    );
                    let refusal = self.client_refusal.clone();
                    self.reject(stream, refusal);
                    return None;
                }
            },
        };
        if let Ok(permit) = self.open.clone().try_acquire_owned() {
            self.full = false;
            let slot = Slot {
                _open: permit,
                _client: client,
            };
            return Some((stream, slot));
        }
        drop(client);
        if !self.full {
            tracing::warn!(
                "HTTP: {} connections are open, the most allowed; refusing more until some close",
                self.max
            );
            self.full = true;
        }
        tracing::debug!("HTTP connection from {peer} refused: too many connections");
        let refusal = self.refusal.clone();
        self.reject(stream, refusal);
        None
    }

    /// Answers `refusal` on `stream` and closes it in the background, or closes it at once
    /// when [`MAX_REJECTING`] connections are being answered already.
    fn reject(&self, stream: TcpStream, refusal: Arc<[u8]>) {
        if let Ok(permit) = self.rejecting.clone().try_acquire_owned() {
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tokio::time::timeout(REJECT_LINGER, reject(stream, &refusal)).await;
            });
        }
    }
}

/// The whole 503 response (head and JSON error `body`) a refused connection gets.
fn refusal(body: &str) -> Arc<[u8]> {
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    [head.as_bytes(), body.as_bytes()].concat().into()
}

/// Connections open from each client address.
#[derive(Debug)]
struct Clients {
    /// The most one address may have open.
    max: usize,
    /// The addresses with a connection open; none with a count of zero.
    open: Mutex<HashMap<IpAddr, Client>>,
}

#[derive(Debug, Default)]
struct Client {
    /// Connections open from the address.
    open: usize,
    /// Whether one was refused since the count was last below the cap (to warn once each
    /// time the address reaches it).
    refused: bool,
}

/// A connection's place under its address's cap; given back when dropped.
#[derive(Debug)]
struct ClientSlot {
    clients: Arc<Clients>,
    ip: IpAddr,
}

impl Clients {
    /// A place for one more connection from `ip`, or `Err(first)` when the address has the
    /// most it may; `first` is whether this is the first refusal since it reached the cap.
    /// An IPv4 address mapped into IPv6 counts as that IPv4 address.
    fn enter(this: &Arc<Self>, ip: IpAddr) -> Result<ClientSlot, bool> {
        let ip = ip.to_canonical();
        let mut open = this.open.lock().unwrap_or_else(PoisonError::into_inner);
        let c = open.entry(ip).or_default();
        if c.open >= this.max {
            let first = !c.refused;
            c.refused = true;
            return Err(first);
        }
        c.open += 1;
        Ok(ClientSlot {
            clients: this.clone(),
            ip,
        })
    }

    /// How many connections `ip` has open.
    #[cfg(test)]
    fn count(&self, ip: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(&ip.to_canonical()).map_or(0, |c| c.open)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self
            .clients
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let std::collections::hash_map::Entry::Occupied(mut e) = open.entry(self.ip) {
            let c = e.get_mut();
            c.open = c.open.saturating_sub(1);
            c.refused = false;
            if c.open == 0 {
                e.remove();
            }
        }
    }
}

/// Answers `refusal` and closes, after reading (and discarding) what the client sends
/// meanwhile.
async fn reject(mut stream: TcpStream, refusal: &[u8]) -> io::Result<()> {
    stream.write_all(refusal).await?;
    stream.shutdown().await?;
    let mut sink = [0u8; 4096];
    while stream.read(&mut sink).await? > 0 {}
    Ok(())
}

/// An I/O stream whose writes fail with [`io::ErrorKind::TimedOut`] once one has waited
/// `limit` without the peer taking any data. Reads are not timed here: hyper waits on a read
/// while it runs a request, to notice a client that hangs up, and that wait is no stall.
#[derive(Debug)]
pub(super) struct Stall<T> {
    io: T,
    limit: Duration,
    timer: Pin<Box<Sleep>>,
    /// Whether `timer` runs: a write is waiting since it was set.
    armed: bool,
}

impl<T> Stall<T> {
    pub(super) fn new(io: T, limit: Duration) -> Self {
        Self {
            io,
            limit,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            armed: false,
        }
    }

    /// Called when a write waits: starts the timer if it is not running, and fails once it
    /// has run out.
    fn poll_stalled<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        if !self.armed {
            let now = Instant::now();
            let deadline = now.checked_add(self.limit).unwrap_or(now + MAX_STALL);
            self.timer.as_mut().reset(deadline);
            self.armed = true;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.armed = false;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the client took no data for {:.1} s",
                        self.limit.as_secs_f64()
                    ),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn done<R>(&mut self, cx: &mut Context<'_>, p: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match p {
            Poll::Pending => self.poll_stalled(cx),
            ready => {
                self.armed = false;
                ready
            }
        }
    }
}

/// The longest stall timer, for a limit too large to add to the clock (a year).
const MAX_STALL: Duration = Duration::from_secs(365 * 24 * 3600);

impl<T: AsyncRead + Unpin> AsyncRead for Stall<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stall<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.io).poll_write(cx, buf);
        this.done(cx, p)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.done(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.io).poll_flush(cx);
        this.done(cx, p)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.io).poll_shutdown(cx);
        this.done(cx, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_write_the_peer_never_takes_times_out() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut s = Stall::new(ours, Duration::from_millis(100));
        let t0 = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(5), s.write_all(&[7u8; 4096]))
            .await
            .expect("the stall timeout fires before the test's")
            .expect_err("nobody reads, so the write fails");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_write_the_peer_takes_slowly_succeeds() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        // Each wait (about 10 ms) is far shorter than the limit; the whole write is longer.
        let mut s = Stall::new(ours, Duration::from_millis(300));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 64];
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                match theirs.read(&mut buf).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got += n,
                }
            }
        });
        s.write_all(&[7u8; 4096])
            .await
            .expect("the write completes");
        s.shutdown().await.expect("shutdown");
        assert_eq!(reader.await.expect("reader"), 4096);
    }

    #[test]
    fn a_gate_of_zero_or_too_many_is_clamped() {
        assert_eq!(Gate::new(0, 1, "{}", "{}").max, 1);
        assert_eq!(
            Gate::new(usize::MAX, 16, "{}", "{}").max,
            Semaphore::MAX_PERMITS
        );
    }

    #[test]
    fn a_per_client_cap_at_or_above_the_cap_is_no_cap_of_its_own() {
        assert!(Gate::new(8, 8, "{}", "{}").clients.is_none());
        assert!(Gate::new(8, usize::MAX, "{}", "{}").clients.is_none());
        let g = Gate::new(8, 0, "{}", "{}");
        assert_eq!(g.clients.as_ref().map(|c| c.max), Some(1));
    }

    /// Each address is counted on its own, a place is given back when its slot drops, and
    /// an address whose last connection closed leaves the map.
    #[test]
    fn clients_are_counted_per_address_and_forgotten_at_zero() {
        let clients = Arc::new(Clients {
            max: 2,
            open: Mutex::new(HashMap::new()),
        });
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let a_mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        let a1 = Clients::enter(&clients, a).expect("first from a");
        let a2 = Clients::enter(&clients, a_mapped).expect("second from a, mapped");
        assert_eq!(
            Clients::enter(&clients, a).err(),
            Some(true),
            "third from a"
        );
        assert_eq!(
            Clients::enter(&clients, a).err(),
            Some(false),
            "warned once"
        );
        let b1 = Clients::enter(&clients, b).expect("b is not a");
        assert_eq!((clients.count(a), clients.count(b)), (2, 1));
        drop(a1);
        assert_eq!(clients.count(a), 1);
        let a3 = Clients::enter(&clients, a).expect("a place again");
        assert_eq!(
            Clients::enter(&clients, a).err(),
            Some(true),
            "warned again"
        );
        drop((a2, a3, b1));
        assert!(clients.open.lock().expect("lock").is_empty());
    }
}
