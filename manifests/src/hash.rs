//! Hashes and ids shared by the manifests and the wire protocol: defined in `stormo-ids` (a
//! leaf crate, so `stormo-wire` needs no engine) and re-exported here.

pub use stormo_ids::{ExpertId, Hash, ParseHashError};
