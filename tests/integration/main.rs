//! Workspace integration tests, one binary with a module per area.

mod chat;
mod oracle;
mod tiers;
