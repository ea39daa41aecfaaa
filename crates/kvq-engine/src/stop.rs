//! Stop strings matched across token boundaries: text that might be the start of a stop string
//! is held back until it either completes the stop (and is dropped) or cannot (and is emitted).

/// What pushing new text produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to emit now (possibly empty).
    Emit(String),
    /// A stop string matched; emit this text (everything before the stop) and finish.
    Stopped(String),
}

/// Tracks pending text against a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return StopOutcome::Emit(std::mem::take(&mut self.pending));
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(idx) = first {
            let out = self.pending[..idx].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        let hold = self.held_suffix_len();
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome::Emit(out)
    }

    /// Whatever is still held back (generation ended without a stop).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for (i, _) in p.char_indices() {
            let suffix = &p[i..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                best = p.len() - i;
                break;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Emit(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_split_across_tokens_is_never_emitted() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".to_string(), true)
        );
    }

    #[test]
    fn false_start_is_emitted() {
        assert_eq!(
            run(&["END"], &["a E", "Nx", "b"]),
            ("a ENxb".to_string(), false)
        );
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".to_string(), true));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "?"]),
            ("café?".to_string(), false)
        );
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".to_string(), true));
    }

    #[test]
    fn no_stops_passes_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
    }
}
