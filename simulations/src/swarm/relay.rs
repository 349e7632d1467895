//! A UDP relay between clients and one server that imposes a link's latency, bandwidth and
//! loss: the portable way to shape a QUIC link on loopback (no network namespaces, no tc, no
//! root).
//!
//! Clients are given the relay's address instead of the server's. Each client's datagrams go
//! out of a socket of that client's own to the server, so the server sees each client at an
//! address of the relay, and its answers from there go back to that client, as through a NAT.
//! (A relay that answered whoever sent last would hand one client's handshake to another when
//! several start at once.) Each direction is one FIFO with one token bucket, whichever client
//! a datagram is from or for: a datagram leaves
//! `delay` after the link has finished "transmitting" it at `bandwidth`, is dropped with
//! probability `loss`, and is dropped when more than `queue_bytes` wait (a router's tail drop).
//! Every byte is counted, so the relay also measures how much each peer sent.
//!
//! Several relays can share one bottleneck on their way to the client ([`SharedLink`],
//! [`Relay::start_shared`]): one token bucket and one drop-tail queue of bounded size that
//! every server-to-client datagram of those relays passes, in arrival order, as flows that
//! meet at a router's congested port do. Each relay keeps its own delay and loss.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a link behaves, the same in both directions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// One-way delay.
    pub delay: Duration,
    /// Bytes per second, or unlimited.
    pub bandwidth: Option<u64>,
    /// Probability that a datagram is lost, in [0, 1).
    pub loss: f64,
    /// Bytes that may wait in one direction's queue to be transmitted at `bandwidth` before
    /// datagrams are dropped (bytes already on the wire, in their `delay`, do not count; a link
    /// without a bandwidth never queues).
    pub queue_bytes: usize,
    /// The largest UDP payload the path carries; larger datagrams are dropped, as a real path
    /// drops them (QUIC sets don't-fragment and finds the path's MTU by probing). `None`: any
    /// size, as loopback.
    pub mtu: Option<usize>,
}

/// The UDP payload an Ethernet path carries: 1,500 bytes less the IPv4 and UDP headers.
pub const ETHERNET_MTU: usize = 1500 - 28;

impl LinkSpec {
    /// A link that only relays (and counts).
    pub fn ideal() -> Self {
        Self {
            delay: Duration::ZERO,
            bandwidth: None,
            loss: 0.0,
            queue_bytes: 64 << 20,
            mtu: None,
        }
    }

    /// A 1 Gbit/s Ethernet LAN with 0.25 ms one-way delay.
    pub fn lan() -> Self {
        Self {
            delay: Duration::from_micros(250),
            bandwidth: Some(125_000_000),
            loss: 0.0,
            queue_bytes: 4 << 20,
            mtu: Some(ETHERNET_MTU),
        }
    }

    /// A 100 Mbit/s internet path with 20 ms one-way delay, 0.5% loss and Ethernet's MTU.
    pub fn wan() -> Self {
        Self {
            delay: Duration::from_millis(20),
            bandwidth: Some(12_500_000),
            loss: 0.005,
            queue_bytes: 1 << 20,
            mtu: Some(ETHERNET_MTU),
        }
    }

    /// Checks that the numbers make sense.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..1.0).contains(&self.loss) {
            return Err(format!("loss {} is not in [0, 1)", self.loss));
        }
        if self.bandwidth == Some(0) {
            return Err("bandwidth 0 would carry nothing".into());
        }
        if self.mtu.is_some_and(|m| m < 1200) {
            return Err(format!(
                "an MTU of {} bytes is below QUIC's minimum of 1200",
                self.mtu.unwrap_or(0)
            ));
        }
        if self.queue_bytes < 65_536 {
            return Err(format!(
                "a queue of {} bytes cannot hold one large datagram (at least 65536)",
                self.queue_bytes
            ));
        }
        Ok(())
    }
}

/// What a relay carried, counted as UDP payload bytes.
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Client to server, delivered.
    pub up_bytes: AtomicU64,
    /// Server to client, delivered.
    pub down_bytes: AtomicU64,
    /// Datagrams dropped by the loss probability.
    pub lost: AtomicU64,
    /// Datagrams dropped because the queue was full.
    pub overflowed: AtomicU64,
    /// Datagrams dropped because they exceeded the path's MTU (QUIC's MTU probes).
    pub too_large: AtomicU64,
}

/// A copy of [`LinkStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkCounts {
    /// Client to server, delivered.
    pub up_bytes: u64,
    /// Server to client, delivered.
    pub down_bytes: u64,
    /// Datagrams dropped by the loss probability.
    pub lost: u64,
    /// Datagrams dropped because the queue was full.
    pub overflowed: u64,
    /// Datagrams dropped because they exceeded the path's MTU (QUIC's MTU probes).
    pub too_large: u64,
}

impl LinkStats {
    /// The counts now.
    pub fn snapshot(&self) -> LinkCounts {
        LinkCounts {
            up_bytes: self.up_bytes.load(Ordering::Relaxed),
            down_bytes: self.down_bytes.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            too_large: self.too_large.load(Ordering::Relaxed),
        }
    }
}

/// A running relay; stops (and joins its threads) on drop.
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    stats: Arc<LinkStats>,
    stop: Arc<AtomicBool>,
    /// The front reader and the two pacers.
    threads: Vec<JoinHandle<()>>,
    /// The readers of the clients' sessions, started by the front reader.
    sessions: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

/// One direction's transmitter: a token bucket (`bandwidth`) feeding a drop-tail queue of at
/// most `queue_bytes` waiting to be transmitted. Each relay direction has its own, unless
/// several relays share one ([`SharedLink`]).
#[derive(Debug)]
struct Bottleneck {
    bandwidth: Option<u64>,
    queue_bytes: usize,
    /// When the link finishes transmitting what it has accepted so far.
    free_at: Mutex<Instant>,
}

impl Bottleneck {
    fn new(bandwidth: Option<u64>, queue_bytes: usize) -> Self {
        Self {
            bandwidth,
            queue_bytes,
            free_at: Mutex::new(Instant::now()),
        }
    }

    /// Accepts `n` bytes arriving now: the time they have left the link, or `None` when the
    /// queue is full (dropped). The bytes waiting are those the link has yet to transmit:
    /// what is left before `free_at` at its rate (a link without a rate never queues).
    fn admit(&self, n: usize) -> Option<Instant> {
        let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        *free_at = (*free_at).max(now);
        if let Some(bw) = self.bandwidth {
            let waiting = (*free_at - now).as_secs_f64() * bw as f64;
            if waiting + n as f64 > self.queue_bytes as f64 {
                return None;
            }
            *free_at += Duration::from_secs_f64(n as f64 / bw as f64);
        }
        Some(*free_at)
    }
}

/// A bottleneck several relays share on their way to the client: every datagram their servers
/// send passes one token bucket of `bandwidth` bytes a second and one drop-tail queue of
/// `queue_bytes`, whichever relay it came through. Give the same one to each
/// [`Relay::start_shared`] whose flows should compete.
#[derive(Debug, Clone)]
pub struct SharedLink(Arc<Bottleneck>);

impl SharedLink {
    /// A shared bottleneck with `spec`'s bandwidth and queue (its delay, loss and MTU stay
    /// each relay's own).
    pub fn new(spec: &LinkSpec) -> Result<Self, String> {
        spec.validate()?;
        Ok(Self(Arc::new(Bottleneck::new(
            spec.bandwidth,
            spec.queue_bytes,
        ))))
    }
}

/// The largest UDP payload.
const MAX_DATAGRAM: usize = 65_536;
/// Socket buffers: QUIC on loopback loses packets with the default ~200 KiB.
const SOCKET_BUFFER: usize = 4 << 20;
/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

fn udp_socket() -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    // Best effort: a smaller buffer only means more loss under load.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let any: SocketAddr = "127.0.0.1:0".parse().expect("a literal address");
    s.bind(&any.into())?;
    let u: UdpSocket = s.into();
    u.set_read_timeout(Some(POLL))?;
    Ok(u)
}

/// A splitmix64 step: the relay's loss draws, reproducible from the seed.
fn next_u64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What one direction's datagrams pass: the link's rate and queue, its loss and its MTU.
struct Gate {
    spec: LinkSpec,
    link: Arc<Bottleneck>,
    stats: Arc<LinkStats>,
    /// The loss draws.
    rng: u64,
}

impl Gate {
    /// When a datagram of `n` bytes arriving now leaves the link (after its delay), or `None`
    /// when it is dropped (too large, lost, or the queue is full), counted.
    fn pass(&mut self, n: usize) -> Option<Instant> {
        if self.spec.mtu.is_some_and(|m| n > m) {
            self.stats.too_large.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if self.spec.loss > 0.0
            && (next_u64(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - self.spec.loss
        {
            self.stats.lost.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let Some(free_at) = self.link.admit(n) else {
            self.stats.overflowed.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        Some(free_at + self.spec.delay)
    }
}

/// A datagram on its way: when it leaves, its bytes, and where it goes.
type Queued<T> = (Instant, Vec<u8>, T);

/// The most clients one relay carries at once; datagrams from further new addresses are
/// dropped (a simulation has a few dozen processes).
const MAX_CLIENTS: usize = 1024;

impl Relay {
    /// Starts relaying to the server at `target` with `spec` on both directions; loss draws
    /// come from `seed`.
    pub fn start(target: SocketAddr, spec: LinkSpec, seed: u64) -> std::io::Result<Self> {
        Self::start_with(target, spec, seed, None)
    }

    /// Like [`Relay::start`], but what the server sends passes `down` (shared with other
    /// relays) instead of a bottleneck of this relay's own: `spec`'s bandwidth and queue then
    /// shape only the client's direction.
    pub fn start_shared(
        target: SocketAddr,
        spec: LinkSpec,
        seed: u64,
        down: &SharedLink,
    ) -> std::io::Result<Self> {
        Self::start_with(target, spec, seed, Some(down.0.clone()))
    }

    fn start_with(
        target: SocketAddr,
        spec: LinkSpec,
        seed: u64,
        down: Option<Arc<Bottleneck>>,
    ) -> std::io::Result<Self> {
        spec.validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let front = Arc::new(udp_socket()?);
        let addr = front.local_addr()?;
        let target = Arc::new(Mutex::new(target));
        let stats = Arc::new(LinkStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let sessions = Arc::new(Mutex::new(Vec::new()));
        let (up_tx, up_rx) = mpsc::channel::<Queued<Arc<UdpSocket>>>();
        let (down_tx, down_rx) = mpsc::channel::<Queued<SocketAddr>>();
        let to_server = target.clone();
        let up_pacer = spawn_pacer(
            up_rx,
            stop.clone(),
            stats.clone(),
            |s| &s.up_bytes,
            move |pkt, back: Arc<UdpSocket>| {
                let to = *to_server.lock().unwrap_or_else(|e| e.into_inner());
                back.send_to(pkt, to).is_ok()
            },
        )?;
        let out = front.clone();
        let down_pacer = spawn_pacer(
            down_rx,
            stop.clone(),
            stats.clone(),
            |s| &s.down_bytes,
            move |pkt, client| out.send_to(pkt, client).is_ok(),
        )?;
        let up = Gate {
            spec,
            link: Arc::new(Bottleneck::new(spec.bandwidth, spec.queue_bytes)),
            stats: stats.clone(),
            rng: seed,
        };
        let down = Gate {
            spec,
            link: down
                .unwrap_or_else(|| Arc::new(Bottleneck::new(spec.bandwidth, spec.queue_bytes))),
            stats: stats.clone(),
            rng: seed ^ 0x5eed_d0e5,
        };
        let ctx = FrontCtx {
            front,
            up,
            down: Arc::new(Mutex::new(down)),
            up_tx,
            down_tx,
            stop: stop.clone(),
            sessions: sessions.clone(),
        };
        let reader = std::thread::Builder::new()
            .name("swarm-relay-up".into())
            .spawn(move || ctx.run())?;
        Ok(Self {
            addr,
            target,
            stats,
            stop,
            threads: vec![reader, up_pacer, down_pacer],
            sessions,
        })
    }

    /// The address to give the client in place of the server's.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Points the relay at a server's new address (a node restarted on another port).
    pub fn set_target(&self, target: SocketAddr) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = target;
    }

    /// What the link has carried so far.
    pub fn counts(&self) -> LinkCounts {
        self.stats.snapshot()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The front reader first: once it is gone, no session starts.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let sessions =
            std::mem::take(&mut *self.sessions.lock().unwrap_or_else(|e| e.into_inner()));
        for t in sessions {
            let _ = t.join();
        }
    }
}

/// What the front socket's reader holds: each client's session, and both directions' gates
/// (the server's direction is shared by the sessions' readers, as one link is).
struct FrontCtx {
    front: Arc<UdpSocket>,
    up: Gate,
    /// The server's direction, which every session's reader passes.
    down: Arc<Mutex<Gate>>,
    up_tx: mpsc::Sender<Queued<Arc<UdpSocket>>>,
    down_tx: mpsc::Sender<Queued<SocketAddr>>,
    stop: Arc<AtomicBool>,
    sessions: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl FrontCtx {
    /// Reads what clients send; a new client's first datagram opens its session: a socket of
    /// its own towards the server, and a reader that sends the server's answers back to it.
    fn run(mut self) {
        let mut back: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while !self.stop.load(Ordering::Relaxed) {
            // Timeouts (the stop flag's poll) and errors (ICMP port unreachable from a killed
            // peer) alike: keep going.
            let Ok((n, src)) = self.front.recv_from(&mut buf) else {
                continue;
            };
            let sock = match back.get(&src) {
                Some(s) => s.clone(),
                None if back.len() >= MAX_CLIENTS => continue,
                None => {
                    let Ok(s) = self.open_session(src) else {
                        continue;
                    };
                    back.insert(src, s.clone());
                    s
                }
            };
            let Some(due) = self.up.pass(n) else {
                continue;
            };
            if self.up_tx.send((due, buf[..n].to_vec(), sock)).is_err() {
                break;
            }
        }
    }

    /// Opens `client`'s socket towards the server and starts the reader of its answers.
    fn open_session(&self, client: SocketAddr) -> std::io::Result<Arc<UdpSocket>> {
        let sock = Arc::new(udp_socket()?);
        let (from, down, tx, stop) = (
            sock.clone(),
            self.down.clone(),
            self.down_tx.clone(),
            self.stop.clone(),
        );
        let h = std::thread::Builder::new()
            .name("swarm-relay-down".into())
            .spawn(move || {
                let mut buf = vec![0u8; MAX_DATAGRAM];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, _)) = from.recv_from(&mut buf) else {
                        continue;
                    };
                    let due = down.lock().unwrap_or_else(|e| e.into_inner()).pass(n);
                    let Some(due) = due else {
                        continue;
                    };
                    if tx.send((due, buf[..n].to_vec(), client)).is_err() {
                        break;
                    }
                }
            })?;
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(h);
        Ok(sock)
    }
}

/// Starts the thread that sends each queued datagram with `send` when it is due, in the order
/// queued, counting what was delivered.
fn spawn_pacer<T: Send + 'static>(
    rx: mpsc::Receiver<Queued<T>>,
    stop: Arc<AtomicBool>,
    stats: Arc<LinkStats>,
    delivered: fn(&LinkStats) -> &AtomicU64,
    send: impl Fn(&[u8], T) -> bool + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("swarm-relay-out".into())
        .spawn(move || loop {
            let (due, pkt, to) = match rx.recv_timeout(POLL) {
                Ok(x) => x,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if send(&pkt, to) {
                delivered(&stats).fetch_add(pkt.len() as u64, Ordering::Relaxed);
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback, stopped by its flag.
    fn echo() -> (SocketAddr, Arc<AtomicBool>, JoinHandle<()>) {
        let s = udp_socket().unwrap();
        let addr = s.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let h = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !st.load(Ordering::Relaxed) {
                if let Ok((n, src)) = s.recv_from(&mut buf) {
                    let _ = s.send_to(&buf[..n], src);
                }
            }
        });
        (addr, stop, h)
    }

    fn client() -> UdpSocket {
        let c = udp_socket().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        c
    }

    #[test]
    fn relays_both_ways_with_the_delay_and_counts_bytes() {
        let (addr, stop, h) = echo();
        let spec = LinkSpec {
            delay: Duration::from_millis(20),
            ..LinkSpec::ideal()
        };
        let r = Relay::start(addr, spec, 1).unwrap();
        let c = client();
        let t = Instant::now();
        c.send_to(b"hello", r.addr()).unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = c.recv_from(&mut buf).unwrap();
        let rtt = t.elapsed();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(from, r.addr(), "the answer comes from the relay");
        assert!(
            rtt >= Duration::from_millis(40),
            "round trip {rtt:?} < 2 x delay"
        );
        // The pacer counts after its send returns, which may be after the echo arrived.
        let t = Instant::now();
        while r.counts().down_bytes < 5 && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let k = r.counts();
        assert_eq!((k.up_bytes, k.down_bytes), (5, 5));
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    /// Clients that take turns through one relay each get their own answers back, and the
    /// server sees each at an address of its own.
    #[test]
    fn each_client_gets_its_own_answers() {
        let (addr, stop, h) = echo();
        let r = Relay::start(addr, LinkSpec::ideal(), 5).unwrap();
        let clients: Vec<UdpSocket> = (0..4).map(|_| client()).collect();
        for round in 0..10u8 {
            for (k, c) in clients.iter().enumerate() {
                c.send_to(&[k as u8, round], r.addr()).unwrap();
            }
        }
        let mut buf = [0u8; 64];
        for (k, c) in clients.iter().enumerate() {
            for round in 0..10u8 {
                let (n, from) = c.recv_from(&mut buf).unwrap();
                assert_eq!(&buf[..n], &[k as u8, round], "client {k}");
                assert_eq!(from, r.addr());
            }
        }
        assert_eq!(r.sessions.lock().unwrap().len(), 4, "a session per client");
        // The pacer counts after its send returns, which may be after the echo arrived.
        let t = Instant::now();
        while r.counts().down_bytes < 80 && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let k = r.counts();
        assert_eq!((k.up_bytes, k.down_bytes), (80, 80));
        drop(r);
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    #[test]
    fn bandwidth_paces_and_loss_drops_about_its_share() {
        let (addr, stop, h) = echo();
        // 100 datagrams of 1000 bytes at 200 kB/s: the echoes take at least 0.5 s to
        // cross the up link.
        let spec = LinkSpec {
            bandwidth: Some(200_000),
            ..LinkSpec::ideal()
        };
        let r = Relay::start(addr, spec, 2).unwrap();
        let c = client();
        let t = Instant::now();
        for _ in 0..100 {
            c.send_to(&[7u8; 1000], r.addr()).unwrap();
        }
        let mut buf = [0u8; 2048];
        for _ in 0..100 {
            c.recv_from(&mut buf).unwrap();
        }
        assert!(
            t.elapsed() >= Duration::from_millis(490),
            "{:?}",
            t.elapsed()
        );
        drop(r);
        let spec = LinkSpec {
            loss: 0.3,
            ..LinkSpec::ideal()
        };
        let r = Relay::start(addr, spec, 3).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        for _ in 0..400 {
            c.send_to(&[1u8; 10], r.addr()).unwrap();
        }
        let mut got = 0;
        while c.recv_from(&mut buf).is_ok() {
            got += 1;
        }
        let k = r.counts();
        // Each echo crosses the link twice: about 0.7^2 = 49% come back.
        assert!((120..280).contains(&got), "{got} of 400 came back");
        // Every datagram was either lost on one of the two crossings or came back.
        assert_eq!(k.lost + k.down_bytes / 10, 400, "accounting: {k:?}");
        assert_eq!(got, k.down_bytes / 10);
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
    }

    /// Two relays whose servers share one bottleneck: their echoes together take the
    /// shared rate's time, and what overflows the one shared queue is dropped and counted.
    #[test]
    fn relays_sharing_a_link_share_its_rate_and_queue() {
        let (a, stop_a, ha) = echo();
        let (b, stop_b, hb) = echo();
        // 2 x 50 datagrams of 1000 bytes come back through 200 kB/s shared: at least 0.5 s,
        // where each relay alone would pass its 50 in 0.25 s.
        let shared = LinkSpec {
            bandwidth: Some(200_000),
            ..LinkSpec::ideal()
        };
        let link = SharedLink::new(&shared).unwrap();
        let ra = Relay::start_shared(a, LinkSpec::ideal(), 1, &link).unwrap();
        let rb = Relay::start_shared(b, LinkSpec::ideal(), 2, &link).unwrap();
        let (ca, cb) = (client(), client());
        let t = Instant::now();
        for _ in 0..50 {
            ca.send_to(&[1u8; 1000], ra.addr()).unwrap();
            cb.send_to(&[2u8; 1000], rb.addr()).unwrap();
        }
        let mut buf = [0u8; 2048];
        for _ in 0..50 {
            ca.recv_from(&mut buf).unwrap();
            cb.recv_from(&mut buf).unwrap();
        }
        assert!(
            t.elapsed() >= Duration::from_millis(490),
            "{:?}",
            t.elapsed()
        );
        drop((ra, rb));
        // A shared queue of 64 KiB at 100 kB/s: 2 x 200 datagrams of 1000 bytes sent at once
        // cannot all wait; every one is either delivered or counted as overflowed.
        let small = LinkSpec {
            bandwidth: Some(100_000),
            queue_bytes: 65_536,
            ..LinkSpec::ideal()
        };
        let link = SharedLink::new(&small).unwrap();
        let ra = Relay::start_shared(a, LinkSpec::ideal(), 3, &link).unwrap();
        let rb = Relay::start_shared(b, LinkSpec::ideal(), 4, &link).unwrap();
        for _ in 0..200 {
            ca.send_to(&[1u8; 1000], ra.addr()).unwrap();
            cb.send_to(&[2u8; 1000], rb.addr()).unwrap();
        }
        let t = Instant::now();
        // Settled: all 200 went up (that way is ideal), and each echo was either delivered
        // or dropped at the shared queue.
        let settled = |r: &Relay| {
            let k = r.counts();
            k.up_bytes == 200_000 && k.down_bytes / 1000 + k.overflowed == 200
        };
        while !(settled(&ra) && settled(&rb)) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (ka, kb) = (ra.counts(), rb.counts());
        assert!(settled(&ra) && settled(&rb), "{ka:?} {kb:?}");
        // About 64 datagrams fit the one queue, whichever relay they came through (a burst
        // from one may take it all: drop-tail).
        assert!(ka.overflowed + kb.overflowed > 0, "{ka:?} {kb:?}");
        assert!(ka.down_bytes + kb.down_bytes > 0, "{ka:?} {kb:?}");
        stop_a.store(true, Ordering::Relaxed);
        stop_b.store(true, Ordering::Relaxed);
        ha.join().unwrap();
        hb.join().unwrap();
    }

    #[test]
    fn nonsense_specs_are_refused() {
        let a: SocketAddr = "127.0.0.1:9".parse().unwrap();
        for s in [
            LinkSpec {
                loss: 1.0,
                ..LinkSpec::ideal()
            },
            LinkSpec {
                bandwidth: Some(0),
                ..LinkSpec::ideal()
            },
            LinkSpec {
                queue_bytes: 100,
                ..LinkSpec::ideal()
            },
            LinkSpec {
                mtu: Some(1000),
                ..LinkSpec::ideal()
            },
        ] {
            assert!(Relay::start(a, s, 0).is_err(), "{s:?}");
        }
    }
}
