//! Workspace integration tests, one binary with a module per area.

mod chat;
mod extra_oracle;
mod http;
mod manifests;
mod network;
mod oracle;
mod synth;
mod tiers;
