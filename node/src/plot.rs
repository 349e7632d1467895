//! Pictures of measurements, as SVG: `stormo bench --svg FILE` draws the run's prefill and
//! decode speed beside the bound memory sets for decode, and beside llama.cpp's figures when
//! given (`--svg-llama FILE`, the JSON `llama-bench -o json` prints, as
//! `.ci/llamacpp-side-by-side.sh` keeps it; `--svg-llama-name` names another engine that prints
//! it, such as ik_llama.cpp).
//!
//! Owns: reading the figures out of the bench JSON (the object `stormo bench --json` prints)
//! and llama-bench's JSON, and drawing them with `plotters` (its SVG backend only, text as SVG
//! text, no font files). Non-goals: measuring anything, or pictures of other runs (a swarm
//! run's experts per peer over time is a follow-up).

use std::fmt::Write as _;

use anyhow::{bail, Context};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

/// One run's speeds, in tokens per second.
#[derive(Clone, Debug, PartialEq)]
pub struct Speeds {
    /// Prefill speed per prompt length (tokens, tok/s), in the order measured.
    pub prefill: Vec<(u64, f64)>,
    /// Decode speed, if measured.
    pub decode: Option<f64>,
}

/// What `stormo bench` measured, as the chart needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchFigures {
    /// stormo's speeds.
    pub speeds: Speeds,
    /// Decode speed if every decoded token only read its bytes at the measured memory speed.
    pub decode_bound: f64,
    /// Prefill's share of the floating-point peak, per prompt length (same order).
    pub prefill_of_peak: Vec<f64>,
    /// The kernels' instruction set (`avx2`, ...).
    pub isa: String,
    /// Threads used.
    pub threads: u64,
    /// Whether an approximate opt-in ran (`--int8-attn-head`, `--int8-experts`).
    pub approximate: bool,
}

fn num(v: &Value, key: &str) -> anyhow::Result<f64> {
    v.get(key)
        .and_then(Value::as_f64)
        .with_context(|| format!("no number \"{key}\""))
}

impl BenchFigures {
    /// Reads the object `stormo bench --json` prints.
    pub fn from_bench_json(v: &Value) -> anyhow::Result<Self> {
        let prefill = v
            .get("prefill")
            .and_then(Value::as_array)
            .context("no \"prefill\" list")?;
        let mut speeds = Speeds {
            prefill: Vec::new(),
            decode: None,
        };
        let mut prefill_of_peak = Vec::new();
        for p in prefill {
            speeds
                .prefill
                .push((num(p, "tokens")? as u64, num(p, "tok_s")?));
            prefill_of_peak.push(num(p, "fraction_of_peak")?);
        }
        let decode = v.get("decode").context("no \"decode\" object")?;
        if num(decode, "tokens")? > 0.0 {
            speeds.decode = Some(num(decode, "tok_s")?);
        }
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        Ok(Self {
            speeds,
            decode_bound: num(v, "decode_bound_tok_s")?,
            prefill_of_peak,
            isa: v
                .get("simd")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            threads: num(v, "threads")? as u64,
            approximate: flag("int8_attn_head") || flag("int8_experts"),
        })
    }
}

/// Reads llama.cpp's `llama-bench -o json` output: a list of tests, each with `n_prompt`,
/// `n_gen` and `avg_ts` (tokens per second). Prompt-only tests give prefill speeds,
/// generation-only tests the decode speed; other tests are ignored.
pub fn llama_bench_speeds(v: &Value) -> anyhow::Result<Speeds> {
    let tests = v
        .as_array()
        .context("not a list of llama-bench tests (expected `llama-bench -o json` output)")?;
    let mut s = Speeds {
        prefill: Vec::new(),
        decode: None,
    };
    for t in tests {
        let (p, g, ts) = (num(t, "n_prompt")?, num(t, "n_gen")?, num(t, "avg_ts")?);
        match (p > 0.0, g > 0.0) {
            (true, false) => s.prefill.push((p as u64, ts)),
            (false, true) => s.decode = Some(ts),
            _ => {}
        }
    }
    if s.prefill.is_empty() && s.decode.is_none() {
        bail!("no prompt-only or generation-only test in the llama-bench output");
    }
    Ok(s)
}

/// This machine's CPU as `/proc/cpuinfo` names it, with its family and model numbers (a VM
/// may name only the vendor), for labels; "unknown CPU" where there is no such file.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|s| cpu_name_of(&s))
        .unwrap_or_else(|_| "unknown CPU".to_string())
}

fn cpu_name_of(cpuinfo: &str) -> String {
    let field = |name: &str| {
        cpuinfo
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == name)
            .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
    };
    let name = field("model name").unwrap_or_else(|| "unknown CPU".to_string());
    match (field("cpu family"), field("model")) {
        (Some(f), Some(m)) => format!("{name} (family {f}, model {m})"),
        _ => name,
    }
}

/// `stormo bench --svg FILE [--svg-llama FILE]`, resolved before the bench runs (so a bad
/// llama-bench file fails at once, not after minutes of measuring).
#[derive(Clone, Debug)]
pub struct BenchSvg {
    path: std::path::PathBuf,
    /// The other engine's name and speeds.
    llama: Option<(String, Speeds)>,
    model: String,
    machine: String,
}

impl BenchSvg {
    /// `None` without `--svg`; reads and checks the llama-bench JSON if one is given (with the
    /// name its engine goes by in the chart), and names the model (`model`, with `cfg`'s family and geometry) and this CPU for the heading.
    pub fn resolve(
        svg: Option<&std::path::Path>,
        llama: Option<(&std::path::Path, &str)>,
        model: &std::path::Path,
        cfg: &stormo_engine::ModelConfig,
    ) -> anyhow::Result<Option<Self>> {
        let Some(path) = svg else {
            return Ok(None);
        };
        let llama = llama
            .map(|(l, engine)| {
                let text = stormo_manifests::read_small_file(l, 16 << 20)
                    .with_context(|| format!("reading {}", l.display()))?;
                let v: Value = serde_json::from_slice(&text)
                    .with_context(|| format!("{}: not JSON", l.display()))?;
                let speeds = llama_bench_speeds(&v).with_context(|| format!("{}", l.display()))?;
                anyhow::Ok((engine.to_string(), speeds))
            })
            .transpose()?;
        let name = model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| model.display().to_string());
        let family = match cfg.family {
            stormo_engine::Family::GptOss => "GPT-OSS",
            stormo_engine::Family::Qwen3Moe => "Qwen3-MoE",
        };
        let model = format!(
            "{name}: {family}, {} layers x {} experts, top {}",
            cfg.num_layers, cfg.num_experts, cfg.top_k,
        );
        Ok(Some(Self {
            path: path.to_path_buf(),
            llama,
            model,
            machine: cpu_name(),
        }))
    }

    /// Draws `bench` (the object `stormo bench --json` prints) and writes the SVG.
    pub fn write(&self, bench: &Value) -> anyhow::Result<()> {
        let fig = BenchFigures::from_bench_json(bench)?;
        let llama = self.llama.as_ref().map(|(name, s)| (name.as_str(), s));
        let svg = bench_svg(&fig, llama, &self.model, &self.machine)?;
        std::fs::write(&self.path, svg).with_context(|| format!("writing {}", self.path.display()))
    }
}

const STORMO: RGBColor = RGBColor(31, 119, 180);
const LLAMA: RGBColor = RGBColor(255, 127, 14);
const BOUND: RGBColor = RGBColor(80, 80, 80);

/// The chart as SVG text: one group of bars per prefill length and one for decode, stormo's
/// beside `llama`'s (when given: the other engine's name and speeds), the decode bound as a dashed line over decode, and each
/// prefill bar labelled with its share of the floating-point peak. The heading names the
/// `model` on its first line and the `machine` (with threads and kernels) on its second.
pub fn bench_svg(
    fig: &BenchFigures,
    llama: Option<(&str, &Speeds)>,
    model: &str,
    machine: &str,
) -> anyhow::Result<String> {
    let s = &fig.speeds;
    let (engine, llama) = match llama {
        Some((name, speeds)) => (name, Some(speeds)),
        None => ("", None),
    };
    let mut groups: Vec<(String, f64, Option<f64>)> = s
        .prefill
        .iter()
        .map(|&(n, ts)| {
            let other = llama.and_then(|l| l.prefill.iter().find(|p| p.0 == n).map(|p| p.1));
            (format!("prefill, {n}-token prompt"), ts, other)
        })
        .collect();
    if let Some(d) = s.decode {
        groups.push(("decode".to_string(), d, llama.and_then(|l| l.decode)));
    }
    if groups.is_empty() {
        bail!("nothing measured to draw (no prefill and no decode)");
    }
    let top = groups
        .iter()
        .flat_map(|g| [g.1, g.2.unwrap_or(0.0)])
        .chain(s.decode.map(|_| fig.decode_bound))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.3;
    let n = groups.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let subtitle = format!(
            "{} thread{}, {} kernels, {}",
            fig.threads,
            if fig.threads == 1 { "" } else { "s" },
            fig.isa,
            if fig.approximate {
                "approximate opt-ins on"
            } else {
                "exact"
            }
        );
        let (head, body) = root.split_vertically(60);
        let centred = |size: u32| {
            TextStyle::from(("sans-serif", size).into_font()).pos(Pos::new(HPos::Center, VPos::Top))
        };
        head.draw(&Text::new(model.to_string(), (450, 12), centred(18)))
            .map_err(draw_error)?;
        head.draw(&Text::new(
            format!("{machine}; {subtitle}"),
            (450, 36),
            centred(14),
        ))
        .map_err(draw_error)?;
        let mut chart = ChartBuilder::on(&body)
            .margin(15)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..top)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(0)
            .y_desc("tokens per second")
            .draw()
            .map_err(draw_error)?;
        // The groups' names under the axis, centred on each group (the x axis is a plain
        // range: plotters' own labels would fall on round numbers, not on the groups).
        let names =
            TextStyle::from(("sans-serif", 15).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        for (i, g) in groups.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64, 0.0));
            root.draw(&Text::new(g.0.clone(), (x, y + 10), names.clone()))
                .map_err(draw_error)?;
        }
        let width = if llama.is_some() { 0.35 } else { 0.5 };
        let label = TextStyle::from(("sans-serif", 14).into_font())
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        for (i, (_, ours, theirs)) in groups.iter().enumerate() {
            let c = i as f64;
            let x0 = if llama.is_some() {
                c - width
            } else {
                c - width / 2.0
            };
            let mut bars = vec![(x0, *ours, STORMO)];
            if let Some(t) = theirs {
                bars.push((c, *t, LLAMA));
            }
            for (x, v, color) in bars {
                chart
                    .draw_series([Rectangle::new([(x, 0.0), (x + width, v)], color.filled())])
                    .map_err(draw_error)?;
                let mut text = format!("{v:.1}");
                if color == STORMO && i < fig.prefill_of_peak.len() {
                    let _ = write!(text, " ({:.0}% of peak)", 100.0 * fig.prefill_of_peak[i]);
                }
                chart
                    .draw_series([Text::new(
                        text,
                        (x + width / 2.0, v + top * 0.01),
                        label.clone(),
                    )])
                    .map_err(draw_error)?;
            }
        }
        // Legend entries: drawn once each, with an empty series for the colour key.
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(draw_error)?
            .label("stormo")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], STORMO.filled()));
        if llama.is_some() {
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(draw_error)?
                .label(engine)
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], LLAMA.filled()));
        }
        if s.decode.is_some() {
            let c = (n - 1) as f64;
            let b = fig.decode_bound;
            chart
                .draw_series(DashedLineSeries::new(
                    [(c - 0.45, b), (c + 0.45, b)],
                    6,
                    4,
                    BOUND.stroke_width(2),
                ))
                .map_err(draw_error)?
                .label(format!("decode bound at memory speed: {b:.1} tok/s"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 12, y)], BOUND.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    Ok(svg)
}

fn draw_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench_json() -> Value {
        serde_json::json!({
            "threads": 2, "simd": "avx512", "int8_attn_head": false, "int8_experts": false,
            "decode_bound_tok_s": 11.0,
            "prefill": [
                {"tokens": 64, "tok_s": 25.5, "fraction_of_peak": 0.31},
                {"tokens": 128, "tok_s": 30.25, "fraction_of_peak": 0.36},
            ],
            "decode": {"tokens": 32, "tok_s": 9.14},
        })
    }

    #[test]
    fn bench_figures_are_read_from_the_bench_json() {
        let f = BenchFigures::from_bench_json(&bench_json()).unwrap();
        assert_eq!(f.speeds.prefill, vec![(64, 25.5), (128, 30.25)]);
        assert_eq!(f.speeds.decode, Some(9.14));
        assert_eq!((f.decode_bound, f.threads, f.approximate), (11.0, 2, false));
        let mut v = bench_json();
        v.as_object_mut().unwrap().remove("decode_bound_tok_s");
        let e = BenchFigures::from_bench_json(&v).unwrap_err().to_string();
        assert!(e.contains("decode_bound_tok_s"), "{e}");
    }

    #[test]
    fn the_cpu_is_named_with_its_family_and_model() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\
                    model name\t: AMD  EPYC\n";
        assert_eq!(cpu_name_of(info), "AMD EPYC (family 26, model 2)");
        assert_eq!(cpu_name_of("model name : X\n"), "X");
        assert_eq!(cpu_name_of(""), "unknown CPU");
    }

    #[test]
    fn llama_bench_tests_split_into_prefill_and_decode() {
        let v = serde_json::json!([
            {"n_prompt": 64, "n_gen": 0, "avg_ts": 15.0},
            {"n_prompt": 128, "n_gen": 0, "avg_ts": 17.5},
            {"n_prompt": 0, "n_gen": 32, "avg_ts": 4.5},
            {"n_prompt": 16, "n_gen": 16, "avg_ts": 99.0},
        ]);
        let s = llama_bench_speeds(&v).unwrap();
        assert_eq!(s.prefill, vec![(64, 15.0), (128, 17.5)]);
        assert_eq!(s.decode, Some(4.5));
        assert!(llama_bench_speeds(&serde_json::json!({"n": 1})).is_err());
        assert!(llama_bench_speeds(&serde_json::json!([])).is_err());
    }

    /// The SVG holds every group's name, every bar's figure and the bound, stormo's and
    /// llama.cpp's bars in their own colours, and the other engine's name as given.
    #[test]
    fn the_chart_shows_every_figure() {
        let f = BenchFigures::from_bench_json(&bench_json()).unwrap();
        let llama = Speeds {
            prefill: vec![(64, 15.0), (128, 17.5)],
            decode: Some(4.5),
        };
        let svg = bench_svg(&f, Some(("llama.cpp", &llama)), "a model", "a cpu").unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        for want in [
            "prefill, 64-token prompt",
            "prefill, 128-token prompt",
            "decode",
            "25.5 (31% of peak)",
            "30.2 (36% of peak)",
            "9.1",
            "15.0",
            "17.5",
            "4.5",
            "decode bound at memory speed: 11.0 tok/s",
            "llama.cpp",
            "a model",
            "a cpu; 2 threads, avx512 kernels, exact",
            "#1F77B4",
            "#FF7F0E",
        ] {
            assert!(svg.contains(want), "{want:?} missing from the SVG");
        }
        let alone = bench_svg(&f, None, "m", "c").unwrap();
        assert!(!alone.contains("llama.cpp") && !alone.contains("#FF7F0E"));
        // Another engine that prints llama-bench's JSON goes by its own name.
        let ik = bench_svg(&f, Some(("ik_llama.cpp", &llama)), "m", "c").unwrap();
        assert!(ik.contains("ik_llama.cpp") && ik.contains("#FF7F0E"));
    }
}
