//! The paired comparisons of `stormo bench` (`--pair-full-head`, `--pair-prefetch`,
//! `--pair-tasks`, `--pair-completion`): two settings alternated token by token, so both see
//! the same machine, and how their speeds are summed up and printed.

use super::Args;

/// The paired comparisons a run made (none without a `--pair-*` switch).
#[derive(Debug)]
pub(super) struct Pairs {
    /// Tokens per second through the screened head and through the whole exact head
    /// (`--pair-full-head`).
    pub(super) head: Option<[f64; 2]>,
    /// `--pair-prefetch` or `--pair-tasks`.
    pub(super) knob: Option<PairedKnob>,
    /// `--pair-completion`.
    pub(super) completion: Option<PairedCompletion>,
}

impl Pairs {
    /// What `a` asked to pair, from the decode's tokens per second through either head
    /// (`head`), the seconds of its even and odd tokens (`by_parity`) and the paired prefills
    /// of `--pair-completion`.
    pub(super) fn new(
        a: &Args,
        head: Option<[f64; 2]>,
        by_parity: &[Vec<f64>; 2],
        prefill: Option<Vec<(usize, [f64; 2], bool)>>,
    ) -> Self {
        let knob = a
            .pair_prefetch
            .map(|d| PairedKnob::new(Knob::Prefetch, d, by_parity))
            .or_else(|| {
                a.pair_tasks
                    .map(|n| PairedKnob::new(Knob::Tasks, n, by_parity))
            });
        let completion = a.pair_completion.then(|| PairedCompletion {
            decode: Paired::new(by_parity),
            prefill: prefill.unwrap_or_default(),
        });
        Self {
            head,
            knob,
            completion,
        }
    }

    /// The table's `paired` lines.
    pub(super) fn print_table(&self) {
        if let Some([s, f]) = self.head {
            println!(
                "paired           screened head {s:.2} tok/s, whole exact head {f:.2} tok/s (alternate decoded tokens): {:.3}x",
                s / f
            );
        }
        if let Some(p) = &self.knob {
            println!("{p}");
        }
        if let Some(p) = &self.completion {
            println!("{p}");
        }
    }
}

/// Decode speeds of two settings, decoded tokens alternated between them (token `2j` at the
/// first, `2j + 1` at the second).
#[derive(Debug)]
struct Paired {
    /// Tokens per second at each (`None` for a setting no token was decoded at).
    tok_s: [Option<f64>; 2],
    /// The median over neighbouring pairs of the second's speed over the first's; `None`
    /// without a whole pair.
    median_ratio: Option<f64>,
}

impl Paired {
    /// From the seconds of each token at each setting.
    fn new(secs: &[Vec<f64>; 2]) -> Self {
        let tok_s = [0, 1].map(|k| {
            (!secs[k].is_empty()).then(|| secs[k].len() as f64 / secs[k].iter().sum::<f64>())
        });
        let mut ratios: Vec<f64> = secs[0].iter().zip(&secs[1]).map(|(a, b)| a / b).collect();
        ratios.sort_by(f64::total_cmp);
        let median_ratio = (!ratios.is_empty()).then(|| ratios[ratios.len() / 2]);
        Self {
            tok_s,
            median_ratio,
        }
    }

    /// The two speeds as printed (`-` for a setting no token was decoded at).
    fn speeds(&self) -> [String; 2] {
        self.tok_s
            .map(|s| s.map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")))
    }

    /// The median pair ratio as printed after the speeds.
    fn ratio_note(&self) -> String {
        match self.median_ratio {
            Some(r) => format!("; median of neighbouring pairs {r:.3}x"),
            None => "; decode at least 2 tokens for a pair".to_owned(),
        }
    }
}

/// What a paired decode alternates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Knob {
    /// The AVX-512 kernels' prefetch distance (`--pair-prefetch`).
    Prefetch,
    /// Tasks per thread (`--pair-tasks`).
    Tasks,
}

/// Decode speeds at two settings of a [`Knob`], tokens alternated (`--pair-prefetch`,
/// `--pair-tasks`).
#[derive(Debug)]
pub(super) struct PairedKnob {
    /// What is alternated.
    pub(super) knob: Knob,
    /// The two settings (bytes ahead, or tasks per thread).
    values: [usize; 2],
    /// The speeds at each.
    speeds: Paired,
}

impl PairedKnob {
    fn new(knob: Knob, values: [usize; 2], secs: &[Vec<f64>; 2]) -> Self {
        Self {
            knob,
            values,
            speeds: Paired::new(secs),
        }
    }

    /// The `paired_prefetch` or `paired_tasks` object of `--json`.
    pub(super) fn json(&self) -> serde_json::Value {
        let key = match self.knob {
            Knob::Prefetch => "bytes",
            Knob::Tasks => "tasks_per_thread",
        };
        serde_json::json!({
            key: self.values, "tok_s": self.speeds.tok_s, "median_pair_ratio": self.speeds.median_ratio,
        })
    }
}

/// Fetch-then-compute against completion-driven MoE (`--pair-completion`).
#[derive(Debug)]
pub(super) struct PairedCompletion {
    /// Decoded tokens alternated: fetch-then-compute first.
    decode: Paired,
    /// Per prompt length: its tokens, the mean seconds of its prefills fetch-then-compute and
    /// completion-driven, and whether all four prefills chose the same next token.
    prefill: Vec<(usize, [f64; 2], bool)>,
}

impl PairedCompletion {
    /// The `paired_completion` object of `--json`.
    pub(super) fn json(&self) -> serde_json::Value {
        let [off, on] = self.decode.tok_s;
        serde_json::json!({
            "decode": {
                "fetch_then_compute_tok_s": off,
                "completion_driven_tok_s": on,
                "median_pair_ratio": self.decode.median_ratio,
            },
            "prefill": self.prefill.iter().map(|&(p, [off, on], same)| serde_json::json!({
                "tokens": p,
                "fetch_then_compute_tok_s": p as f64 / off,
                "completion_driven_tok_s": p as f64 / on,
                "ratio": off / on,
                "same_next_token": same,
            })).collect::<Vec<_>>(),
        })
    }
}

impl std::fmt::Display for PairedCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [off, on] = self.decode.speeds();
        write!(
            f,
            "paired           decode completion-driven {on} tok/s, fetch-then-compute {off} tok/s (alternate decoded tokens){}",
            self.decode.ratio_note()
        )?;
        for &(p, [off, on], same) in &self.prefill {
            write!(
                f,
                "\npaired           prefill {p:>5} tok completion-driven {:.2} tok/s, fetch-then-compute {:.2} tok/s (two prefills each, alternated): {:.3}x{}",
                p as f64 / on,
                p as f64 / off,
                off / on,
                if same { "" } else { "; THE NEXT TOKENS DIFFER" }
            )?;
        }
        Ok(())
    }
}

impl std::fmt::Display for PairedKnob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b] = self.values;
        let [sa, sb] = self.speeds.speeds();
        match self.knob {
            Knob::Prefetch => write!(
                f,
                "paired           prefetch {a} B ahead {sa} tok/s, {b} B ahead {sb} tok/s (alternate decoded tokens)"
            )?,
            Knob::Tasks => write!(
                f,
                "paired           {a} tasks per thread {sa} tok/s, {b} tasks per thread {sb} tok/s (alternate decoded tokens)"
            )?,
        }
        f.write_str(&self.speeds.ratio_note())
    }
}
