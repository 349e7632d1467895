//! Who may use the HTTP API: the `Host` check (against DNS rebinding), browser origins
//! (CORS) and the API key.
//!
//! Owns: the decisions, as plain functions of the request's headers, so they are tested
//! without sockets; `http.rs` turns a refusal into OpenAI's error shape.
//!
//! - **Host.** A web page on `evil.example` can make its name resolve to 127.0.0.1 (DNS
//!   rebinding) and then read this server's replies as same-origin. Its requests still carry
//!   `Host: evil.example`, so a request is served only when its `Host` names the listen
//!   address: that IP literal; for a loopback listen address also `localhost` and any
//!   loopback literal; for an unspecified one (0.0.0.0, ::) any IP literal (the machine's
//!   addresses are not known here, and an IP literal cannot be rebound); or a name given
//!   with `--allowed-host` (`*` allows any). The port is not compared. Refused: 403.
//! - **Origin.** Browsers send `Origin` with every cross-origin request, and a "simple"
//!   POST (text/plain) is sent without a preflight: without this check a web page could
//!   drive the server even though it cannot read the answer. A request whose `Origin` is not
//!   one given with `--cors` is refused (403); one that is gets the CORS headers, and its
//!   preflight (`OPTIONS`) is answered. Clients that are not browsers send no `Origin`.
//! - **API key.** With `--api-key`, every endpoint but `/health` needs
//!   `Authorization: Bearer KEY`. Keys are compared in constant time (the `subtle` crate) on
//!   their BLAKE3 hashes, so neither the content nor the length of the key leaks through
//!   timing.
//!
//! Non-goals: several keys or scopes, rate limits per key, TLS (put a proxy in front).

use std::net::{IpAddr, SocketAddr};

use subtle::ConstantTimeEq;

/// The admission policy of a server.
#[derive(Clone)]
pub(super) struct Guard {
    listen: SocketAddr,
    /// Lowercased names from `--allowed-host`; `*` allows any.
    hosts: Vec<String>,
    /// Origins from `--cors`, as given (`*` allows any).
    origins: Vec<String>,
    /// The BLAKE3 hash of the API key.
    key: Option<[u8; 32]>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("listen", &self.listen)
            .field("hosts", &self.hosts)
            .field("origins", &self.origins)
            .field("key", &self.key.map(|_| ".."))
            .finish()
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// `Host` names no address or name this server answers to (the name, or `None` when the
    /// header is missing or not text).
    Host(Option<String>),
    /// `Origin` is not allowed by `--cors`.
    Origin(String),
    /// No `Authorization: Bearer` header.
    NoKey,
    /// The key given is wrong.
    WrongKey,
}

impl Guard {
    pub(super) fn new(
        listen: SocketAddr,
        hosts: &[String],
        origins: &[String],
        key: Option<&str>,
    ) -> Self {
        Self {
            listen,
            hosts: hosts
                .iter()
                .map(|h| {
                    h.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_ascii_lowercase()
                })
                .collect(),
            origins: origins.to_vec(),
            key: key.map(|k| *blake3::hash(k.as_bytes()).as_bytes()),
        }
    }

    /// Whether an API key is needed.
    pub(super) fn needs_key(&self) -> bool {
        self.key.is_some()
    }

    /// Checks the `Host` header's value.
    pub(super) fn host(&self, host: Option<&str>) -> Result<(), Refusal> {
        let Some(host) = host else {
            return Err(Refusal::Host(None));
        };
        let name = host_name(host).to_ascii_lowercase();
        if self.hosts.iter().any(|h| h == "*" || *h == name) {
            return Ok(());
        }
        let ip = self.listen.ip();
        let literal = name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .map(|a| a.to_canonical());
        let ok = match literal {
            Some(_) if ip.is_unspecified() => true,
            Some(a) => a == ip.to_canonical() || (ip.is_loopback() && a.is_loopback()),
            None => {
                (ip.is_loopback() || ip.is_unspecified())
                    && (name == "localhost" || name.ends_with(".localhost"))
            }
        };
        if ok {
            Ok(())
        } else {
            Err(Refusal::Host(Some(host.to_string())))
        }
    }

    /// Checks the `Origin` header's value (absent: not a browser's cross-origin request).
    /// On success, the value to send back as `Access-Control-Allow-Origin`, if any.
    pub(super) fn origin(&self, origin: Option<&str>) -> Result<Option<String>, Refusal> {
        let Some(origin) = origin else {
            return Ok(None);
        };
        if self.origins.iter().any(|o| o == "*") {
            return Ok(Some("*".into()));
        }
        if self
            .origins
            .iter()
            .any(|o| o.trim_end_matches('/').eq_ignore_ascii_case(origin))
        {
            return Ok(Some(origin.to_string()));
        }
        Err(Refusal::Origin(origin.to_string()))
    }

    /// Checks the `Authorization` header's value against the key, if one is set.
    pub(super) fn key(&self, authorization: Option<&str>) -> Result<(), Refusal> {
        let Some(want) = &self.key else {
            return Ok(());
        };
        let given = authorization
            .and_then(|a| {
                let (scheme, rest) = a.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .ok_or(Refusal::NoKey)?;
        let given = blake3::hash(given.as_bytes());
        if bool::from(given.as_bytes().ct_eq(want)) {
            Ok(())
        } else {
            Err(Refusal::WrongKey)
        }
    }
}

/// The host part of a `Host` value (`name`, `name:port`, `[v6]:port`, `v4:port`).
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        // One colon: name:port. More: a bare IPv6 address (not valid in Host, but harmless).
        Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(listen: &str, hosts: &[&str]) -> Guard {
        let hosts: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
        Guard::new(listen.parse().expect("addr"), &hosts, &[], None)
    }

    #[test]
    fn host_must_name_the_listen_address() {
        let g = guard("127.0.0.1:8080", &[]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "127.0.0.2:1",
        ] {
            assert_eq!(g.host(Some(ok)), Ok(()), "{ok}");
        }
        for bad in ["evil.example", "evil.example:8080", "10.0.0.1:8080", "test"] {
            assert_eq!(
                g.host(Some(bad)),
                Err(Refusal::Host(Some(bad.into()))),
                "{bad}"
            );
        }
        assert_eq!(g.host(None), Err(Refusal::Host(None)));

        let g = guard("10.1.2.3:80", &["Models.Example"]);
        assert_eq!(g.host(Some("10.1.2.3")), Ok(()));
        assert_eq!(g.host(Some("models.example:80")), Ok(()));
        assert!(
            g.host(Some("localhost")).is_err(),
            "not a loopback listen address"
        );
        assert!(g.host(Some("10.1.2.4")).is_err());

        let g = guard("0.0.0.0:80", &[]);
        assert_eq!(g.host(Some("192.168.1.9:80")), Ok(()));
        assert_eq!(g.host(Some("localhost")), Ok(()));
        assert!(g.host(Some("evil.example")).is_err());

        assert_eq!(
            guard("127.0.0.1:1", &["*"]).host(Some("any.example")),
            Ok(())
        );
    }

    #[test]
    fn origins_need_cors() {
        let g = guard("127.0.0.1:1", &[]);
        assert_eq!(g.origin(None), Ok(None));
        assert_eq!(
            g.origin(Some("http://evil.example")),
            Err(Refusal::Origin("http://evil.example".into()))
        );
        let o = vec!["http://app.example/".to_string()];
        let g = Guard::new("127.0.0.1:1".parse().expect("addr"), &[], &o, None);
        assert_eq!(
            g.origin(Some("http://app.example")),
            Ok(Some("http://app.example".into()))
        );
        assert!(g.origin(Some("http://app.example.evil")).is_err());
        let any = vec!["*".to_string()];
        let g = Guard::new("127.0.0.1:1".parse().expect("addr"), &[], &any, None);
        assert_eq!(g.origin(Some("http://x")), Ok(Some("*".into())));
    }

    #[test]
    fn the_key_is_a_bearer_token() {
        let g = Guard::new(
            "127.0.0.1:1".parse().expect("addr"),
            &[],
            &[],
            Some("s3cret"),
        );
        assert!(g.needs_key());
        assert_eq!(g.key(Some("Bearer s3cret")), Ok(()));
        assert_eq!(g.key(Some("bearer  s3cret ")), Ok(()));
        assert_eq!(g.key(Some("Bearer s3cre")), Err(Refusal::WrongKey));
        assert_eq!(g.key(Some("Bearer s3cret2")), Err(Refusal::WrongKey));
        assert_eq!(g.key(Some("Basic s3cret")), Err(Refusal::NoKey));
        assert_eq!(g.key(None), Err(Refusal::NoKey));
        let open = guard("127.0.0.1:1", &[]);
        assert_eq!(open.key(None), Ok(()));
    }
}
