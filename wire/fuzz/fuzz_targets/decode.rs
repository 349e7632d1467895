//! Feeds arbitrary bytes, cut at arbitrary points, to the frame decoder, and every message that
//! decodes to both protocol state machines and to an exec call's answer check. Checks: no
//! panic; the outcome does not depend on the cut points; every decoded message re-encodes and
//! decodes to itself; an exec answer passes only with exactly the rows asked for.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use stormo_ids::{ExpertId, Hash};
use stormo_wire::{
    check_shape, encode_frame, ByteRange, DecodeError, ExecCall, Fetch, FrameDecoder, Message,
    RequestId, Requests, RequestsConfig, Server, ServerConfig,
};

fn decode(data: &[u8], step: usize) -> (Vec<Message>, Option<DecodeError>) {
    let mut dec = FrameDecoder::new();
    let mut out = Vec::new();
    for piece in data.chunks(step.max(1)) {
        if let Err(e) = dec.decode_all(piece, &mut out) {
            return (out, Some(e));
        }
    }
    (out, dec.finish().err())
}

fuzz_target!(|input: &[u8]| {
    let Some((&step, data)) = input.split_first() else {
        return;
    };
    let whole = decode(data, data.len());
    let split = decode(data, step as usize);
    assert_eq!(whole, split, "outcome depends on where the input is cut");

    let now = Instant::now();
    let mut client = Requests::new(RequestsConfig::default());
    let model = Hash::of(b"fuzz");
    for e in 0..4 {
        let _ = client.start(
            now,
            Fetch::expert(
                model,
                ExpertId {
                    layer: 0,
                    expert: e,
                },
                4096,
            ),
        );
    }
    let _ = client.start(now, Fetch::manifest(model, 1 << 16));
    // A file range in flight too, so GetFile answers (data, errors, ends) reach the client.
    let _ = client.start(
        now,
        Fetch::file(
            model,
            "model.safetensors",
            ByteRange {
                offset: 0,
                len: 1 << 20,
            },
        ),
    );
    let mut server = Server::new(ServerConfig { max_concurrent: 2 });
    // An exec call in flight, judging every message as its answer; and every decoded Exec
    // checked against a responder's row width.
    let (call, _) = ExecCall::start(
        RequestId(8),
        model,
        ExpertId {
            layer: 0,
            expert: 0,
        },
        &[0.0; 8],
        4,
    )
    .expect("a valid call");
    for m in whole.0 {
        if let Ok(rows) = call.answer(m.clone()) {
            assert_eq!(rows.len(), 8, "an answer of another length passed");
        }
        if let Message::Exec(e) = &m {
            let _ = check_shape(e, 4);
            let _ = check_shape(e, 2880);
        }
        let again = encode_frame(&m).expect("a decoded message encodes");
        assert_eq!(decode(&again, again.len()), (vec![m.clone()], None));
        let _ = client.handle_message(now, m.clone());
        let _ = server.handle_message(m);
    }
    client.handle_timeout(now + Duration::from_secs(3600));
    while client.poll_event().is_some() {}
    while client.poll_transmit().is_some() {}
    while server.poll_event().is_some() {}
    while server.poll_transmit().is_some() {}
});
