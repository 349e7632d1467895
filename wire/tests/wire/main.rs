//! stormo-wire's integration tests, one binary: a requester and a responder stepped against each
//! other in memory through the real framing (`exchange`), and property tests (`props`).

mod edges;
mod exchange;
mod props;
mod util;
