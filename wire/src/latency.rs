//! Round-trip time from [`Ping`]/[`Pong`], for choosing peers and hedging slow requests.
//!
//! The estimator follows RFC 6298 (as QUIC's does): `srtt ← 7/8·srtt + 1/8·sample`,
//! `rttvar ← 3/4·rttvar + 1/4·|srtt − sample|`, the first sample setting `srtt = sample` and
//! `rttvar = sample / 2`.

use std::time::{Duration, Instant};

use crate::message::{Ping, Pong};

/// A smoothed round-trip time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RttEstimator {
    smoothed: Option<Duration>,
    var: Duration,
    min: Option<Duration>,
    latest: Option<Duration>,
}

impl RttEstimator {
    /// Adds one sample.
    pub fn update(&mut self, sample: Duration) {
        self.latest = Some(sample);
        self.min = Some(self.min.map_or(sample, |m| m.min(sample)));
        match self.smoothed {
            None => {
                self.smoothed = Some(sample);
                self.var = sample / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(sample);
                self.var = (self.var * 3 + diff) / 4;
                self.smoothed = Some((s * 7 + sample) / 8);
            }
        }
    }

    /// The smoothed RTT, once a sample arrived.
    pub fn smoothed(&self) -> Option<Duration> {
        self.smoothed
    }

    /// The RTT variation.
    pub fn var(&self) -> Duration {
        self.var
    }

    /// The smallest sample.
    pub fn min(&self) -> Option<Duration> {
        self.min
    }

    /// The latest sample.
    pub fn latest(&self) -> Option<Duration> {
        self.latest
    }

    /// How long to wait before racing a slow request with a second one: `srtt + 4·rttvar`
    /// (QUIC's probe timeout without ack delay), or `None` before the first sample.
    pub fn hedge_delay(&self) -> Option<Duration> {
        self.smoothed.map(|s| s + self.var * 4)
    }
}

/// Sends pings to one peer and measures their round trips.
#[derive(Clone, Debug, Default)]
pub struct Pinger {
    next_nonce: u64,
    in_flight: Option<(u64, Instant)>,
    rtt: RttEstimator,
}

impl Pinger {
    /// No samples yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A ping to send now. A ping still unanswered is forgotten (its pong will be ignored).
    pub fn ping(&mut self, now: Instant) -> Ping {
        let nonce = self.next_nonce;
        self.next_nonce = self.next_nonce.wrapping_add(1);
        self.in_flight = Some((nonce, now));
        Ping { nonce }
    }

    /// Feeds a pong; returns the round trip if it answers the ping in flight.
    pub fn handle_pong(&mut self, now: Instant, pong: &Pong) -> Option<Duration> {
        match self.in_flight {
            Some((nonce, sent)) if nonce == pong.nonce => {
                self.in_flight = None;
                let rtt = now.saturating_duration_since(sent);
                self.rtt.update(rtt);
                Some(rtt)
            }
            _ => None,
        }
    }

    /// When the ping in flight was sent, if one is.
    pub fn in_flight_since(&self) -> Option<Instant> {
        self.in_flight.map(|(_, t)| t)
    }

    /// The estimate so far.
    pub fn rtt(&self) -> &RttEstimator {
        &self.rtt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimator_follows_rfc6298() {
        let mut r = RttEstimator::default();
        assert_eq!(r.hedge_delay(), None);
        r.update(Duration::from_millis(100));
        assert_eq!(r.smoothed(), Some(Duration::from_millis(100)));
        assert_eq!(r.var(), Duration::from_millis(50));
        r.update(Duration::from_millis(20));
        // srtt = (700 + 20) / 8 = 90; var = (150 + 80) / 4 = 57.5
        assert_eq!(r.smoothed(), Some(Duration::from_millis(90)));
        assert_eq!(r.var(), Duration::from_micros(57_500));
        assert_eq!(r.min(), Some(Duration::from_millis(20)));
        assert_eq!(r.hedge_delay(), Some(Duration::from_millis(90 + 230)));
    }

    #[test]
    fn pinger_matches_nonces() {
        let t0 = Instant::now();
        let mut p = Pinger::new();
        let a = p.ping(t0);
        let b = p.ping(t0 + Duration::from_millis(1));
        assert_ne!(a.nonce, b.nonce);
        assert_eq!(
            p.handle_pong(t0 + Duration::from_millis(5), &a.pong()),
            None
        );
        assert_eq!(
            p.handle_pong(t0 + Duration::from_millis(5), &b.pong()),
            Some(Duration::from_millis(4))
        );
        assert_eq!(
            p.handle_pong(t0 + Duration::from_millis(6), &b.pong()),
            None
        );
        assert_eq!(p.rtt().latest(), Some(Duration::from_millis(4)));
    }
}
