//! Workspace integration tests, one binary with a module per area.

mod batch;
mod bigger_than_disk;
mod budget;
mod chat;
mod crates;
mod demo;
mod discovery;
mod exec;
mod extra_oracle;
mod faults;
mod hostile;
mod http;
mod http_names;
mod hung;
mod int8;
mod manifests;
mod network;
mod node;
mod oracle;
mod placement;
mod remote;
mod stripe;
mod swarm;
mod synth;
mod tiers;
