//! The per-node draws of the placement policy: a fixed 64-bit mix (the same on every node,
//! so every node computes the same key for a peer), the (node, expert, round) lottery tickets
//! and the salts that keep the draws of the policy's decisions apart.

use std::hash::{Hash, Hasher};

pub(super) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(super) fn hash3(a: u64, b: u64, c: u64) -> u64 {
    mix(a ^ mix(b ^ mix(c)))
}

/// A uniform draw in [0, 1) from a hash.
pub(super) fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

pub(super) const SALT_COVER: u64 = 0xC0;
pub(super) const SALT_DEMAND: u64 = 0xDE;
pub(super) const SALT_EVICT: u64 = 0xE7;
pub(super) const SALT_SOURCE: u64 = 0x50;

/// A hasher whose output depends only on the bytes written (integers little-endian), so every
/// node derives the same key from a peer's id.
pub(super) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 = mix(self.0 ^ u64::from_le_bytes(w)) ^ chunk.len() as u64;
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.write(&(n as u64).to_le_bytes());
    }
    fn write_isize(&mut self, n: isize) {
        self.write(&(n as i64).to_le_bytes());
    }
    fn write_u16(&mut self, n: u16) {
        self.write(&n.to_le_bytes());
    }
    fn write_u32(&mut self, n: u32) {
        self.write(&n.to_le_bytes());
    }
    fn write_u64(&mut self, n: u64) {
        self.write(&n.to_le_bytes());
    }
    fn write_u128(&mut self, n: u128) {
        self.write(&n.to_le_bytes());
    }
}

/// The key every node derives from a node id, for the per-node draws.
pub(super) fn node_key<N: Hash>(id: &N) -> u64 {
    let mut h = KeyHasher(0x5354_4f52_4d4f);
    id.hash(&mut h);
    h.finish()
}
