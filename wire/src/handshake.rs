//! Checking a peer's [`Hello`] against what its TLS handshake proved.

use crate::message::{ErrorCode, ErrorMessage, Hello, Message, NodeId};
use crate::PROTOCOL_VERSION;

/// Why a peer's [`Hello`] is refused. Send [`HelloError::to_message`] and close the connection
/// with [`HelloError::code`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HelloError {
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {theirs}, this node speaks {ours}")]
    UnsupportedVersion {
        /// This node's version.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The node id in the Hello is not the key the TLS handshake authenticated.
    #[error("peer claims node id {claimed} but authenticated as {authenticated}")]
    IdentityMismatch {
        /// The id in the Hello.
        claimed: NodeId,
        /// The key TLS proved.
        authenticated: NodeId,
    },
    /// The first message on the control stream was not a Hello.
    #[error("expected Hello first, got {0}")]
    NotHello(&'static str),
}

impl HelloError {
    /// The code to answer and close with.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::UnsupportedVersion { .. } => ErrorCode::UNSUPPORTED_VERSION,
            Self::IdentityMismatch { .. } => ErrorCode::FORBIDDEN,
            Self::NotHello(_) => ErrorCode::PROTOCOL_VIOLATION,
        }
    }

    /// The connection-level error message to send before closing.
    pub fn to_message(&self) -> ErrorMessage {
        ErrorMessage::new(None, self.code(), self.to_string())
    }
}

/// Takes the first message of a peer's control stream: it must be a [`Hello`] that passes
/// [`Hello::check`].
pub fn expect_hello(msg: Message, authenticated: &NodeId) -> Result<Hello, HelloError> {
    match msg {
        Message::Hello(h) => {
            h.check(authenticated)?;
            Ok(h)
        }
        other => Err(HelloError::NotHello(other.name())),
    }
}

impl Hello {
    /// Checks a peer's Hello: the same [`PROTOCOL_VERSION`], and the node id that TLS
    /// authenticated (`authenticated`: the peer's Ed25519 public key from its certificate).
    pub fn check(&self, authenticated: &NodeId) -> Result<(), HelloError> {
        if self.version != PROTOCOL_VERSION {
            return Err(HelloError::UnsupportedVersion {
                ours: PROTOCOL_VERSION,
                theirs: self.version,
            });
        }
        if &self.node != authenticated {
            return Err(HelloError::IdentityMismatch {
                claimed: self.node,
                authenticated: *authenticated,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Limits;

    fn hello(version: u32, node: u8) -> Hello {
        Hello {
            version,
            node: NodeId([node; 32]),
            models: vec![],
            limits: Limits {
                max_concurrent_requests: 4,
            },
        }
    }

    #[test]
    fn version_and_identity_are_checked() {
        let me = NodeId([1; 32]);
        hello(PROTOCOL_VERSION, 1).check(&me).unwrap();
        let e = hello(PROTOCOL_VERSION + 1, 1).check(&me).unwrap_err();
        assert_eq!(e.code(), ErrorCode::UNSUPPORTED_VERSION);
        assert_eq!(e.to_message().request_id, None);
        assert!(e.to_string().contains("version 3"), "{e}");
        let e = hello(PROTOCOL_VERSION, 2).check(&me).unwrap_err();
        assert_eq!(e.code(), ErrorCode::FORBIDDEN);
        let e = expect_hello(Message::Ping(crate::Ping { nonce: 0 }), &me).unwrap_err();
        assert_eq!(e, HelloError::NotHello("Ping"));
        assert_eq!(
            expect_hello(hello(PROTOCOL_VERSION, 1).into(), &me)
                .unwrap()
                .node,
            me
        );
    }
}
