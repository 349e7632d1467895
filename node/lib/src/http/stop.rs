//! Stop strings over streamed text: text is released as soon as it cannot be the start of a
//! stop string, and cut before the first stop string found.

/// Finds stop strings in text that arrives in pieces.
#[derive(Debug, Default)]
pub(super) struct StopMatcher {
    stops: Vec<String>,
    /// Text held back: it ends with the start of some stop string.
    pending: String,
    hit: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub(super) fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// Adds a piece; returns the text that is now safe to show and whether a stop string was
    /// found (then nothing after it is ever shown).
    pub(super) fn push(&mut self, text: &str) -> (String, bool) {
        if self.hit {
            return (String::new(), true);
        }
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            self.hit = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        let len = self.pending.len();
        let keep = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len().min(len + 1))
                    .rev()
                    .find(|&k| {
                        self.pending.is_char_boundary(len - k)
                            && s.starts_with(&self.pending[len - k..])
                    })
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let out: String = self.pending.drain(..len - keep).collect();
        (out, false)
    }

    /// Ends the text: what was held back (it turned out not to be a stop string).
    pub(super) fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        let mut hit = false;
        for p in pieces {
            let (o, h) = m.push(p);
            out.push(o);
            hit |= h;
        }
        (out, hit, m.finish())
    }

    #[test]
    fn cuts_before_a_stop_string_split_across_pieces() {
        let (out, hit, rest) = run(&["STOP"], &["hello S", "TO", "P and more"]);
        assert_eq!(out, ["hello ", "", ""]);
        assert!(hit);
        assert_eq!(rest, "");
        let (out, hit, _) = run(&["\n\n"], &["a\n", "\nb"]);
        assert_eq!(out.concat(), "a");
        assert!(hit);
    }

    #[test]
    fn releases_held_text_that_turns_out_not_to_stop() {
        let (out, hit, rest) = run(&["STOP"], &["ST", "ay", " ST"]);
        assert_eq!(out, ["", "STay", " "]);
        assert!(!hit);
        assert_eq!(rest, "ST");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_text_is_whole() {
        let (out, hit, _) = run(&["é!", "xyz", "b"], &["aaé", "!b"]);
        assert_eq!(out.concat(), "aa");
        assert!(hit);
        let (out, hit, rest) = run(&[], &["anything"]);
        assert_eq!(
            (out.concat(), hit, rest),
            ("anything".into(), false, String::new())
        );
    }
}
