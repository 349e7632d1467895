//! Swarm membership certificates: a swarm owner's Ed25519 key vouching for one node key until
//! an expiry.
//!
//! A swarm is named by its owner's public key (the *swarm key*). The owner signs one
//! [`Membership`] per node, and every member admits any peer that presents a certificate
//! that is signed by the swarm key, unexpired, and bound to the very key the peer proved in
//! its TLS handshake. No member lists any other member: adding a node is one signature by the
//! owner, removing one is a line in a revocation list (or waiting for its expiry).
//!
//! Time is passed in (seconds since the Unix epoch), so every check can be tested; this
//! module never reads a clock.
//!
//! # Certificate file (version 1, 154 bytes)
//!
//! ```text
//! bytes   0..8    magic b"STORMOMC"
//! bytes   8..10   version, u16 little-endian (1)
//! bytes  10..42   swarm key (the owner's Ed25519 public key)
//! bytes  42..74   node key (the member's Ed25519 public key)
//! bytes  74..82   not before, u64 little-endian, Unix seconds
//! bytes  82..90   expires, u64 little-endian, Unix seconds (the first second it is invalid)
//! bytes  90..154  Ed25519 signature by the swarm key over MEMBERSHIP_CONTEXT || bytes 0..90
//! ```
//!
//! The signature covers every byte before it, magic and version included, so a file edited in
//! any byte fails [`Membership::verify`] with [`MembershipError::BadSignature`] (or does not
//! decode at all). The context string keeps a membership signature from ever being taken for
//! another stormo signature (a manifest signature signs another context), and the other way
//! round.
//!
//! Non-goals: deciding whom to admit (the node passes the swarm key and revocations), and
//! storing revocations (a node key per line in a file the node reads).

use std::collections::HashSet;
use std::fmt;

use crate::keys::{KeyError, PublicKey, SecretKey};

/// The first 8 bytes of a membership certificate.
pub const MEMBERSHIP_MAGIC: [u8; 8] = *b"STORMOMC";
/// The certificate format version.
pub const MEMBERSHIP_VERSION: u16 = 1;
/// The length of a version-1 certificate.
pub const MEMBERSHIP_LEN: usize = 8 + 2 + 32 + 32 + 8 + 8 + 64;
/// Domain separation: what a membership signature signs, before the certificate's bytes.
pub const MEMBERSHIP_CONTEXT: &[u8] = b"stormo swarm membership v1\0";
/// The signed part of a certificate: everything before the signature.
const SIGNED_LEN: usize = MEMBERSHIP_LEN - 64;

/// A swarm owner's statement that one node key belongs to the swarm from `not_before` until
/// `expires` (Unix seconds).
#[derive(Clone, PartialEq, Eq)]
pub struct Membership {
    /// The swarm (its owner's public key), which signed.
    pub swarm: PublicKey,
    /// The member's node key.
    pub node: PublicKey,
    /// The first second the certificate is valid.
    pub not_before: u64,
    /// The first second the certificate is no longer valid.
    pub expires: u64,
    signature: [u8; 64],
}

impl fmt::Debug for Membership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Membership")
            .field("swarm", &self.swarm)
            .field("node", &self.node)
            .field("not_before", &self.not_before)
            .field("expires", &self.expires)
            .finish_non_exhaustive()
    }
}

/// Unix seconds as a UTC date and time, `2026-12-06 18:00:00 UTC`: how certificates' times
/// are shown to people.
pub fn utc_date_time(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    // The inverse of days_from_civil (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Why a certificate could not be signed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum IssueError {
    /// The validity period is empty: it would never be valid.
    #[error(
        "the certificate would never be valid: it expires at {}, not after its start {}",
        utc_date_time(*expires),
        utc_date_time(*not_before)
    )]
    EmptyValidity {
        /// The first valid second asked for.
        not_before: u64,
        /// The expiry asked for.
        expires: u64,
    },
}

/// Why bytes are not a membership certificate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipDecodeError {
    /// Not [`MEMBERSHIP_LEN`] bytes.
    #[error("a membership certificate is {MEMBERSHIP_LEN} bytes; this is {0}")]
    Length(usize),
    /// Bad magic.
    #[error("not a stormo membership certificate (bad magic)")]
    BadMagic,
    /// Unknown version.
    #[error("membership certificate version {0} is not supported (this build reads {MEMBERSHIP_VERSION})")]
    Version(u16),
    /// The swarm or node key is not a valid Ed25519 key.
    #[error("the certificate's {which} key is invalid: {source}")]
    Key {
        /// "swarm" or "node".
        which: &'static str,
        /// The cause.
        #[source]
        source: KeyError,
    },
}

/// Why a certificate does not admit a peer. Each case has its own message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipError {
    /// The certificate is for another swarm.
    #[error("the certificate is for swarm {found}, not this swarm {expected}")]
    WrongSwarm {
        /// The swarm this node belongs to.
        expected: PublicKey,
        /// The swarm the certificate names.
        found: PublicKey,
    },
    /// The signature is not the swarm key's over these bytes: forged, or edited after signing.
    #[error(
        "the certificate's signature is invalid (forged, or edited after the owner signed it)"
    )]
    BadSignature,
    /// The certificate names another node key than the one the peer proved.
    #[error("the certificate is bound to node {certified}, but the peer proved key {proven}")]
    OtherKey {
        /// The key in the certificate.
        certified: PublicKey,
        /// The key the peer proved in its handshake.
        proven: PublicKey,
    },
    /// The node key is on the revocation list.
    #[error("node {node} is revoked")]
    Revoked {
        /// The revoked key.
        node: PublicKey,
    },
    /// Not valid yet.
    #[error(
        "the certificate is not valid before {} (now is {}); is a clock wrong?",
        utc_date_time(*not_before),
        utc_date_time(*now)
    )]
    NotYetValid {
        /// The first valid second.
        not_before: u64,
        /// The time of the check.
        now: u64,
    },
    /// Expired.
    #[error(
        "the certificate expired at {} (now is {})",
        utc_date_time(*expires),
        utc_date_time(*now)
    )]
    Expired {
        /// The expiry.
        expires: u64,
        /// The time of the check.
        now: u64,
    },
}

impl Membership {
    /// The owner of `swarm` (its secret key) admits `node` from `not_before` until `expires`.
    pub fn issue(
        swarm: &SecretKey,
        node: PublicKey,
        not_before: u64,
        expires: u64,
    ) -> Result<Self, IssueError> {
        if expires <= not_before {
            return Err(IssueError::EmptyValidity {
                not_before,
                expires,
            });
        }
        let mut m = Self {
            swarm: swarm.public(),
            node,
            not_before,
            expires,
            signature: [0; 64],
        };
        m.signature = swarm.sign(&signed_message(&m.signed_bytes()));
        Ok(m)
    }

    fn signed_bytes(&self) -> [u8; SIGNED_LEN] {
        let mut b = [0u8; SIGNED_LEN];
        b[..8].copy_from_slice(&MEMBERSHIP_MAGIC);
        b[8..10].copy_from_slice(&MEMBERSHIP_VERSION.to_le_bytes());
        b[10..42].copy_from_slice(self.swarm.as_bytes());
        b[42..74].copy_from_slice(self.node.as_bytes());
        b[74..82].copy_from_slice(&self.not_before.to_le_bytes());
        b[82..90].copy_from_slice(&self.expires.to_le_bytes());
        b
    }

    /// The certificate's bytes (the file's whole content).
    pub fn to_bytes(&self) -> [u8; MEMBERSHIP_LEN] {
        let mut b = [0u8; MEMBERSHIP_LEN];
        b[..SIGNED_LEN].copy_from_slice(&self.signed_bytes());
        b[SIGNED_LEN..].copy_from_slice(&self.signature);
        b
    }

    /// Parses a certificate's bytes (whatever they are: never panics). The signature is
    /// checked by [`Self::verify`].
    pub fn from_bytes(b: &[u8]) -> Result<Self, MembershipDecodeError> {
        if b.len() != MEMBERSHIP_LEN {
            return Err(MembershipDecodeError::Length(b.len()));
        }
        if b[..8] != MEMBERSHIP_MAGIC {
            return Err(MembershipDecodeError::BadMagic);
        }
        let v = u16::from_le_bytes([b[8], b[9]]);
        if v != MEMBERSHIP_VERSION {
            return Err(MembershipDecodeError::Version(v));
        }
        let key = |which, r: std::ops::Range<usize>| {
            let raw: [u8; 32] = b[r]
                .try_into()
                .expect("a 32-byte range of a checked-length buffer");
            PublicKey::from_bytes(&raw)
                .map_err(|source| MembershipDecodeError::Key { which, source })
        };
        let u64_at = |at: usize| {
            u64::from_le_bytes(
                b[at..at + 8]
                    .try_into()
                    .expect("an 8-byte range of a checked-length buffer"),
            )
        };
        Ok(Self {
            swarm: key("swarm", 10..42)?,
            node: key("node", 42..74)?,
            not_before: u64_at(74),
            expires: u64_at(82),
            signature: b[SIGNED_LEN..].try_into().expect("64 bytes"),
        })
    }

    /// Whether this certificate admits the peer that proved `proven` into `swarm` at `now`
    /// (Unix seconds), with `revoked` the node keys the swarm no longer admits. The first
    /// reason found is returned, in this order: another swarm, a bad signature, another
    /// node key, revoked, not yet valid, expired.
    pub fn verify(
        &self,
        swarm: &PublicKey,
        proven: &PublicKey,
        now: u64,
        revoked: &HashSet<PublicKey>,
    ) -> Result<(), MembershipError> {
        if self.swarm != *swarm {
            return Err(MembershipError::WrongSwarm {
                expected: *swarm,
                found: self.swarm,
            });
        }
        if !self
            .swarm
            .verify(&signed_message(&self.signed_bytes()), &self.signature)
        {
            return Err(MembershipError::BadSignature);
        }
        if self.node != *proven {
            return Err(MembershipError::OtherKey {
                certified: self.node,
                proven: *proven,
            });
        }
        if revoked.contains(&self.node) {
            return Err(MembershipError::Revoked { node: self.node });
        }
        if now < self.not_before {
            return Err(MembershipError::NotYetValid {
                not_before: self.not_before,
                now,
            });
        }
        if now >= self.expires {
            return Err(MembershipError::Expired {
                expires: self.expires,
                now,
            });
        }
        Ok(())
    }
}

fn signed_message(signed: &[u8; SIGNED_LEN]) -> Vec<u8> {
    let mut m = Vec::with_capacity(MEMBERSHIP_CONTEXT.len() + SIGNED_LEN);
    m.extend_from_slice(MEMBERSHIP_CONTEXT);
    m.extend_from_slice(signed);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: u64 = 1_800_000_000;

    /// Times in certificate errors are UTC dates, not Unix seconds (issue 60).
    #[test]
    fn certificate_times_print_as_utc_dates() {
        assert_eq!(utc_date_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_date_time(T0), "2027-01-15 08:00:00 UTC");
        assert_eq!(utc_date_time(1_796_580_000), "2026-12-06 18:00:00 UTC");
        assert_eq!(utc_date_time(951_825_599), "2000-02-29 11:59:59 UTC");
        assert!(utc_date_time(u64::MAX).ends_with(" UTC"));
        let e = MembershipError::Expired {
            expires: T0,
            now: T0 + 61,
        };
        assert_eq!(
            e.to_string(),
            "the certificate expired at 2027-01-15 08:00:00 UTC (now is 2027-01-15 08:01:01 UTC)"
        );
        let e = MembershipError::NotYetValid {
            not_before: T0,
            now: T0 - 3600,
        };
        assert!(e.to_string().starts_with(
            "the certificate is not valid before 2027-01-15 08:00:00 UTC (now is 2027-01-15 07:00:00 UTC)"
        ));
        let e = Membership::issue(&owner(), node(), T0, T0).expect_err("empty");
        assert!(
            e.to_string().contains("expires at 2027-01-15 08:00:00 UTC"),
            "{e}"
        );
    }

    fn owner() -> SecretKey {
        SecretKey::from_seed(&[1; 32])
    }
    fn node() -> PublicKey {
        SecretKey::from_seed(&[2; 32]).public()
    }
    fn cert() -> Membership {
        Membership::issue(&owner(), node(), T0, T0 + 30 * 86_400).expect("a valid period")
    }

    /// The exact bytes of a certificate, field by field. The signature is deterministic
    /// (Ed25519), so its bytes are pinned too: a change to the context or the signed range
    /// fails here.
    #[test]
    fn membership_encoding_is_pinned() {
        let b = cert().to_bytes();
        let mut expected = Vec::new();
        expected.extend_from_slice(b"STORMOMC"); // magic
        expected.extend_from_slice(&[0x01, 0x00]); // version 1, LE
        expected.extend_from_slice(owner().public().as_bytes()); // swarm key
        expected.extend_from_slice(node().as_bytes()); // node key
        expected.extend_from_slice(&[0x00, 0xd2, 0x49, 0x6b, 0, 0, 0, 0]); // 1_800_000_000 LE
        expected.extend_from_slice(&[0x00, 0x5f, 0x71, 0x6b, 0, 0, 0, 0]); // + 30 days LE
        assert_eq!(&b[..SIGNED_LEN], &expected[..]);
        assert_eq!(
            hex::encode(&b[..10]),
            "53544f524d4f4d430100",
            "magic and version"
        );
        // The signature over the context and the 90 bytes above, from RFC 8032's
        // deterministic Ed25519 with seed [1; 32].
        let mut msg = MEMBERSHIP_CONTEXT.to_vec();
        msg.extend_from_slice(&expected);
        assert_eq!(&b[SIGNED_LEN..], &owner().sign(&msg)[..]);
        assert_eq!(
            hex::encode(&b[SIGNED_LEN..]),
            PINNED_SIGNATURE,
            "the signature bytes changed: the context or the signed range moved"
        );
        assert_eq!(b.len(), 154);
        assert_eq!(Membership::from_bytes(&b).expect("decodes"), cert());
    }

    /// The pinned certificate's signature.
    const PINNED_SIGNATURE: &str = "d8d93bade95245a6f53fa61a7860acfb5308ae59c5a99acaf4af8048d464061f6087cffb7668519a072d1b9e7f1bd1aa59c1762780cf5f34cfe4d3aecae67903";

    #[test]
    fn a_valid_certificate_admits_its_node_until_it_expires() {
        let c = cert();
        let none = HashSet::new();
        let swarm = owner().public();
        c.verify(&swarm, &node(), T0, &none)
            .expect("valid at its start");
        c.verify(&swarm, &node(), T0 + 30 * 86_400 - 1, &none)
            .expect("valid its last second");
        assert_eq!(
            c.verify(&swarm, &node(), T0 + 30 * 86_400, &none),
            Err(MembershipError::Expired {
                expires: T0 + 30 * 86_400,
                now: T0 + 30 * 86_400
            })
        );
        assert_eq!(
            c.verify(&swarm, &node(), T0 - 1, &none),
            Err(MembershipError::NotYetValid {
                not_before: T0,
                now: T0 - 1
            })
        );
    }

    #[test]
    fn each_refusal_names_its_reason() {
        let c = cert();
        let none = HashSet::new();
        let swarm = owner().public();
        let other_swarm = SecretKey::from_seed(&[9; 32]).public();
        let stranger = SecretKey::from_seed(&[8; 32]).public();
        let errors = [
            c.verify(&other_swarm, &node(), T0, &none).unwrap_err(),
            c.verify(&swarm, &stranger, T0, &none).unwrap_err(),
            c.verify(&swarm, &node(), T0, &HashSet::from([node()]))
                .unwrap_err(),
            c.verify(&swarm, &node(), T0 + 31 * 86_400, &none)
                .unwrap_err(),
        ];
        assert!(matches!(errors[0], MembershipError::WrongSwarm { .. }));
        assert!(matches!(errors[1], MembershipError::OtherKey { .. }));
        assert!(matches!(errors[2], MembershipError::Revoked { .. }));
        assert!(matches!(errors[3], MembershipError::Expired { .. }));
        let msgs: HashSet<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), errors.len(), "{msgs:?}");
    }

    /// A certificate edited anywhere (a later expiry, another node key, a flipped bit) is
    /// refused: it does not decode, or its signature fails.
    #[test]
    fn an_edited_certificate_is_refused() {
        let good = cert().to_bytes();
        let none = HashSet::new();
        let swarm = owner().public();
        for i in 0..MEMBERSHIP_LEN {
            for bit in [0x01u8, 0x80] {
                let mut b = good;
                b[i] ^= bit;
                let Ok(c) = Membership::from_bytes(&b) else {
                    continue;
                };
                let proven = c.node;
                let r = c.verify(&swarm, &proven, T0 + 1, &none);
                assert!(r.is_err(), "byte {i} bit {bit:#x} edited, still admitted");
            }
        }
        // The typical edit: push the expiry a year out.
        let mut b = good;
        b[82..90].copy_from_slice(&(T0 + 365 * 86_400).to_le_bytes());
        let c = Membership::from_bytes(&b).expect("still decodes");
        assert_eq!(
            c.verify(&swarm, &node(), T0 + 100 * 86_400, &none),
            Err(MembershipError::BadSignature)
        );
    }

    #[test]
    fn issuing_an_empty_period_is_refused() {
        assert_eq!(
            Membership::issue(&owner(), node(), T0, T0).unwrap_err(),
            IssueError::EmptyValidity {
                not_before: T0,
                expires: T0
            }
        );
    }

    #[test]
    fn decoding_names_what_is_wrong() {
        let good = cert().to_bytes();
        assert!(matches!(
            Membership::from_bytes(&good[..153]),
            Err(MembershipDecodeError::Length(153))
        ));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Membership::from_bytes(&b),
            Err(MembershipDecodeError::BadMagic)
        ));
        let mut b = good;
        b[8] = 2;
        assert!(matches!(
            Membership::from_bytes(&b),
            Err(MembershipDecodeError::Version(2))
        ));
        let mut b = good;
        b[42..74].copy_from_slice(&[0; 32]); // a small-order point
        b[42] = 1;
        assert!(matches!(
            Membership::from_bytes(&b),
            Err(MembershipDecodeError::Key { which: "node", .. })
        ));
    }

    proptest! {
        /// Hostile bytes never panic the decoder.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Membership::from_bytes(&b);
        }

        /// Bytes of the right length behind the right header never panic decode or verify.
        #[test]
        fn hostile_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 144)) {
            let mut b = b"STORMOMC\x01\x00".to_vec();
            b.extend_from_slice(&body);
            if let Ok(c) = Membership::from_bytes(&b) {
                let node = c.node;
                prop_assert!(c.verify(&owner().public(), &node, T0, &HashSet::new()).is_err());
            }
        }
    }
}
