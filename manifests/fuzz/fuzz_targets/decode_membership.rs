//! The membership certificate parser and checker on arbitrary bytes: never panics, and what
//! it accepts re-encodes to the same bytes.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use stormo_manifests::membership::{Membership, MEMBERSHIP_MAGIC, MEMBERSHIP_VERSION};

fuzz_target!(|data: &[u8]| {
    // Raw input, and input behind a valid header so the fuzzer reaches the body quickly.
    for bytes in [data.to_vec(), {
        let mut b = MEMBERSHIP_MAGIC.to_vec();
        b.extend_from_slice(&MEMBERSHIP_VERSION.to_le_bytes());
        b.extend_from_slice(data);
        b
    }] {
        if let Ok(m) = Membership::from_bytes(&bytes) {
            assert_eq!(&m.to_bytes()[..], &bytes[..]);
            let (swarm, node) = (m.swarm, m.node);
            let _ = m.verify(&swarm, &node, m.not_before, &HashSet::new());
        }
    }
});
