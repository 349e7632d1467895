//! The edges a mutation run (cargo-mutants over `client.rs`, `frame.rs` and `message.rs`)
//! found unguarded: each test pins one boundary or count the protocol depends on, stepped
//! directly through the sans-IO types with an injected clock.

use std::time::{Duration, Instant};

use bytes::Bytes;
use stormo_wire::*;

use stormo_wire::frame::LEN_PREFIX;

use crate::util::*;

fn requests(max_outstanding: u32) -> Requests {
    Requests::new(RequestsConfig {
        timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(5),
        max_outstanding,
    })
}

fn data(id: RequestId, offset: u64, bytes: &[u8]) -> Message {
    Message::Data(Data {
        request_id: id,
        offset,
        bytes: Bytes::copy_from_slice(bytes),
    })
}

fn events(r: &mut Requests) -> Vec<Event> {
    std::iter::from_fn(|| r.poll_event()).collect()
}

fn one_failure(r: &mut Requests) -> Failed {
    match <[Event; 1]>::try_from(events(r)) {
        Ok([Event::Failed(f)]) => f,
        other => panic!("expected one failure: {other:?}"),
    }
}

#[test]
fn ids_and_nodes_print_as_documented() {
    assert_eq!(RequestId(7).to_string(), "#7");
    let n = NodeId([0xab; 32]);
    assert_eq!(n.to_string(), "ab".repeat(32));
    assert_eq!(n.short(), "ab".repeat(5));
    assert_eq!(format!("{n:?}"), format!("NodeId({})", "ab".repeat(5)));
    let f = Fetch::expert(model(), expert(1, 2), 10);
    let s = format!("{f:?}");
    assert!(s.starts_with("Fetch") && s.contains("resource"), "{s}");
    let mut r = requests(4);
    r.start(Instant::now(), f).unwrap();
    let s = format!("{r:?}");
    assert!(
        s.starts_with("Requests") && s.contains("outstanding"),
        "{s}"
    );
}

#[test]
fn outstanding_and_stray_messages_are_counted() {
    let t = Instant::now();
    let mut r = requests(4);
    assert_eq!(r.outstanding(), 0);
    assert_eq!(r.stray_messages(), 0);
    let id = r
        .start(t, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    assert_eq!(r.outstanding(), 1);
    assert!(r.is_outstanding(id));
    assert!(!r.is_outstanding(RequestId(999)));
    let gone = RequestId(999);
    r.handle_message(t, data(gone, 0, b"x")).unwrap();
    r.handle_message(t, Message::End(End { request_id: gone }))
        .unwrap();
    r.handle_message(
        t,
        Message::Error(ErrorMessage::new(Some(gone), ErrorCode::BUSY, "busy")),
    )
    .unwrap();
    assert_eq!(
        r.stray_messages(),
        3,
        "one Data, one End, one Error for no request"
    );
    assert_eq!(r.outstanding(), 1);
}

#[test]
fn the_limit_of_outstanding_requests_is_exact() {
    let t = Instant::now();
    let mut r = requests(2);
    for e in 0..2 {
        r.start(t, Fetch::expert(model(), expert(0, e), 10))
            .unwrap();
    }
    assert_eq!(r.capacity(), 0);
    match r.start(t, Fetch::expert(model(), expert(0, 2), 10)) {
        Err(StartError::AtCapacity {
            outstanding: 2,
            limit: 2,
        }) => {}
        other => panic!("a third request at a limit of 2: {other:?}"),
    }
}

#[test]
fn file_ranges_must_be_non_empty_and_within_the_per_request_limit() {
    let t = Instant::now();
    let mut r = requests(8);
    let file = |len| Fetch::file(model(), "config.json", ByteRange { offset: 0, len });
    assert!(matches!(
        r.start(t, file(0)),
        Err(StartError::BadRange { .. })
    ));
    assert!(matches!(
        r.start(t, file(MAX_FILE_RANGE_LEN + 1)),
        Err(StartError::BadRange { .. })
    ));
    r.start(t, file(1)).expect("one byte");
    r.start(t, file(MAX_FILE_RANGE_LEN))
        .expect("the limit itself");
}

#[test]
fn a_verified_range_must_start_and_end_on_chunk_boundaries_or_at_the_end() {
    let t = Instant::now();
    let record = vec![7u8; 35];
    let mut r = requests(8);
    let ranged = |offset, len| {
        Fetch::expert(model(), expert(0, 0), 35)
            .range(ByteRange { offset, len })
            .verifier(Box::new(Blake3Chunks::of(&record, 10)))
    };
    r.start(t, ranged(10, 20))
        .expect("10..30: both on boundaries");
    r.start(t, ranged(10, 25))
        .expect("10..35: ends at the record's end");
    for (offset, len) in [(5, 25), (10, 15), (5, 30)] {
        assert!(
            matches!(
                r.start(t, ranged(offset, len)),
                Err(StartError::Verifier(_))
            ),
            "{offset}+{len} was accepted"
        );
    }
}

#[test]
fn a_range_is_reserved_by_its_length_not_its_end() {
    // A range near the top of a huge record: its 16 bytes are reserved, not its end offset.
    let t = Instant::now();
    let mut r = requests(8);
    let top = 1u64 << 62;
    r.start(
        t,
        Fetch::expert(model(), expert(0, 0), top + 16).range(ByteRange {
            offset: top,
            len: 16,
        }),
    )
    .expect("16 bytes can be held");
    // And a range that cannot be held is refused with its own length.
    match r.start(
        t,
        Fetch::expert(model(), expert(0, 1), top + (1 << 61)).range(ByteRange {
            offset: 1 << 61,
            len: top,
        }),
    ) {
        Err(StartError::TooLarge { len }) => assert_eq!(len, top),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_empty_data_frame_is_out_of_bounds() {
    let t = Instant::now();
    let mut r = requests(4);
    let id = r
        .start(t, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    r.handle_message(t, data(id, 0, b"")).unwrap();
    let f = one_failure(&mut r);
    assert!(
        matches!(f.error, FetchError::OutOfBounds { len: 0, .. }),
        "{}",
        f.error
    );
}

#[test]
fn an_early_end_reports_the_ranges_own_length() {
    let t = Instant::now();
    let mut r = requests(4);
    let id = r
        .start(
            t,
            Fetch::expert(model(), expert(0, 0), 40).range(ByteRange {
                offset: 10,
                len: 20,
            }),
        )
        .unwrap();
    r.handle_message(t, data(id, 10, &[1; 5])).unwrap();
    r.handle_message(t, Message::End(End { request_id: id }))
        .unwrap();
    let f = one_failure(&mut r);
    assert!(
        matches!(
            f.error,
            FetchError::Truncated {
                received: 5,
                expected: 20
            }
        ),
        "{}",
        f.error
    );
}

#[test]
fn a_failed_verified_range_keeps_only_its_verified_chunks() {
    // From offset 10 (chunk 1), one whole chunk and half the next arrive, then silence: the
    // failure carries the 10 verified bytes, not the 5 unverified ones after them.
    let t = Instant::now();
    let record: Vec<u8> = (0..40).collect();
    let mut r = requests(4);
    let id = r
        .start(
            t,
            Fetch::expert(model(), expert(0, 0), 40)
                .range(ByteRange {
                    offset: 10,
                    len: 30,
                })
                .verifier(Box::new(Blake3Chunks::of(&record, 10))),
        )
        .unwrap();
    r.handle_message(t, data(id, 10, &record[10..25])).unwrap();
    r.handle_timeout(t + Duration::from_secs(1));
    let f = one_failure(&mut r);
    assert!(
        matches!(f.error, FetchError::TimedOut { .. }),
        "{}",
        f.error
    );
    assert_eq!(f.offset, 10);
    assert_eq!(f.verified, record[10..20].to_vec());
}

#[test]
fn the_deadline_of_one_request_is_its_own() {
    let t = Instant::now();
    let mut r = requests(4);
    let id = r
        .start(t, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    assert_eq!(r.poll_timeout_of(id), Some(t + Duration::from_secs(1)));
    assert_eq!(r.poll_timeout_of(RequestId(999)), None);
}

#[test]
fn progress_extends_a_ranged_request_from_its_deadline_not_before() {
    // A range from offset 100 with no verifier: progress is the end of what arrived.
    let t = Instant::now();
    let ms = Duration::from_millis;
    let mut r = requests(4);
    let id = r
        .start(
            t,
            Fetch::expert(model(), expert(0, 0), 1000)
                .range(ByteRange {
                    offset: 100,
                    len: 900,
                })
                .extend_on_progress(Duration::from_secs(10)),
        )
        .unwrap();
    r.handle_message(t + ms(200), data(id, 100, b"x")).unwrap();
    // Before the deadline nothing moves, progress or not.
    r.handle_timeout_of(t + ms(500), id);
    assert_eq!(r.poll_timeout_of(id), Some(t + ms(1000)));
    // At the deadline, one byte of progress earns another timeout from now.
    r.handle_timeout_of(t + ms(1000), id);
    assert!(r.is_outstanding(id), "{:?}", events(&mut r));
    assert_eq!(r.poll_timeout_of(id), Some(t + ms(2000)));
    // Without further progress the next deadline ends it.
    r.handle_timeout_of(t + ms(2000), id);
    let f = one_failure(&mut r);
    assert!(
        matches!(f.error, FetchError::TimedOut { .. }),
        "{}",
        f.error
    );
}

#[test]
fn frame_limits_are_exact() {
    assert_eq!(FrameDecoder::new().max_frame_len(), MAX_FRAME_LEN);
    assert_eq!(FrameDecoder::with_max(1000).max_frame_len(), 1000);
    // A frame body of exactly the limit is taken; one byte less of limit refuses it.
    let frame = encode_frame(&Message::Ping(Ping { nonce: 7 })).unwrap();
    let body = frame.len() - LEN_PREFIX;
    let mut input = &frame[..];
    assert!(matches!(
        FrameDecoder::with_max(body).decode(&mut input),
        Ok(Some(Message::Ping(_)))
    ));
    let mut input = &frame[..];
    assert!(matches!(
        FrameDecoder::with_max(body - 1).decode(&mut input),
        Err(DecodeError::Oversized { .. })
    ));
    // The default limit: a whole Data payload of MAX_DATA_LEN and its header, no more.
    let mut input = &((MAX_FRAME_LEN + 1) as u32).to_le_bytes()[..];
    assert!(matches!(
        FrameDecoder::new().decode(&mut input),
        Err(DecodeError::Oversized { .. })
    ));
    let big = Message::Data(Data {
        request_id: RequestId(1),
        offset: 0,
        bytes: Bytes::from(vec![0u8; MAX_DATA_LEN]),
    });
    let frame = encode_frame(&big).unwrap();
    let mut input = &frame[..];
    assert!(matches!(
        FrameDecoder::new().decode(&mut input),
        Ok(Some(Message::Data(_)))
    ));
}

#[test]
fn the_decoder_knows_when_it_holds_part_of_a_frame() {
    let frame = encode_frame(&Message::Ping(Ping { nonce: 7 })).unwrap();
    let mut d = FrameDecoder::new();
    assert!(!d.is_mid_frame());
    let mut input = &frame[..2];
    assert_eq!(d.decode(&mut input).unwrap(), None);
    assert!(d.is_mid_frame(), "half a length prefix");
    let mut input = &frame[2..LEN_PREFIX + 1];
    assert_eq!(d.decode(&mut input).unwrap(), None);
    assert!(d.is_mid_frame(), "a prefix and part of the body");
    let mut input = &frame[LEN_PREFIX + 1..];
    assert!(d.decode(&mut input).unwrap().is_some());
    assert!(!d.is_mid_frame());
    assert!(d.finish().is_ok());
}

#[test]
fn an_inventory_update_may_name_up_to_its_limit_of_experts() {
    let ids = |n: usize| -> Vec<_> {
        (0..n)
            .map(|i| expert((i / 1024) as u16, (i % 1024) as u16))
            .collect()
    };
    let update = |n| {
        Message::InventoryUpdate(InventoryUpdate {
            model: model(),
            added: ids(n),
            removed: Vec::new(),
        })
    };
    let frame = encode_frame(&update(MAX_UPDATE_EXPERTS)).expect("the limit encodes");
    let mut input = &frame[..];
    assert!(matches!(
        FrameDecoder::new().decode(&mut input),
        Ok(Some(Message::InventoryUpdate(_)))
    ));
    assert!(encode_frame(&update(MAX_UPDATE_EXPERTS + 1)).is_err());
    assert_eq!(
        MAX_UPDATE_EXPERTS,
        16 * 1024,
        "the limit the protocol documents"
    );
}

#[test]
fn codes_data_and_file_names_print_and_check_as_documented() {
    assert_eq!(
        format!("{:?}", ErrorCode::BUSY),
        format!("ErrorCode({}: busy)", ErrorCode::BUSY.0)
    );
    let d = Data {
        request_id: RequestId(3),
        offset: 8,
        bytes: Bytes::from_static(b"abcd"),
    };
    let s = format!("{d:?}");
    assert!(s.contains("Data") && s.contains("len: 4"), "{s}");
    // A file name of exactly the limit is one; one byte more is not.
    assert!(check_file_name(&"a".repeat(MAX_FILE_NAME_LEN)).is_ok());
    assert!(check_file_name(&"a".repeat(MAX_FILE_NAME_LEN + 1)).is_err());
}

#[test]
fn answers_are_routed_by_their_request_id() {
    let id = RequestId(9);
    for m in [
        data(id, 0, b"x"),
        Message::End(End { request_id: id }),
        Message::Cancel(Cancel { request_id: id }),
        Message::Error(ErrorMessage::new(Some(id), ErrorCode::BUSY, "busy")),
    ] {
        assert_eq!(m.request_id(), Some(id), "{}", m.name());
    }
    assert_eq!(Message::Ping(Ping { nonce: 1 }).request_id(), None);
    assert_eq!(
        Message::Error(ErrorMessage::new(None, ErrorCode::BUSY, "busy")).request_id(),
        None
    );
}

#[test]
fn decode_all_takes_every_frame_of_its_input() {
    let mut bytes = encode_frame(&Message::Ping(Ping { nonce: 1 })).unwrap();
    bytes.extend(encode_frame(&Message::Pong(Pong { nonce: 1 })).unwrap());
    let mut out = Vec::new();
    FrameDecoder::new().decode_all(&bytes, &mut out).unwrap();
    assert!(
        matches!(&out[..], [Message::Ping(_), Message::Pong(_)]),
        "{out:?}"
    );
}

#[test]
fn a_buffer_given_to_a_fetch_can_be_taken_back() {
    let mut f = Fetch::expert(model(), expert(0, 0), 10).into_buffer(Box::new(vec![0u8; 10]));
    assert!(f.take_buffer().is_some());
    assert!(f.take_buffer().is_none());
}

#[test]
fn an_empty_expert_range_is_refused() {
    let mut r = requests(4);
    let f = Fetch::expert(model(), expert(0, 0), 10).range(ByteRange { offset: 3, len: 0 });
    assert!(matches!(
        r.start(Instant::now(), f),
        Err(StartError::BadRange { len: 0, .. })
    ));
}

#[test]
fn a_cancelled_request_hands_back_its_buffer_and_verified_end() {
    let t = Instant::now();
    let record: Vec<u8> = (0..40).collect();
    let mut r = requests(4);
    let id = r
        .start(
            t,
            Fetch::expert(model(), expert(0, 0), 40)
                .verifier(Box::new(Blake3Chunks::of(&record, 10)))
                .into_buffer(Box::new(vec![0u8; 40])),
        )
        .unwrap();
    r.handle_message(t, data(id, 0, &record[..15])).unwrap();
    let a = r.cancel_keeping(id).expect("outstanding");
    assert_eq!(a.verified_end, 10);
    let mut b = a.buffer.expect("the buffer comes back");
    assert_eq!(&b.bytes_mut()[..10], &record[..10]);
    assert!(r.cancel_keeping(id).is_none());
    assert_eq!(
        r.poll_transmit().and_then(|m| m.request_id()),
        Some(id),
        "the Get"
    );
    assert!(matches!(r.poll_transmit(), Some(Message::Cancel(_))));
}

#[test]
fn a_data_header_alone_shows_the_peer_is_not_silent() {
    // Streaming: the header of a frame arrives at 3 s, its bytes not yet; the idle deadline
    // (5 s) counts from the header, so at 6 s the request is still waiting.
    let t = Instant::now();
    let s = Duration::from_secs;
    let mut r = Requests::new(RequestsConfig {
        timeout: s(60),
        idle_timeout: s(5),
        max_outstanding: 4,
    });
    let id = r
        .start(t, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    r.handle_piece(
        t + s(3),
        Piece::DataHeader {
            request_id: id,
            offset: 0,
            len: 10,
        },
    )
    .unwrap();
    r.handle_timeout(t + s(6));
    assert!(r.is_outstanding(id), "{:?}", events(&mut r));
    r.handle_timeout(t + s(8));
    assert!(matches!(
        one_failure(&mut r).error,
        FetchError::Stalled { .. }
    ));
}

#[test]
fn data_bytes_past_the_range_are_out_of_bounds_even_without_a_header() {
    let t = Instant::now();
    let mut r = requests(4);
    let id = r
        .start(t, Fetch::expert(model(), expert(0, 0), 10))
        .unwrap();
    r.handle_piece(
        t,
        Piece::DataBytes {
            request_id: id,
            offset: 0,
            bytes: &[1; 12],
            last: true,
        },
    )
    .unwrap();
    assert!(matches!(
        one_failure(&mut r).error,
        FetchError::OutOfBounds { len: 12, .. }
    ));
}

#[test]
fn an_exec_call_may_carry_exactly_its_maximum_of_positions() {
    let hidden = 2880;
    let max = max_positions(hidden);
    assert!(max >= 1);
    let rows = |n: usize| vec![0.5f32; n * hidden];
    assert!(ExecCall::start(RequestId(1), model(), expert(0, 0), &rows(max), hidden).is_ok());
    assert!(matches!(
        ExecCall::start(RequestId(2), model(), expert(0, 0), &rows(max + 1), hidden),
        Err(ExecRequestError::TooMany { .. })
    ));
}

#[test]
fn the_frame_limit_is_one_data_payload_and_64_bytes_of_header() {
    // The limit documented for MAX_FRAME_LEN, stated from MAX_DATA_LEN.
    let limit = MAX_DATA_LEN + 64;
    let mut ok = &(limit as u32).to_le_bytes()[..];
    assert!(matches!(FrameDecoder::new().decode(&mut ok), Ok(None)));
    let mut over = &((limit + 1) as u32).to_le_bytes()[..];
    assert!(matches!(
        FrameDecoder::new().decode(&mut over),
        Err(DecodeError::Oversized { .. })
    ));
}

/// Every piece `decode_streaming` hands out for `input`, and the payload bytes it carried.
fn stream_all(d: &mut FrameDecoder, mut input: &[u8]) -> Result<(usize, usize), DecodeError> {
    let (mut pieces, mut payload) = (0, 0);
    while !input.is_empty() {
        if let Some(p) = d.decode_streaming(&mut input)? {
            pieces += 1;
            if let Piece::DataBytes { bytes, .. } = p {
                payload += bytes.len();
            }
        }
    }
    Ok((pieces, payload))
}

#[test]
fn streaming_takes_a_whole_data_payload_and_counts_a_cut_one_exactly() {
    let big = Message::Data(Data {
        request_id: RequestId(1),
        offset: 0,
        bytes: Bytes::from(vec![3u8; MAX_DATA_LEN]),
    });
    let frame = encode_frame(&big).unwrap();
    let mut d = FrameDecoder::new();
    let (_, payload) = stream_all(&mut d, &frame).expect("a payload of MAX_DATA_LEN streams");
    assert_eq!(payload, MAX_DATA_LEN);
    assert!(d.finish().is_ok());
    // Cut 100 bytes before the end: the stream ended inside the payload, and finish() says
    // how much of the frame arrived.
    let mut d = FrameDecoder::new();
    let cut = frame.len() - 100;
    let (_, payload) = stream_all(&mut d, &frame[..cut]).unwrap();
    assert_eq!(payload, MAX_DATA_LEN - 100);
    match d.finish() {
        Err(DecodeError::Truncated { have, need }) => {
            assert_eq!((have, need), (cut, frame.len()));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_largest_exec_fits_the_exec_frame_limit_of_its_rows_and_64_bytes() {
    assert_eq!(
        MAX_EXEC_FRAME_LEN,
        MAX_EXEC_ROWS_LEN + 64,
        "the documented limit"
    );
    // Rows of exactly MAX_EXEC_ROWS_LEN: 64 positions of 1024 floats.
    let hidden = MAX_EXEC_ROWS_LEN / 4 / 64;
    let rows = vec![1.0f32; 64 * hidden];
    let (_, exec) = ExecCall::start(RequestId(u64::MAX), model(), expert(0, 0), &rows, hidden)
        .expect("the largest call");
    let frame = encode_frame(&Message::Exec(exec)).unwrap();
    let mut input = &frame[..];
    assert!(matches!(
        FrameDecoder::with_max(MAX_EXEC_FRAME_LEN).decode(&mut input),
        Ok(Some(Message::Exec(_)))
    ));
}

#[test]
fn exec_answers_give_back_their_floats_and_name_trailing_bytes() {
    let r = ExecResult::new(RequestId(4), &[1.5, -2.0, f32::MIN_POSITIVE]);
    assert_eq!(r.rows_f32(), vec![1.5, -2.0, f32::MIN_POSITIVE]);
    let s = format!("{r:?}");
    assert!(
        s.contains("ExecResult") && s.contains("rows_len: 12"),
        "{s}"
    );
    let (_, exec) = ExecCall::start(RequestId(5), model(), expert(0, 1), &[0.25; 8], 4).unwrap();
    let s = format!("{exec:?}");
    assert!(s.contains("Exec") && s.contains("positions: 2"), "{s}");
    // Three bytes past the rows the answer announces: named, with their count.
    let mut body = Vec::new();
    Message::ExecResult(r).encode_body(&mut body).unwrap();
    body.extend_from_slice(&[0, 0, 0]);
    match Message::decode_body(Bytes::from(body)) {
        Err(DecodeError::TrailingBytes { extra, .. }) => assert_eq!(extra, 3),
        other => panic!("{other:?}"),
    }
}

/// A window of a record (bytes `offset..offset + len` of it), as one stripe of a record
/// fetched from several peers at once.
#[derive(Debug)]
struct Window {
    offset: u64,
    bytes: Vec<u8>,
}

impl RecordBuffer for Window {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
    fn offset(&self) -> u64 {
        self.offset
    }
}

/// Two requests for the two halves of a record, each into a window of its own, are written
/// and verified at their offsets in their windows; a window that does not cover the range is
/// refused before anything is sent; a bad chunk in the second window leaves the verified
/// end at that chunk, in the resource's offsets.
#[test]
fn windows_of_a_record_are_written_and_verified_at_their_offsets() {
    let t = Instant::now();
    let record: Vec<u8> = (0..40).collect();
    let mut r = requests(4);
    let fetch = |w: Window, offset: u64, len: u64, record: &[u8]| {
        Fetch::expert(model(), expert(0, 0), 40)
            .range(ByteRange { offset, len })
            .verifier(Box::new(Blake3Chunks::of(record, 10)))
            .into_buffer(Box::new(w))
    };
    for (offset, len, w_off, w_len) in [(20, 20, 21, 19), (20, 20, 10, 20), (10, 10, 0, 10)] {
        let w = Window {
            offset: w_off,
            bytes: vec![0; w_len],
        };
        assert!(
            matches!(
                r.start(t, fetch(w, offset, len, &record)),
                Err(StartError::Buffer(_))
            ),
            "window {w_off}+{w_len} for range {offset}+{len}"
        );
    }
    let a = r
        .start(
            t,
            fetch(
                Window {
                    offset: 0,
                    bytes: vec![0; 20],
                },
                0,
                20,
                &record,
            ),
        )
        .unwrap();
    let mut wrong = record.clone();
    wrong[35] ^= 1;
    let b = r
        .start(
            t,
            Fetch::expert(model(), expert(0, 0), 40)
                .range(ByteRange {
                    offset: 20,
                    len: 20,
                })
                .verifier(Box::new(Blake3Chunks::of(&record, 10)))
                .into_buffer(Box::new(Window {
                    offset: 20,
                    bytes: vec![0; 20],
                })),
        )
        .unwrap();
    r.handle_message(t, data(b, 20, &wrong[20..30])).unwrap();
    assert_eq!(r.verified_end(b), Some(30));
    r.handle_message(t, data(a, 0, &record[..20])).unwrap();
    r.handle_message(t, data(b, 30, &wrong[30..40])).unwrap();
    assert_eq!(r.verified_end(b), None, "failed");
    let evs = events(&mut r);
    let mut saw = 0;
    for e in evs {
        match e {
            Event::Completed(c) => {
                assert_eq!(c.id, a);
                let mut w = c.buffer.expect("the window comes back");
                assert_eq!(w.offset(), 0);
                assert_eq!(w.bytes_mut(), &record[..20]);
                saw += 1;
            }
            Event::Failed(f) => {
                assert_eq!(f.id, b);
                assert!(matches!(f.error, FetchError::BadChunk { index: 3, .. }));
                assert_eq!(f.verified_end, 30);
                let mut w = f.buffer.expect("the window comes back");
                assert_eq!(&w.bytes_mut()[..10], &record[20..30]);
                saw += 1;
            }
        }
    }
    assert_eq!(saw, 2);
}
