//! A requester and a responder stepped through whole exchanges, honest and not.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use stormo_wire::*;

use crate::util::*;

fn pair() -> Pair {
    Pair::new(RequestsConfig::default(), ServerConfig::default())
}

fn completed(events: Vec<Event>) -> Completed {
    match <[Event; 1]>::try_from(events) {
        Ok([Event::Completed(c)]) => c,
        Ok([Event::Failed(f)]) => panic!("failed: {}", f.error),
        Err(v) => panic!("{} events instead of 1: {v:?}", v.len()),
    }
}

fn failed(events: Vec<Event>) -> Failed {
    match <[Event; 1]>::try_from(events) {
        Ok([Event::Failed(f)]) => f,
        Ok([Event::Completed(c)]) => panic!("completed {:?}", c.id),
        Err(v) => panic!("{} events instead of 1: {v:?}", v.len()),
    }
}

fn cancels_seen(p: &Pair) -> Vec<RequestId> {
    p.server_saw
        .iter()
        .filter_map(|m| match m {
            Message::Cancel(c) => Some(c.request_id),
            _ => None,
        })
        .collect()
}

#[test]
fn whole_expert_streams_verifies_and_completes() {
    let mut p = pair();
    let data = bytes_of(10_000, 1);
    p.experts.insert(expert(3, 5), data.clone());
    p.chunk = 1500; // wire chunks deliberately not aligned with verification chunks
    let v = Blake3Chunks::of(&data, 4096);
    let checked = v.checked.clone();
    let fetch = Fetch::expert(model(), expert(3, 5), 10_000).verifier(Box::new(v));
    let id = p.client.start(p.now, fetch).unwrap();
    p.advance(Duration::from_millis(3));
    let c = completed(p.run());
    assert_eq!(c.id, id);
    assert_eq!(c.offset, 0);
    assert_eq!(c.bytes, data);
    assert_eq!(c.elapsed, Duration::from_millis(3));
    assert_eq!(
        checked.load(Ordering::Relaxed),
        3,
        "chunks 0, 1 and the short 2"
    );
    assert_eq!(p.client.outstanding(), 0);
    assert_eq!(p.server.active(), 0);
    assert_eq!(p.client.poll_timeout(), None);
}

#[test]
fn range_request_returns_that_range_with_its_offset() {
    let mut p = pair();
    let data = bytes_of(10_000, 2);
    p.experts.insert(expert(0, 0), data.clone());
    let v = Blake3Chunks::of(&data, 4096);
    let range = ByteRange {
        offset: 4096,
        len: 10_000 - 4096,
    };
    let fetch = Fetch::expert(model(), expert(0, 0), 10_000)
        .range(range)
        .priority(Priority::Prefetch)
        .verifier(Box::new(v));
    p.client.start(p.now, fetch).unwrap();
    let c = completed(p.run());
    assert_eq!(c.offset, 4096);
    assert_eq!(c.bytes, data[4096..]);
    let Message::Get(g) = &p.server_saw[0] else {
        panic!("first message is {:?}", p.server_saw[0])
    };
    assert_eq!((g.range, g.priority), (Some(range), Priority::Prefetch));
}

#[test]
fn unaligned_range_with_a_verifier_is_refused_before_sending() {
    let mut p = pair();
    let data = bytes_of(10_000, 2);
    let v = Blake3Chunks::of(&data, 4096);
    let fetch = Fetch::expert(model(), expert(0, 0), 10_000)
        .range(ByteRange {
            offset: 100,
            len: 4000,
        })
        .verifier(Box::new(v));
    assert!(matches!(
        p.client.start(p.now, fetch),
        Err(StartError::Verifier(_))
    ));
    let outside = Fetch::expert(model(), expert(0, 0), 10).range(ByteRange { offset: 5, len: 6 });
    assert!(matches!(
        p.client.start(p.now, outside),
        Err(StartError::BadRange { .. })
    ));
    assert!(p.client.poll_transmit().is_none());
}

#[test]
fn manifest_streams_until_end() {
    let mut p = pair();
    p.manifest = bytes_of(3 * MAX_DATA_LEN + 17, 3);
    p.chunk = MAX_DATA_LEN;
    p.client
        .start(p.now, Fetch::manifest(model(), MAX_MANIFEST_LEN))
        .unwrap();
    let c = completed(p.run());
    assert_eq!(c.bytes, p.manifest);
}

#[test]
fn manifest_over_the_callers_limit_fails_and_is_cancelled() {
    let mut p = pair();
    p.manifest = bytes_of(5000, 4);
    let id = p
        .client
        .start(p.now, Fetch::manifest(model(), 4999))
        .unwrap();
    let f = failed(p.run());
    assert!(
        matches!(f.error, FetchError::OutOfBounds { end: 4999, .. }),
        "{}",
        f.error
    );
    assert_eq!(cancels_seen(&p), vec![id]);
}

#[test]
fn missing_expert_is_not_found() {
    let mut p = pair();
    let id = p
        .client
        .start(p.now, Fetch::expert(model(), expert(9, 9), 10))
        .unwrap();
    let f = failed(p.run());
    assert_eq!(f.id, id);
    match &f.error {
        FetchError::Remote { code, message } => {
            assert_eq!(*code, ErrorCode::NOT_FOUND);
            assert!(message.contains("9:9"), "{message}");
        }
        e => panic!("{e}"),
    }
    assert!(!f.error.is_peer_fault());
}

#[test]
fn range_past_the_end_is_answered_out_of_range() {
    let mut p = pair();
    p.experts.insert(expert(0, 1), bytes_of(100, 5));
    // The client believes the expert is longer than the server's copy.
    let fetch = Fetch::expert(model(), expert(0, 1), 200).range(ByteRange {
        offset: 50,
        len: 100,
    });
    p.client.start(p.now, fetch).unwrap();
    let f = failed(p.run());
    assert!(matches!(
        f.error,
        FetchError::Remote {
            code: ErrorCode::OUT_OF_RANGE,
            ..
        }
    ));
}

#[test]
fn requests_beyond_the_servers_limit_get_busy_not_a_queue() {
    let mut p = Pair::new(
        RequestsConfig::default(),
        ServerConfig { max_concurrent: 2 },
    );
    p.faults.hold = true;
    let ids: Vec<_> = (0..3)
        .map(|e| {
            p.client
                .start(p.now, Fetch::expert(model(), expert(0, e), 10))
                .unwrap()
        })
        .collect();
    let f = failed(p.run());
    assert_eq!(f.id, ids[2]);
    assert!(matches!(
        f.error,
        FetchError::Remote {
            code: ErrorCode::BUSY,
            ..
        }
    ));
    assert_eq!(p.server.active(), 2);
    assert_eq!(p.server.stats().busy, 1);
    // Once a slot frees, a new request is admitted.
    let held = p.held.remove(0);
    p.server.fail(held.id, ErrorCode::INTERNAL, "disk error");
    let f = failed(p.run());
    assert_eq!(f.id, held.id);
    p.client
        .start(p.now, Fetch::expert(model(), expert(0, 7), 10))
        .unwrap();
    assert!(p.run().is_empty(), "admitted and held, not busy");
    assert_eq!(p.server.active(), 2);
}

#[test]
fn client_respects_the_peers_announced_limit() {
    let mut p = pair();
    p.client.set_peer_limits(Limits {
        max_concurrent_requests: 1,
    });
    p.client
        .start(p.now, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    assert_eq!(p.client.capacity(), 0);
    assert_eq!(
        p.client
            .start(p.now, Fetch::expert(model(), expert(0, 1), 10)),
        Err(StartError::AtCapacity {
            outstanding: 1,
            limit: 1
        })
    );
}

#[test]
fn silent_peer_stalls_after_the_idle_timeout_and_is_cancelled() {
    let config = RequestsConfig {
        timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(2),
        max_outstanding: 8,
    };
    let mut p = Pair::new(config, ServerConfig::default());
    p.faults.silent = true;
    let t0 = p.now;
    let id = p
        .client
        .start(p.now, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    assert!(p.run().is_empty());
    assert_eq!(p.client.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    p.advance(Duration::from_millis(1999));
    p.client.handle_timeout(p.now);
    assert!(p.run().is_empty(), "not yet");
    p.advance(Duration::from_millis(1));
    p.client.handle_timeout(p.now);
    let f = failed(p.run());
    assert!(
        matches!(f.error, FetchError::Stalled { received: 0, .. }),
        "{}",
        f.error
    );
    assert_eq!(cancels_seen(&p), vec![id]);
    assert_eq!(p.server.active(), 0, "the cancel freed the server's slot");
    assert_eq!(p.client.poll_timeout(), None);
}

#[test]
fn trickling_peer_hits_the_overall_deadline() {
    let config = RequestsConfig {
        timeout: Duration::from_secs(3),
        idle_timeout: Duration::from_secs(2),
        max_outstanding: 8,
    };
    let mut c = Requests::new(config);
    let mut now = std::time::Instant::now();
    let id = c
        .start(
            now,
            Fetch::expert(model(), expert(0, 0), 100).timeout(Duration::from_secs(3)),
        )
        .unwrap();
    let _get = c.poll_transmit().unwrap();
    for i in 0..5u64 {
        now += Duration::from_secs(1);
        c.handle_timeout(now);
        if c.is_outstanding(id) {
            c.handle_message(
                now,
                Message::Data(Data {
                    request_id: id,
                    offset: i,
                    bytes: Bytes::from_static(b"x"),
                }),
            )
            .unwrap();
        }
    }
    match c.poll_event() {
        Some(Event::Failed(f)) => {
            assert!(
                matches!(f.error, FetchError::TimedOut { received: 2, .. }),
                "{}",
                f.error
            )
        }
        e => panic!("{e:?}"),
    }
    assert!(matches!(c.poll_transmit(), Some(Message::Cancel(_))));
}

/// With `extend_on_progress`, the deadline moves on while chunks keep verifying and passes
/// once a whole timeout goes by without one; without it, the same progress does not help.
#[test]
fn progress_moves_the_deadline_only_when_asked() {
    let data = bytes_of(4 * 1024, 9);
    let config = RequestsConfig {
        timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(5),
        max_outstanding: 8,
    };
    let timeout = Duration::from_secs(3);
    for extend in [true, false] {
        let mut c = Requests::new(config);
        let start = std::time::Instant::now();
        let mut fetch = Fetch::expert(model(), expert(0, 0), data.len() as u64)
            .timeout(timeout)
            .verifier(Box::new(Blake3Chunks::of(&data, 1024)));
        if extend {
            fetch = fetch.extend_on_progress(Duration::from_secs(60));
        }
        let id = c.start(start, fetch).unwrap();
        let _get = c.poll_transmit().unwrap();
        // One 1 KiB chunk every 2 s (verified as it arrives), then half a chunk, then silence
        // but for a byte now and then (the idle timeout never passes).
        let mut events = Vec::new();
        for s in 1..=12u64 {
            let now = start + Duration::from_secs(s);
            let piece = match s {
                2 | 4 | 6 => Some((1024 * (s / 2 - 1), 1024)),
                7 => Some((3072, 512)),
                8..=12 => Some((3584 + (s - 8), 1)),
                _ => None,
            };
            if let (true, Some((at, n))) = (c.is_outstanding(id), piece) {
                let (at, n) = (at as usize, n as usize);
                c.handle_message(
                    now,
                    Message::Data(Data {
                        request_id: id,
                        offset: at as u64,
                        bytes: Bytes::copy_from_slice(&data[at..at + n]),
                    }),
                )
                .unwrap();
            }
            c.handle_timeout(now);
            while let Some(e) = c.poll_event() {
                events.push((s, e));
            }
        }
        let [(at, Event::Failed(f))] = &events[..] else {
            panic!("extend {extend}: {events:?}");
        };
        let FetchError::TimedOut { after, .. } = f.error else {
            panic!("extend {extend}: {}", f.error);
        };
        if extend {
            // Deadlines at 3 s (chunk 0 verified at 2: moved to 6), 6 s (chunks 1 and 2
            // verified: moved to 9), then 9 s: no chunk since, only the half.
            assert_eq!((*at, after), (9, Duration::from_secs(9)));
            assert_eq!(f.verified, &data[..3072]);
        } else {
            assert_eq!((*at, after), (3, timeout));
            assert_eq!(f.verified, &data[..1024]);
        }
    }
}

/// Progress of an unverified ranged request counts from its start (a file range at 1 MiB),
/// and the deadline never moves past the latest one allowed.
#[test]
fn extension_counts_ranged_progress_and_stops_at_its_latest() {
    let config = RequestsConfig {
        timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(5),
        max_outstanding: 8,
    };
    let mut c = Requests::new(config);
    let start = std::time::Instant::now();
    let range = ByteRange {
        offset: 1 << 20,
        len: 100,
    };
    let id = c
        .start(
            start,
            Fetch::file(model(), "model.safetensors", range)
                .timeout(Duration::from_secs(3))
                .extend_on_progress(Duration::from_secs(7)),
        )
        .unwrap();
    let _get = c.poll_transmit().unwrap();
    let mut failed_at = None;
    for s in 1..=10u64 {
        let now = start + Duration::from_secs(s);
        if c.is_outstanding(id) {
            c.handle_message(
                now,
                Message::Data(Data {
                    request_id: id,
                    offset: range.offset + s - 1,
                    bytes: Bytes::from_static(b"x"),
                }),
            )
            .unwrap();
        }
        c.handle_timeout(now);
        if let Some(e) = c.poll_event() {
            failed_at = Some((s, e));
            break;
        }
    }
    // A byte a second: moved at 3 s (to 6) and at 6 s (to 9, capped at 7), then 7 s is
    // the latest.
    match failed_at {
        Some((7, Event::Failed(f))) => assert!(
            matches!(f.error, FetchError::TimedOut { after, received: 7 } if after == Duration::from_secs(7)),
            "{}",
            f.error
        ),
        other => panic!("{other:?}"),
    }
}

/// Parts of frames (reported by the caller) keep a request from stalling; whole silence
/// stalls it, and a request past both of its deadlines is reported stalled.
#[test]
fn partial_frames_keep_a_request_alive_and_silence_is_a_stall() {
    let config = RequestsConfig {
        timeout: Duration::from_secs(100),
        idle_timeout: Duration::from_secs(2),
        max_outstanding: 8,
    };
    for partial in [true, false] {
        let mut c = Requests::new(config);
        let start = std::time::Instant::now();
        let id = c
            .start(start, Fetch::expert(model(), expert(0, 0), 100))
            .unwrap();
        let _get = c.poll_transmit().unwrap();
        let mut stalled_at = None;
        for s in 1..=10u64 {
            let now = start + Duration::from_secs(s);
            if partial && s <= 3 {
                assert!(c.handle_partial(now, id));
            }
            c.handle_timeout(now);
            if let Some(Event::Failed(f)) = c.poll_event() {
                assert!(matches!(f.error, FetchError::Stalled { .. }), "{}", f.error);
                stalled_at = Some(s);
                break;
            }
        }
        assert_eq!(stalled_at, Some(if partial { 5 } else { 2 }));
        assert!(!c.handle_partial(start, id), "no longer outstanding");
    }
    // Both deadlines passed by the time the caller looks: the silence is what it reports.
    let mut c = Requests::new(RequestsConfig {
        timeout: Duration::from_secs(3),
        ..config
    });
    let start = std::time::Instant::now();
    c.start(start, Fetch::expert(model(), expert(0, 0), 100))
        .unwrap();
    c.handle_timeout(start + Duration::from_secs(4));
    match c.poll_event() {
        Some(Event::Failed(f)) => {
            assert!(matches!(f.error, FetchError::Stalled { .. }), "{}", f.error)
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn corrupted_chunk_fails_at_once_and_resumes_from_another_peer() {
    let data = bytes_of(20_000, 6);
    let mut liar = pair();
    liar.experts.insert(expert(1, 1), data.clone());
    liar.faults.corrupt_at = Some(9000); // inside chunk 2 of 4096-byte chunks
    let v = Blake3Chunks::of(&data, 4096);
    let id = liar
        .client
        .start(
            liar.now,
            Fetch::expert(model(), expert(1, 1), 20_000).verifier(Box::new(v)),
        )
        .unwrap();
    let f = failed(liar.run());
    match &f.error {
        FetchError::BadChunk {
            index,
            offset,
            source,
        } => {
            assert_eq!((*index, *offset), (2, 8192));
            assert!(source.to_string().contains("BLAKE3"), "{source}");
        }
        e => panic!("{e}"),
    }
    assert!(f.error.is_peer_fault());
    assert_eq!(f.verified, data[..8192], "the verified prefix is kept");
    assert_eq!(cancels_seen(&liar), vec![id]);
    assert!(
        liar.client.stray_messages() > 0,
        "the rest of the liar's frames arrive after the failure and are dropped"
    );

    let mut honest = pair();
    honest.experts.insert(expert(1, 1), data.clone());
    let resume = f.offset + f.verified.len() as u64;
    let v = Blake3Chunks::of(&data, 4096);
    let fetch = Fetch::expert(model(), expert(1, 1), 20_000)
        .range(ByteRange {
            offset: resume,
            len: 20_000 - resume,
        })
        .verifier(Box::new(v));
    honest.client.start(honest.now, fetch).unwrap();
    let c = completed(honest.run());
    let mut whole = f.verified;
    whole.extend_from_slice(&c.bytes);
    assert_eq!(whole, data);
}

#[test]
fn skipped_frame_is_out_of_order() {
    let mut p = pair();
    p.experts.insert(expert(0, 0), bytes_of(5000, 7));
    p.faults.skip_frame = Some(1);
    p.client
        .start(p.now, Fetch::expert(model(), expert(0, 0), 5000))
        .unwrap();
    let f = failed(p.run());
    assert!(
        matches!(
            f.error,
            FetchError::OutOfOrder {
                expected: 1000,
                got: 2000
            }
        ),
        "{}",
        f.error
    );
    assert!(
        f.verified.is_empty(),
        "nothing is vouched for without a verifier"
    );
}

#[test]
fn data_past_the_requested_range_is_out_of_bounds() {
    let mut p = pair();
    p.experts.insert(expert(0, 0), bytes_of(5000, 8));
    p.faults.ignore_range = true;
    p.chunk = 3000;
    let fetch = Fetch::expert(model(), expert(0, 0), 5000).range(ByteRange {
        offset: 0,
        len: 2500,
    });
    p.client.start(p.now, fetch).unwrap();
    let f = failed(p.run());
    assert!(
        matches!(
            f.error,
            FetchError::OutOfBounds {
                offset: 0,
                len: 3000,
                end: 2500
            }
        ),
        "{}",
        f.error
    );
}

#[test]
fn end_before_the_last_byte_is_truncation() {
    let mut p = pair();
    p.experts.insert(expert(0, 0), bytes_of(5000, 9));
    p.faults.end_after = Some(2);
    p.client
        .start(p.now, Fetch::expert(model(), expert(0, 0), 5000))
        .unwrap();
    let f = failed(p.run());
    assert!(
        matches!(
            f.error,
            FetchError::Truncated {
                received: 2000,
                expected: 5000
            }
        ),
        "{}",
        f.error
    );
}

#[test]
fn several_requests_interleave_and_each_completes() {
    let mut p = pair();
    for e in 0..4 {
        p.experts
            .insert(expert(2, e), bytes_of(3000 + e as usize, e as u64));
    }
    let ids: Vec<_> = (0..4)
        .map(|e| {
            p.client
                .start(p.now, Fetch::expert(model(), expert(2, e), 3000 + e as u64))
                .unwrap()
        })
        .collect();
    let mut events = p.run();
    assert_eq!(events.len(), 4);
    events.sort_by_key(|e| match e {
        Event::Completed(c) => c.id,
        Event::Failed(f) => panic!("{}", f.error),
    });
    for (e, (ev, id)) in events.into_iter().zip(ids).enumerate() {
        let Event::Completed(c) = ev else {
            unreachable!()
        };
        assert_eq!(c.id, id);
        assert_eq!(
            c.resource,
            Resource::Expert {
                model: model(),
                expert: expert(2, e as u16)
            }
        );
        assert_eq!(c.bytes, bytes_of(3000 + e, e as u64));
    }
}

#[test]
fn cancelled_request_frees_both_sides_and_late_data_is_stray() {
    let mut p = pair();
    p.faults.hold = true;
    let id = p
        .client
        .start(p.now, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    assert!(p.run().is_empty());
    assert_eq!(p.server.active(), 1);
    assert!(p.client.cancel(id));
    assert!(!p.client.cancel(id));
    assert!(p.run().is_empty(), "a cancel emits no event");
    assert_eq!(p.server.active(), 0);
    assert_eq!(p.server.stats().cancelled, 1);
    // The server's node learns of it and must stop; complete() is then refused.
    assert!(!p.server.is_active(id));
    assert!(!p.server.complete(id));
    // Data already in flight arrives and is dropped.
    p.client
        .handle_message(
            p.now,
            Message::Data(Data {
                request_id: id,
                offset: 0,
                bytes: Bytes::from_static(b"late"),
            }),
        )
        .unwrap();
    assert_eq!(p.client.stray_messages(), 1);
    assert!(p.client.poll_event().is_none());
}

#[test]
fn server_reports_cancellation_as_an_event() {
    let mut s = Server::new(ServerConfig::default());
    let get = |id| {
        Message::Get(Get {
            request_id: RequestId(id),
            model: model(),
            expert: expert(0, 0),
            range: None,
            priority: Priority::Now,
        })
    };
    s.handle_message(get(4)).unwrap();
    assert!(matches!(s.poll_event(), Some(ServerEvent::Serve(r)) if r.id == RequestId(4)));
    s.handle_message(Message::Cancel(Cancel {
        request_id: RequestId(4),
    }))
    .unwrap();
    assert_eq!(s.poll_event(), Some(ServerEvent::Cancelled(RequestId(4))));
    // A cancel for something not served is ignored.
    s.handle_message(Message::Cancel(Cancel {
        request_id: RequestId(5),
    }))
    .unwrap();
    assert_eq!(s.poll_event(), None);
    assert_eq!(s.poll_transmit(), None);
}

#[test]
fn duplicate_request_id_is_a_bad_request() {
    let mut s = Server::new(ServerConfig::default());
    let get = Message::Get(Get {
        request_id: RequestId(1),
        model: model(),
        expert: expert(0, 0),
        range: None,
        priority: Priority::Now,
    });
    s.handle_message(get.clone()).unwrap();
    s.handle_message(get).unwrap();
    assert_eq!(s.active(), 1);
    match s.poll_transmit() {
        Some(Message::Error(e)) => {
            assert_eq!(
                (e.request_id, e.code),
                (Some(RequestId(1)), ErrorCode::BAD_REQUEST)
            )
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(s.stats().bad, 1);
}

#[test]
fn connection_error_and_loss_fail_everything_outstanding() {
    let mut c = Requests::new(RequestsConfig::default());
    let now = std::time::Instant::now();
    for e in 0..3 {
        c.start(now, Fetch::expert(model(), expert(0, e), 10))
            .unwrap();
    }
    c.handle_message(
        now,
        Message::Error(ErrorMessage::new(
            None,
            ErrorCode::UNSUPPORTED_VERSION,
            "v2 only",
        )),
    )
    .unwrap();
    let mut n = 0;
    while let Some(ev) = c.poll_event() {
        let Event::Failed(f) = ev else {
            panic!("{ev:?}")
        };
        assert!(matches!(
            f.error,
            FetchError::Remote {
                code: ErrorCode::UNSUPPORTED_VERSION,
                ..
            }
        ));
        n += 1;
    }
    assert_eq!(n, 3);
    c.start(now, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    c.connection_lost("peer reset");
    assert!(
        c.poll_transmit().is_none(),
        "nothing left to send on a dead connection"
    );
    let Some(Event::Failed(f)) = c.poll_event() else {
        panic!()
    };
    assert!(f.error.to_string().contains("peer reset"));
    assert_eq!(c.outstanding(), 0);
}

#[test]
fn messages_for_the_other_role_are_protocol_violations() {
    let mut c = Requests::new(RequestsConfig::default());
    let mut s = Server::new(ServerConfig::default());
    let now = std::time::Instant::now();
    let get = Message::Get(Get {
        request_id: RequestId(1),
        model: model(),
        expert: expert(0, 0),
        range: None,
        priority: Priority::Now,
    });
    assert_eq!(c.handle_message(now, get), Err(UnexpectedMessage("Get")));
    let end = Message::End(End {
        request_id: RequestId(1),
    });
    assert_eq!(s.handle_message(end), Err(UnexpectedMessage("End")));
    assert_eq!(
        s.handle_message(Message::Ping(Ping { nonce: 1 })),
        Err(UnexpectedMessage("Ping"))
    );
}

#[test]
fn oversized_frame_is_refused_from_its_length_alone() {
    let mut dec = FrameDecoder::new();
    let announced = (MAX_FRAME_LEN as u32 + 1).to_le_bytes();
    // Only the 4 length bytes arrive: the refusal cannot have waited for (or buffered) a body.
    let mut input = &announced[..];
    assert_eq!(
        dec.decode(&mut input),
        Err(DecodeError::Oversized {
            len: MAX_FRAME_LEN as u64 + 1,
            max: MAX_FRAME_LEN
        })
    );
    assert_eq!(dec.decode(&mut &[0u8][..]), Err(DecodeError::Poisoned));
    // A smaller per-stream limit applies the same way.
    let mut control = FrameDecoder::with_max(64 * 1024);
    let big = encode_frame(&Message::Data(Data {
        request_id: RequestId(0),
        offset: 0,
        bytes: Bytes::from(vec![0; 100_000]),
    }))
    .unwrap();
    assert!(matches!(
        control.decode(&mut &big[..]),
        Err(DecodeError::Oversized { max: 65536, .. })
    ));
}

#[test]
fn stream_ending_mid_frame_is_truncated() {
    let f = encode_frame(&Message::Ping(Ping { nonce: 300 })).unwrap();
    let mut dec = FrameDecoder::new();
    dec.decode(&mut &f[..5]).unwrap();
    assert!(dec.is_mid_frame());
    assert_eq!(
        dec.finish(),
        Err(DecodeError::Truncated { have: 5, need: 7 })
    );
    let mut dec = FrameDecoder::new();
    dec.decode(&mut &f[..2]).unwrap();
    assert_eq!(
        dec.finish(),
        Err(DecodeError::Truncated { have: 2, need: 4 })
    );
    assert_eq!(
        FrameDecoder::new().decode(&mut &[0u8, 0, 0, 0][..]),
        Err(DecodeError::EmptyFrame)
    );
}

#[test]
fn hello_exchange_and_inventory_tracking() {
    let a = NodeId([1; 32]);
    let server = Server::new(ServerConfig { max_concurrent: 3 });
    let hello = Hello {
        version: PROTOCOL_VERSION,
        node: a,
        models: vec![model()],
        limits: server.limits(),
    };
    let frame = encode_frame(&hello.clone().into()).unwrap();
    let msg = FrameDecoder::new()
        .decode(&mut &frame[..])
        .unwrap()
        .unwrap();
    let got = expect_hello(msg, &a).unwrap();
    let mut c = Requests::new(RequestsConfig::default());
    c.set_peer_limits(got.limits);
    assert_eq!(c.capacity(), 3);
    assert_eq!(
        expect_hello(hello.into(), &NodeId([2; 32]))
            .unwrap_err()
            .code(),
        ErrorCode::FORBIDDEN
    );

    let mut held = ExpertSet::new(24, 32).unwrap();
    held.insert(expert(0, 1)).unwrap();
    let inv = Message::Inventory(Inventory {
        model: model(),
        experts: held.clone(),
    });
    let frame = encode_frame(&inv).unwrap();
    let Some(Message::Inventory(got)) = FrameDecoder::new().decode(&mut &frame[..]).unwrap() else {
        panic!()
    };
    let mut view = got.experts;
    view.apply(&InventoryUpdate {
        model: model(),
        added: vec![expert(23, 31)],
        removed: vec![expert(0, 1)],
    })
    .unwrap();
    assert_eq!(view.iter().collect::<Vec<_>>(), vec![expert(23, 31)]);
}

#[test]
fn impossible_sizes_are_refused_not_aborted() {
    let mut c = Requests::new(RequestsConfig::default());
    let now = std::time::Instant::now();
    assert_eq!(
        c.start(now, Fetch::expert(model(), expert(0, 0), u64::MAX)),
        Err(StartError::TooLarge { len: u64::MAX })
    );
    assert_eq!(
        c.start(now, Fetch::expert(model(), expert(0, 0), 0)),
        Err(StartError::EmptyExpert)
    );
    assert!(c.poll_transmit().is_none());
    assert_eq!(c.outstanding(), 0);
}

/// The caller's buffer back from an event, as the `Vec<u8>` it was.
fn vec_of(buffer: Option<Box<dyn RecordBuffer>>) -> Vec<u8> {
    let b: Box<dyn std::any::Any> = buffer.expect("the caller's buffer comes back");
    *b.downcast::<Vec<u8>>().expect("a Vec<u8> went in")
}

#[test]
fn record_streamed_in_odd_pieces_lands_in_the_callers_buffer_bit_for_bit() {
    for sizes in [
        vec![1],
        vec![3, 1, 4, 1, 5],
        vec![7],
        vec![1499],
        vec![4099, 2],
        vec![1 << 20],
    ] {
        let mut p = pair();
        p.stream_pieces = Some(sizes.clone());
        let data = bytes_of(20_000, 11);
        p.experts.insert(expert(2, 2), data.clone());
        p.chunk = 1500;
        let v = Blake3Chunks::of(&data, 4096);
        let checked = v.checked.clone();
        let fetch = Fetch::expert(model(), expert(2, 2), 20_000)
            .verifier(Box::new(v))
            .into_buffer(Box::new(vec![0xAAu8; 20_000]));
        p.client.start(p.now, fetch).unwrap();
        let c = completed(p.run());
        assert!(
            c.bytes.is_empty(),
            "nothing copied beside the buffer ({sizes:?})"
        );
        assert_eq!(vec_of(c.buffer), data, "pieces {sizes:?}");
        assert_eq!(
            checked.load(Ordering::Relaxed),
            5,
            "every chunk verified once"
        );
    }
}

#[test]
fn corrupt_chunk_keeps_only_the_verified_prefix_and_a_retry_resumes_in_the_same_buffer() {
    let data = bytes_of(20_000, 12);
    let mut liar = pair();
    liar.stream_pieces = Some(vec![1000, 333]);
    liar.experts.insert(expert(1, 1), data.clone());
    liar.faults.corrupt_at = Some(9000); // inside chunk 2 of 4096-byte chunks
    let fetch = Fetch::expert(model(), expert(1, 1), 20_000)
        .verifier(Box::new(Blake3Chunks::of(&data, 4096)))
        .into_buffer(Box::new(vec![0u8; 20_000]));
    let id = liar.client.start(liar.now, fetch).unwrap();
    let f = failed(liar.run());
    assert!(
        matches!(
            f.error,
            FetchError::BadChunk {
                index: 2,
                offset: 8192,
                ..
            }
        ),
        "{}",
        f.error
    );
    assert_eq!(f.verified_end, 8192);
    assert!(
        f.verified.is_empty(),
        "the prefix is in the buffer, not copied out"
    );
    assert_eq!(cancels_seen(&liar), vec![id]);
    let buf = vec_of(f.buffer);
    assert_eq!(buf[..8192], data[..8192], "the verified prefix is kept");
    assert_ne!(
        buf[8192..12288],
        data[8192..12288],
        "the corrupt chunk arrived, unverified"
    );

    // Another peer, from the verified end, into the same buffer.
    let mut honest = pair();
    honest.stream_pieces = Some(vec![777]);
    honest.experts.insert(expert(1, 1), data.clone());
    let v = Blake3Chunks::of(&data, 4096);
    let checked = v.checked.clone();
    let fetch = Fetch::expert(model(), expert(1, 1), 20_000)
        .range(ByteRange {
            offset: f.verified_end,
            len: 20_000 - f.verified_end,
        })
        .verifier(Box::new(v))
        .into_buffer(Box::new(buf));
    honest.client.start(honest.now, fetch).unwrap();
    let c = completed(honest.run());
    assert_eq!(c.offset, 8192);
    assert_eq!(checked.load(Ordering::Relaxed), 3, "chunks 2, 3 and 4 only");
    assert_eq!(vec_of(c.buffer), data);
}

#[test]
fn a_buffer_too_short_for_the_range_or_a_manifest_is_refused_before_sending() {
    let mut p = pair();
    let short =
        Fetch::expert(model(), expert(0, 1), 10_000).into_buffer(Box::new(vec![0u8; 9_999]));
    assert!(matches!(
        p.client.start(p.now, short),
        Err(StartError::Buffer(_))
    ));
    let manifest = Fetch::manifest(model(), 1000).into_buffer(Box::new(vec![0u8; 1000]));
    assert!(matches!(
        p.client.start(p.now, manifest),
        Err(StartError::Buffer(_))
    ));
    assert!(p.client.poll_transmit().is_none());
}

#[test]
fn streamed_data_keeps_the_order_and_bounds_rules() {
    let data = bytes_of(10_000, 13);
    let mut p = pair();
    p.stream_pieces = Some(vec![5]);
    p.experts.insert(expert(0, 3), data.clone());
    p.faults.skip_frame = Some(1);
    let fetch =
        Fetch::expert(model(), expert(0, 3), 10_000).into_buffer(Box::new(vec![0u8; 10_000]));
    p.client.start(p.now, fetch).unwrap();
    let f = failed(p.run());
    assert!(
        matches!(
            f.error,
            FetchError::OutOfOrder {
                expected: 1000,
                got: 2000
            }
        ),
        "{}",
        f.error
    );

    let mut p = pair();
    p.stream_pieces = Some(vec![5]);
    p.experts.insert(expert(0, 3), data.clone());
    p.faults.ignore_range = true;
    let fetch = Fetch::expert(model(), expert(0, 3), 10_000)
        .range(ByteRange {
            offset: 0,
            len: 4000,
        })
        .into_buffer(Box::new(vec![0u8; 4000]));
    p.client.start(p.now, fetch).unwrap();
    let c = completed(p.run());
    assert_eq!(
        vec_of(c.buffer),
        data[..4000],
        "completes on its last byte; the rest is stray"
    );
}
