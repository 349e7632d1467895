//! `GET /metrics`: the server's counters in the Prometheus text format (0.0.4), through the
//! `prometheus-client` crate (the Prometheus project's own Rust client; it keeps the
//! exposition format's escaping, `_total` suffixes and `# TYPE` lines right).
//!
//! Owns: what is counted and its names. Requests and tokens are counted as they happen (by
//! the handlers and the engine thread); the expert tier's numbers are read from
//! [`crate::experts::Experts::stats`] at each scrape by a collector, so they are never stale and never counted
//! twice. Every name starts with `stormo_`.
//!
//! Non-goals: per-client or per-conversation labels (unbounded cardinality); latency
//! histograms (left for when batching makes them interesting).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use stormo_engine::tiers::{ExpertStats, TierStats};

/// The `Content-Type` of [`Metrics::render`]'s text.
pub(super) const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The server's metrics.
#[derive(Debug)]
pub(super) struct Metrics {
    registry: Registry,
    /// Requests answered, by endpoint and status.
    pub(super) requests: Family<[(&'static str, String); 2], Counter>,
    /// Tokens generated (all requests).
    pub(super) tokens: Counter,
    /// Prompt tokens of started requests, and those of them taken from the cache.
    pub(super) prompt_tokens: Counter,
    pub(super) prompt_reused: Counter,
    /// Of those reused, the ones read from the prompt cache on disk (`--prompt-cache`).
    pub(super) prompt_cache_tokens: Counter,
    /// The prompt cache's files and their bytes, all models together.
    pub(super) prompt_cache_files: Gauge,
    pub(super) prompt_cache_bytes: Gauge,
    /// Files the prompt cache evicted to stay within its size, and files it removed because
    /// they did not load (cut, corrupt, another model's).
    pub(super) prompt_cache_evictions: Counter,
    pub(super) prompt_cache_rejected: Counter,
    /// Requests running on the engine (at most `--parallel`).
    pub(super) active: Gauge,
    /// Forward steps of the engine, and the sequences they ran in all (their ratio is the
    /// mean batch size).
    pub(super) steps: Counter,
    pub(super) step_sequences: Counter,
    /// Requests admitted and not finished (running or waiting).
    pub(super) admitted: Gauge,
    /// Decode speed of the last finished request, in tokens per second (f64 bits).
    pub(super) last_decode_tps: Arc<AtomicU64>,
}

impl Metrics {
    /// The metrics of a server whose experts are `experts`; the prompt cache's series are
    /// exposed only when it has one (`prompt_cache`, `--prompt-cache`).
    pub(super) fn new(experts: ExpertStatsFn, prompt_cache: bool) -> Self {
        let mut registry = Registry::with_prefix("stormo");
        let m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            prompt_reused: Counter::default(),
            prompt_cache_tokens: Counter::default(),
            prompt_cache_files: Gauge::default(),
            prompt_cache_bytes: Gauge::default(),
            prompt_cache_evictions: Counter::default(),
            prompt_cache_rejected: Counter::default(),
            active: Gauge::default(),
            steps: Counter::default(),
            step_sequences: Counter::default(),
            admitted: Gauge::default(),
            last_decode_tps: Arc::new(AtomicU64::new(0f64.to_bits())),
        };
        registry.register(
            "http_requests",
            "HTTP requests answered, by endpoint and status code",
            m.requests.clone(),
        );
        registry.register(
            "tokens_generated",
            "Tokens generated for all requests",
            m.tokens.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of the requests started",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "prompt_tokens_reused",
            "Prompt tokens taken from the KV cache instead of computed",
            m.prompt_reused.clone(),
        );
        if prompt_cache {
            registry.register(
                "prompt_cache_tokens",
                "Prompt tokens read from the prompt cache on disk (--prompt-cache; a part of \
                 stormo_prompt_tokens_reused_total)",
                m.prompt_cache_tokens.clone(),
            );
            registry.register(
                "prompt_cache_files",
                "Files in the prompt cache on disk",
                m.prompt_cache_files.clone(),
            );
            registry.register(
                "prompt_cache_bytes",
                "Bytes of the prompt cache on disk (at most --prompt-cache)",
                m.prompt_cache_bytes.clone(),
            );
            registry.register(
                "prompt_cache_evictions",
                "Prompt cache files evicted, least recently used first, to stay within its size",
                m.prompt_cache_evictions.clone(),
            );
            registry.register(
                "prompt_cache_rejected",
                "Prompt cache files removed because they did not load (cut, corrupt, another \
                 model's)",
                m.prompt_cache_rejected.clone(),
            );
        }
        registry.register(
            "active_requests",
            "Requests being generated now",
            m.active.clone(),
        );
        registry.register(
            "engine_steps",
            "Forward steps of the engine (each runs every active request's next tokens)",
            m.steps.clone(),
        );
        registry.register(
            "engine_step_sequences",
            "Requests run by the engine's steps, summed over steps (divided by \
             stormo_engine_steps_total: the mean batch size)",
            m.step_sequences.clone(),
        );
        registry.register_collector(Box::new(Derived {
            admitted: m.admitted.clone(),
            active: m.active.clone(),
            last_decode_tps: m.last_decode_tps.clone(),
            experts,
        }));
        Self { registry, ..m }
    }

    /// Counts an answered request (`endpoint` is one of the known paths or `other`).
    pub(super) fn request(&self, endpoint: &'static str, status: u16) {
        self.requests
            .get_or_create(&[
                ("endpoint", endpoint.to_string()),
                ("code", status.to_string()),
            ])
            .inc();
    }

    /// Notes a finished request's decode speed.
    pub(super) fn set_decode_rate(&self, tps: f64) {
        self.last_decode_tps.store(tps.to_bits(), Ordering::Relaxed);
    }

    /// The text exposition.
    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; an encoder error would be a bug in a collector.
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::warn!("encoding the metrics failed: {e}");
        }
        out
    }
}

/// Where the expert tier's statistics come from (`None`: memory-mapped experts, no
/// statistics).
pub(super) type ExpertStatsFn = Arc<dyn Fn() -> Option<ExpertStats> + Send + Sync>;

/// Values computed at each scrape: the queue depth, the last decode speed and the expert
/// tier's statistics.
struct Derived {
    admitted: Gauge,
    active: Gauge,
    last_decode_tps: Arc<AtomicU64>,
    experts: ExpertStatsFn,
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Derived").finish_non_exhaustive()
    }
}

fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

impl Collector for Derived {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let queued = (self.admitted.get() - self.active.get()).max(0);
        let g = ConstGauge::new(queued);
        g.encode(enc.encode_descriptor(
            "queue_depth",
            "Requests admitted and waiting for the engine",
            None,
            g.metric_type(),
        )?)?;
        let tps = f64::from_bits(self.last_decode_tps.load(Ordering::Relaxed));
        let g = ConstGauge::new(tps);
        g.encode(enc.encode_descriptor(
            "decode_tokens_per_second",
            "Decode speed of the last finished request (rate(stormo_tokens_generated_total) \
             gives the throughput)",
            None,
            g.metric_type(),
        )?)?;
        let Some(s) = (self.experts)() else {
            // Memory-mapped experts keep no statistics.
            return Ok(());
        };
        counter(
            &mut enc,
            "expert_requests",
            "Experts asked for by the model",
            s.requests,
        )?;
        counter(
            &mut enc,
            "expert_ram_hits",
            "Experts found ready in RAM",
            s.ram_hits,
        )?;
        counter(
            &mut enc,
            "expert_fallbacks",
            "Expert loads that failed in one tier and were retried in another",
            s.fallbacks,
        )?;
        for (name, help, get) in [
            (
                "expert_tier_loads",
                "Experts loaded from each tier below RAM",
                (|t| t.loads) as fn(&TierStats) -> u64,
            ),
            (
                "expert_tier_bytes",
                "Bytes of experts loaded from each tier below RAM",
                |t| t.bytes,
            ),
            (
                "expert_tier_failures",
                "Expert loads that failed in each tier below RAM",
                |t| t.failures,
            ),
        ] {
            let mut fam = enc.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for t in &s.tiers {
                let labels = [("tier", t.name.as_str())];
                ConstCounter::new(get(t)).encode(fam.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_in_the_prometheus_text_format() {
        let stats = ExpertStats {
            requests: 10,
            ram_hits: 6,
            tiers: vec![TierStats {
                name: "disk".into(),
                loads: 4,
                bytes: 4096,
                failures: 1,
            }],
            ..Default::default()
        };
        let m = Metrics::new(Arc::new(move || Some(stats.clone())), false);
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 200);
        m.request("/health", 503);
        m.tokens.inc_by(7);
        m.admitted.set(3);
        m.active.set(1);
        m.set_decode_rate(12.5);
        let text = m.render();
        for line in [
            "# TYPE stormo_http_requests_total counter",
            "stormo_http_requests_total{endpoint=\"/v1/completions\",code=\"200\"} 2",
            "stormo_http_requests_total{endpoint=\"/health\",code=\"503\"} 1",
            "stormo_tokens_generated_total 7",
            "stormo_active_requests 1",
            "stormo_queue_depth 2",
            "stormo_decode_tokens_per_second 12.5",
            "stormo_expert_requests_total 10",
            "stormo_expert_ram_hits_total 6",
            "stormo_expert_tier_loads_total{tier=\"disk\"} 4",
            "stormo_expert_tier_bytes_total{tier=\"disk\"} 4096",
            "stormo_expert_tier_failures_total{tier=\"disk\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
        }
    }

    /// The prompt cache's series are exposed only by a server that has one, as
    /// docs/serving.md says.
    #[test]
    fn prompt_cache_series_only_with_a_prompt_cache() {
        let series = |text: &str| {
            text.lines()
                .filter(|l| l.starts_with("stormo_prompt_cache_"))
                .count()
        };
        let without = Metrics::new(Arc::new(|| None), false).render();
        assert_eq!(series(&without), 0, "{without}");
        assert!(
            without.contains("stormo_prompt_tokens_reused_total 0"),
            "{without}"
        );
        let with = Metrics::new(Arc::new(|| None), true).render();
        assert_eq!(series(&with), 5, "{with}");
    }
}
