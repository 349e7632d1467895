//! The HTTP API's connections (`stormo serve --http`): connections that stall or idle are
//! closed, and connections beyond the cap, in all and per client address, get 503. Servers
//! and helpers from `http`; servers listen on 127.0.0.1 (and loopback's other addresses).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::{
    assert_openai_error, connect, parse_response, read_response, request, send, Server,
};

/// Whether the server closed `s` within `within`: the time it took, or `None` if the
/// connection is still open then. What the server sent before closing is returned too.
fn closed_within(s: &mut TcpStream, within: Duration) -> (Option<Duration>, String) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let left = within.saturating_sub(t0.elapsed());
        if left.is_zero() {
            return (None, String::from_utf8_lossy(&got).into_owned());
        }
        s.set_read_timeout(Some(left)).expect("read timeout");
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return (None, String::from_utf8_lossy(&got).into_owned())
            }
            // Reset by the server: closed too.
            Err(_) => break,
        }
    }
    (
        Some(t0.elapsed()),
        String::from_utf8_lossy(&got).into_owned(),
    )
}

/// A regression test for connections held forever: a client that sends nothing, half its
/// headers, half its body, or keeps an idle keep-alive connection loses the connection after
/// the timeout, while the server answers others meanwhile.
#[test]
fn http_closes_connections_that_stall_or_idle() {
    let timeout = Duration::from_secs(1);
    let srv = Server::start_with(2, 256, |c| c.timeout = timeout);
    let a = srv.addr;
    let t0 = Instant::now();
    let silent = connect(a);
    let mut half_head = connect(a);
    half_head
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
        .expect("write");
    let mut half_body = connect(a);
    half_body
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt\": ",
        )
        .expect("write");
    // A keep-alive connection that gets one answer, then sits idle.
    let mut idle = connect(a);
    idle.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("write");
    let (st, text) = read_response(&mut idle);
    assert_eq!(st, 200, "{text}");
    // Served meanwhile.
    let (st, text) = request(a, "GET", "/v1/models", b"");
    assert_eq!(st, 200, "{text}");
    assert!(
        t0.elapsed() < timeout,
        "the test was too slow to check the server answers while others stall"
    );
    let mut stalled = [
        (silent, "a silent connection"),
        (half_head, "half a header block"),
        (half_body, "half a body"),
        (idle, "an idle keep-alive connection"),
    ];
    // Open until the timeout...
    std::thread::sleep(timeout.mul_f64(0.6).saturating_sub(t0.elapsed()));
    for (s, what) in &mut stalled {
        let (closed, sent) = closed_within(s, Duration::from_millis(20));
        assert!(
            closed.is_none() && sent.is_empty(),
            "{what}: closed {:?} after the start, before the timeout: {sent:?}",
            t0.elapsed()
        );
    }
    // ...and closed soon after it.
    for (s, what) in &mut stalled {
        let (closed, sent) = closed_within(s, Duration::from_secs(5));
        assert!(closed.is_some(), "{what}: still open 5 s past the timeout");
        if *what == "half a body" {
            let (st, body) = parse_response(&sent);
            let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {sent}"));
            assert_openai_error(st, &v, 408, "invalid_request_error", what);
        } else {
            assert!(sent.is_empty(), "{what}: {sent}");
        }
    }
    let (st, text) = request(a, "GET", "/v1/models", b"");
    assert_eq!(st, 200, "{text}");
}

/// A regression test for file descriptors used up by idle connections: past the cap a
/// connection is answered 503 at once, and a slot is free again when a connection closes or
/// times out.
#[test]
fn http_answers_503_beyond_the_connection_cap() {
    let timeout = Duration::from_secs(3);
    let cap = 4;
    let start = || {
        Server::start_with(2, 256, |c| {
            c.timeout = timeout;
            c.max_connections = cap;
        })
    };
    let srv = start();
    let mut a = srv.addr;
    let busy = |a, what: &str| {
        let (st, text) = request(a, "GET", "/v1/models", b"");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_openai_error(st, &v, 503, "server_error", what);
        assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    };
    let free_again = |a, what: &str, within: Duration| {
        let t0 = Instant::now();
        loop {
            let (st, text) = request(a, "GET", "/v1/models", b"");
            if st == 200 {
                return t0.elapsed();
            }
            assert_eq!(st, 503, "{what}: {text}");
            assert!(t0.elapsed() < within, "{what}: still 503 after {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // Held open, then closed by the client.
    let t0 = Instant::now();
    let held: Vec<TcpStream> = (0..cap).map(|_| connect(a)).collect();
    busy(a, "one connection past the cap");
    busy(a, "another");
    drop(held);
    free_again(
        a,
        "after the held connections closed",
        Duration::from_secs(5),
    );
    assert!(
        t0.elapsed() < timeout,
        "the slots were freed by the timeout, not by the clients closing (or the test was slow)"
    );
    // Held open until the server times them out: on a server of its own, so that none of
    // the connections above, closed but perhaps not yet counted out, takes a slot from these.
    let srv2 = start();
    a = srv2.addr;
    let mut held: Vec<TcpStream> = (0..cap).map(|_| connect(a)).collect();
    busy(a, "past the cap again");
    let waited = free_again(
        a,
        "after the held connections timed out",
        Duration::from_secs(9),
    );
    assert!(waited >= timeout.mul_f64(0.5), "freed after {waited:?}");
    for s in &mut held {
        let (closed, _) = closed_within(s, Duration::from_secs(1));
        assert!(
            closed.is_some(),
            "a held connection is still open after the timeout"
        );
    }
}

/// One address cannot take every connection slot: past `--http-max-per-client` its
/// connections are answered 503 (`too_many_connections_from_client`) while other addresses
/// are still served, and a slot of its own is free again when one of its connections closes.
#[test]
fn http_answers_503_beyond_the_per_client_cap() {
    let timeout = Duration::from_secs(10);
    let per_client = 3;
    let srv = Server::start_with(2, 256, |c| {
        c.timeout = timeout;
        c.max_connections = 16;
        c.max_per_client = per_client;
    });
    let a = srv.addr;
    let busy = |what: &str| {
        let (st, text) = request(a, "GET", "/v1/models", b"");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_openai_error(st, &v, 503, "server_error", what);
        assert_eq!(
            v["error"]["code"], "too_many_connections_from_client",
            "{v}"
        );
    };
    let t0 = Instant::now();
    let mut held: Vec<TcpStream> = (0..per_client).map(|_| connect(a)).collect();
    busy("one connection past the per-client cap");
    // The refusal has the header a client backs off by.
    let mut s = connect(a);
    send(&mut s, "GET", "/v1/models", b"");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read the refusal");
    assert!(
        raw.starts_with("HTTP/1.1 503") && raw.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{raw}"
    );
    // The held connections are served, not merely queued (keep-alive: each stays held).
    for s in &mut held {
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .expect("write");
        let (st, text) = read_response(s);
        assert_eq!(st, 200, "a held connection: {text}");
    }
    busy("past the per-client cap while the held ones are in use");
    // Another address is not counted with this one (Linux routes all of 127/8 to loopback).
    #[cfg(target_os = "linux")]
    {
        let other = connect_from("127.0.0.2".parse().expect("ip"), a);
        let mut others = vec![other];
        others.push(connect_from("127.0.0.2".parse().expect("ip"), a));
        for s in &mut others {
            s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .expect("write");
            let (st, text) = read_response(s);
            assert_eq!(st, 200, "another address: {text}");
        }
        busy("127.0.0.1 still past its cap");
    }
    // Closing one held connection frees one slot of this address; it may take the server a
    // moment to see the close, so poll rather than sleep.
    drop(held.pop());
    let freed = Instant::now();
    let mut s = loop {
        let mut s = connect(a);
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .expect("write");
        let (st, text) = read_response(&mut s);
        if st == 200 {
            break s;
        }
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(
            v["error"]["code"], "too_many_connections_from_client",
            "{v}"
        );
        assert!(
            freed.elapsed() < Duration::from_secs(5),
            "still refused 5 s after a held connection closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Exactly one slot was freed: with the new connection held too, the cap holds again.
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("write");
    let (st, text) = read_response(&mut s);
    assert_eq!(st, 200, "the new connection stays served: {text}");
    busy("past the per-client cap again");
    assert!(
        t0.elapsed() < timeout,
        "the slot was freed by the timeout, not by the client closing (or the test was slow)"
    );
    drop((held, s));
}

/// A connection to `to` from the local address `from` (one of loopback's others).
#[cfg(target_os = "linux")]
fn connect_from(from: std::net::IpAddr, to: SocketAddr) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(SocketAddr::new(from, 0))
            .unwrap_or_else(|e| panic!("binding {from}: {e}"));
        tokio::time::timeout(Duration::from_secs(5), sock.connect(to))
            .await
            .expect("connect in time")
            .expect("connect")
    });
    let s = s.into_std().expect("a std stream");
    s.set_nonblocking(false).expect("blocking");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    s
}
