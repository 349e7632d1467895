//! Workspace integration tests, one binary with a module per area.

mod oracle;
mod tiers;
