//! Connections of the HTTP API: how many may be open at once, and how long a client may
//! stall one.
//!
//! Owns: the connection cap (a connection beyond it gets a canned 503 and is closed, so a
//! flood of idle connections cannot use up the process's file descriptors) and the write
//! stall timeout (a client that stops taking the response loses its connection). The other
//! timeouts live where the reading happens: hyper's header read timeout, which also closes
//! an idle keep-alive connection, and the body read timeout in `read_json`.
//!
//! Non-goals: per-address limits (a proxy in front does that), fairness between clients.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
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

/// Connections beyond the cap being answered 503 at once; beyond this they are closed
/// without an answer, so answering cannot itself use up file descriptors.
const MAX_REJECTING: usize = 64;

/// How long a refused connection is kept for its 503 to be written and the client's
/// request to be read and discarded (closing with unread input would reset the connection,
/// and the client might lose the 503).
const REJECT_LINGER: Duration = Duration::from_secs(1);

/// Admits connections up to the cap.
#[derive(Debug)]
pub(super) struct Gate {
    open: Arc<Semaphore>,
    rejecting: Arc<Semaphore>,
    max: usize,
    /// The whole 503 response a refused connection gets.
    refusal: Arc<[u8]>,
    /// Whether the last connection was refused (to warn once each time the cap is reached).
    full: bool,
}

impl Gate {
    /// A gate for at most `max` connections (at least 1, at most [`Semaphore::MAX_PERMITS`]);
    /// a connection beyond them gets the JSON error `body` with status 503.
    pub(super) fn new(max: usize, body: &str) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
            body.len()
        );
        Self {
            open: Arc::new(Semaphore::new(max)),
            rejecting: Arc::new(Semaphore::new(MAX_REJECTING)),
            max,
            refusal: [head.as_bytes(), body.as_bytes()].concat().into(),
            full: false,
        }
    }

    /// A permit for `stream` to be served, held while it is; or `None` when the cap is
    /// reached, in which case the connection is answered 503 and closed in the background.
    pub(super) fn admit(
        &mut self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> Option<(TcpStream, OwnedSemaphorePermit)> {
        if let Ok(permit) = self.open.clone().try_acquire_owned() {
            self.full = false;
            return Some((stream, permit));
        }
        if !self.full {
            tracing::warn!(
                "HTTP: {} connections are open, the most allowed; refusing more until some close",
                self.max
            );
            self.full = true;
        }
        tracing::debug!("HTTP connection from {peer} refused: too many connections");
        if let Ok(permit) = self.rejecting.clone().try_acquire_owned() {
            let refusal = self.refusal.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tokio::time::timeout(REJECT_LINGER, reject(stream, &refusal)).await;
            });
        }
        None
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
        assert_eq!(Gate::new(0, "{}").max, 1);
        assert_eq!(Gate::new(usize::MAX, "{}").max, Semaphore::MAX_PERMITS);
    }
}
