//! Property tests: round trips, the decoder on arbitrary bytes split anywhere, reassembly.

use std::time::Instant;

use bytes::Bytes;
use proptest::prelude::*;
use stormo_ids::{ExpertId, Hash};
use stormo_wire::*;

use crate::util::{bytes_of, model, Blake3Chunks};

fn hash() -> impl Strategy<Value = Hash> {
    any::<[u8; 32]>().prop_map(Hash)
}

fn expert_id() -> impl Strategy<Value = ExpertId> {
    (any::<u16>(), any::<u16>()).prop_map(|(layer, expert)| ExpertId { layer, expert })
}

fn rid() -> impl Strategy<Value = RequestId> {
    any::<u64>().prop_map(RequestId)
}

fn expert_set() -> impl Strategy<Value = ExpertSet> {
    (1u16..40, 1u16..200, any::<u64>()).prop_map(|(layers, epl, seed)| {
        let mut s = ExpertSet::new(layers, epl).unwrap();
        let mut x = seed | 1;
        for l in 0..layers {
            for e in 0..epl {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if x % 3 == 0 {
                    s.insert(ExpertId {
                        layer: l,
                        expert: e,
                    })
                    .unwrap();
                }
            }
        }
        s
    })
}

/// Any valid message.
fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<u32>(),
            any::<[u8; 32]>(),
            prop::collection::vec(hash(), 0..5),
            1u32..
        )
            .prop_map(|(version, node, models, m)| Message::Hello(Hello {
                version,
                node: NodeId(node),
                models,
                limits: Limits {
                    max_concurrent_requests: m
                },
            })),
        (hash(), expert_set())
            .prop_map(|(model, experts)| Message::Inventory(Inventory { model, experts })),
        (hash(), expert_set())
            .prop_map(|(model, experts)| Message::Offer(Offer { model, experts })),
        (
            hash(),
            prop::collection::vec(expert_id(), 0..20),
            prop::collection::vec(expert_id(), 0..20)
        )
            .prop_map(|(model, added, removed)| Message::InventoryUpdate(
                InventoryUpdate {
                    model,
                    added,
                    removed
                }
            )),
        (
            rid(),
            hash(),
            expert_id(),
            prop::option::of((0u64..u64::MAX / 2, 1u64..u64::MAX / 2)),
            any::<bool>()
        )
            .prop_map(|(request_id, model, expert, r, p)| Message::Get(Get {
                request_id,
                model,
                expert,
                range: r.map(|(offset, len)| ByteRange { offset, len }),
                priority: if p { Priority::Prefetch } else { Priority::Now },
            })),
        (
            rid(),
            0u64..u64::MAX / 2,
            prop::collection::vec(any::<u8>(), 1..3000)
        )
            .prop_map(|(request_id, offset, bytes)| Message::Data(Data {
                request_id,
                offset,
                bytes: bytes.into()
            })),
        rid().prop_map(|request_id| Message::End(End { request_id })),
        (rid(), hash()).prop_map(|(request_id, model)| Message::GetManifest(GetManifest {
            request_id,
            model
        })),
        rid().prop_map(|request_id| Message::Cancel(Cancel { request_id })),
        any::<u64>().prop_map(|nonce| Message::Ping(Ping { nonce })),
        any::<u64>().prop_map(|nonce| Message::Pong(Pong { nonce })),
        (prop::option::of(rid()), any::<u16>(), ".{0,40}").prop_map(|(id, code, message)| {
            Message::Error(ErrorMessage::new(id, ErrorCode(code), message))
        }),
        // Any f32 bit pattern, NaNs included: rows are data.
        (
            rid(),
            hash(),
            expert_id(),
            1..=MAX_EXEC_POSITIONS,
            1usize..24,
            any::<u64>()
        )
            .prop_map(|(request_id, model, expert, positions, hidden, seed)| {
                let rows = bit_floats(positions as usize * hidden, seed);
                Message::Exec(Exec::new(request_id, model, expert, positions, &rows))
            }),
        (rid(), 1usize..3000, any::<u64>()).prop_map(|(request_id, n, seed)| {
            Message::ExecResult(ExecResult::new(request_id, &bit_floats(n, seed)))
        }),
    ]
}

/// `n` floats of arbitrary bit patterns from `seed`.
fn bit_floats(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            f32::from_bits(x as u32)
        })
        .collect()
}

/// Feeds `wire` to a fresh decoder cut at `cuts` (positions, any order, may repeat). Returns the
/// messages and the first error.
fn decode_split(wire: &[u8], cuts: &[usize]) -> (Vec<Message>, Option<DecodeError>) {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c % (wire.len() + 1)).collect();
    cuts.push(0);
    cuts.push(wire.len());
    cuts.sort_unstable();
    let mut dec = FrameDecoder::new();
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        if let Err(e) = dec.decode_all(&wire[w[0]..w[1]], &mut out) {
            return (out, Some(e));
        }
    }
    (out, dec.finish().err())
}

/// [`decode_split`] through [`FrameDecoder::decode_streaming`], each Data frame put together
/// again from its header and payload pieces (which must tile it in order).
fn stream_split(wire: &[u8], cuts: &[usize]) -> (Vec<Message>, Option<DecodeError>) {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c % (wire.len() + 1)).collect();
    cuts.push(0);
    cuts.push(wire.len());
    cuts.sort_unstable();
    let mut dec = FrameDecoder::new();
    let mut out = Vec::new();
    let mut data: Option<(RequestId, u64, u64, Vec<u8>)> = None;
    for w in cuts.windows(2) {
        let mut input = &wire[w[0]..w[1]];
        while !input.is_empty() {
            match dec.decode_streaming(&mut input) {
                Err(e) => return (out, Some(e)),
                Ok(None) => {}
                Ok(Some(Piece::Message(m))) => {
                    assert!(data.is_none(), "a message inside a Data frame");
                    out.push(m);
                }
                Ok(Some(Piece::DataHeader {
                    request_id,
                    offset,
                    len,
                })) => {
                    assert!(data.is_none(), "a header inside a Data frame");
                    data = Some((request_id, offset, len, Vec::new()));
                }
                Ok(Some(Piece::DataBytes {
                    request_id,
                    offset,
                    bytes,
                    last,
                })) => {
                    let (id, at, len, buf) = data.as_mut().expect("bytes after a header");
                    assert_eq!((request_id, offset), (*id, *at + buf.len() as u64));
                    assert!(!bytes.is_empty());
                    buf.extend_from_slice(bytes);
                    assert!(buf.len() as u64 <= *len);
                    assert_eq!(last, buf.len() as u64 == *len);
                    if last {
                        let (request_id, offset, _, buf) = data.take().expect("just used");
                        out.push(Message::Data(Data {
                            request_id,
                            offset,
                            bytes: buf.into(),
                        }));
                    }
                }
            }
        }
    }
    (out, dec.finish().err())
}

/// The streaming decoder against the whole-frame one on the same input: the same messages,
/// and the same error, except that a bad Data header is refused at once, where the
/// whole-frame decoder may first see the stream end inside that frame.
fn same_as_whole(wire: &[u8], cuts: &[usize]) -> Result<(), TestCaseError> {
    let (wm, we) = decode_split(wire, &[]);
    let (sm, se) = stream_split(wire, cuts);
    prop_assert_eq!(wm, sm);
    match (we, se) {
        (Some(DecodeError::Truncated { .. }), Some(_)) => {}
        (we, se) => prop_assert_eq!(we, se),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn streaming_decoder_agrees_on_valid_messages(
        msgs in prop::collection::vec(message(), 1..8),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut wire = Vec::new();
        for m in &msgs {
            append_frame(m, &mut wire).unwrap();
        }
        let (got, err) = stream_split(&wire, &cuts);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, msgs);
    }

    #[test]
    fn streaming_decoder_agrees_on_random_and_mutated_bytes(
        body in prop::collection::vec(any::<u8>(), 0..600),
        m in message(),
        pos in any::<usize>(),
        byte in any::<u8>(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut wire = (body.len() as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&body);
        same_as_whole(&wire, &cuts)?;
        same_as_whole(&body, &cuts)?;
        // A Data frame's header (tag 4) with random fields after it.
        if !body.is_empty() {
            let mut data = body.clone();
            data[0] = 4;
            let mut w = (data.len() as u32).to_le_bytes().to_vec();
            w.extend_from_slice(&data);
            same_as_whole(&w, &cuts)?;
        }
        let mut wire = encode_frame(&m).unwrap();
        let p = pos % wire.len();
        wire[p] = byte;
        same_as_whole(&wire, &cuts)?;
    }

    #[test]
    fn messages_round_trip_through_any_split(
        msgs in prop::collection::vec(message(), 1..8),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut wire = Vec::new();
        for m in &msgs {
            append_frame(m, &mut wire).unwrap();
        }
        let (got, err) = decode_split(&wire, &cuts);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, msgs);
    }

    /// Arbitrary bytes: no panic, and the outcome does not depend on where the input is cut.
    #[test]
    fn decoder_survives_random_bytes_split_anywhere(
        body in prop::collection::vec(any::<u8>(), 0..600),
        small_len in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        // Half the cases get a plausible length prefix so bodies are reached, not just refused.
        let wire = if small_len && !body.is_empty() {
            let mut w = (body.len() as u32).to_le_bytes().to_vec();
            w.extend_from_slice(&body);
            w
        } else {
            body
        };
        let whole = decode_split(&wire, &[]);
        let split = decode_split(&wire, &cuts);
        prop_assert_eq!(&whole, &split);
        // Whatever decoded is a valid message that encodes again and decodes to itself.
        for m in whole.0 {
            let f = encode_frame(&m).unwrap();
            let (again, err) = decode_split(&f, &[]);
            prop_assert_eq!(err, None);
            prop_assert_eq!(again, vec![m]);
        }
    }

    /// Valid frames with one byte changed: still no panic, same outcome for any split.
    #[test]
    fn decoder_survives_mutated_frames(
        m in message(),
        pos in any::<usize>(),
        byte in any::<u8>(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        let mut wire = encode_frame(&m).unwrap();
        let p = pos % wire.len();
        wire[p] = byte;
        prop_assert_eq!(decode_split(&wire, &[]), decode_split(&wire, &cuts));
    }

    /// Any wire chunking and verification chunking reassemble the exact bytes; a flipped byte
    /// fails exactly the chunk that holds it.
    #[test]
    fn reassembly_and_verification(
        len in 1usize..20_000,
        vchunk in 1usize..5000,
        wchunk in 1usize..5000,
        flip in prop::option::of(any::<usize>()),
        seed in any::<u64>(),
    ) {
        let data = bytes_of(len, seed);
        let v = Blake3Chunks::of(&data, vchunk);
        let now = Instant::now();
        let mut c = Requests::new(RequestsConfig::default());
        let id = c.start(now, Fetch::expert(model(), ExpertId { layer: 0, expert: 0 }, len as u64)
            .verifier(Box::new(v))).unwrap();
        let mut sent = data.to_vec();
        if let Some(f) = flip {
            sent[f % len] ^= 1;
        }
        for m in DataChunks::new(id, 0, Bytes::from(sent), wchunk) {
            c.handle_message(now, m).unwrap();
        }
        match (c.poll_event(), flip) {
            (Some(Event::Completed(done)), None) => prop_assert_eq!(done.bytes, data.to_vec()),
            (Some(Event::Failed(f)), Some(at)) => {
                let bad = (at % len / vchunk) as u64;
                match f.error {
                    FetchError::BadChunk { index, .. } => prop_assert_eq!(index, bad),
                    e => prop_assert!(false, "{}", e),
                }
                prop_assert_eq!(f.verified.len() as u64, bad * vchunk as u64);
                prop_assert_eq!(&f.verified[..], &data[..f.verified.len()]);
            }
            (e, flip) => prop_assert!(false, "{:?} with flip {:?}", e, flip),
        }
        prop_assert!(c.poll_event().is_none());
    }
}
