//! Stop strings over streamed text. A stop string can arrive split across several tokens, so text
//! that might be the start of one is held back until it either completes the match (and is never
//! sent) or diverges (and is released), as vLLM does.

/// Result of feeding new detokenized text.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StopOutcome {
    /// Text now safe to send to the client.
    pub released: String,
    /// The stop string that matched, if any (generation must end).
    pub matched: Option<String>,
}

pub struct StopStrings {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    /// Received text not yet released: always a proper prefix of some stop string between pushes.
    held: String,
    /// A stop matched: nothing after it may be released.
    done: bool,
}

impl StopStrings {
    /// Empty strings are ignored: they would match before any text.
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, include_stop_str_in_output, held: String::new(), done: false }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome { released: text.to_owned(), matched: None };
        }
        self.held.push_str(text);
        // Earliest start wins, then the longest stop there. Held text had no match of its own, so
        // no match can lie entirely before the new text, and none can start in released text
        // (that text was released precisely because no stop could start in it).
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
        if let Some((at, stop)) = found {
            let end = at + if self.include_stop_str_in_output { stop.len() } else { 0 };
            let matched = Some(stop.clone());
            let mut released = std::mem::take(&mut self.held);
            released.truncate(end);
            self.done = true;
            return StopOutcome { released, matched };
        }
        let keep = self.stops.iter().map(|s| partial_suffix(&self.held, s)).max().unwrap_or(0);
        let tail = self.held.split_off(self.held.len() - keep);
        let released = std::mem::replace(&mut self.held, tail);
        StopOutcome { released, matched: None }
    }

    /// Release `text` (and anything held) without matching: before `min_tokens`, stop strings
    /// do not apply.
    pub fn pass_through(&mut self, text: &str) -> String {
        if self.done {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        out.push_str(text);
        out
    }

    /// End of generation without a match: release whatever was held back.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`. Only
/// prefixes ending on a char boundary of `stop` count, so the suffix starts on one of `text`'s.
fn partial_suffix(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.as_bytes().ends_with(&stop.as_bytes()[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str], include: bool) -> StopStrings {
        StopStrings::new(s.iter().map(|s| s.to_string()).collect(), include)
    }

    fn released(o: StopOutcome) -> String {
        assert_eq!(o.matched, None);
        o.released
    }

    #[test]
    fn stop_split_across_three_pushes() {
        let mut s = stops(&["<END>"], false);
        assert_eq!(released(s.push("hello <E")), "hello ");
        assert_eq!(released(s.push("N")), "");
        let o = s.push("D> trailing");
        assert_eq!(o, StopOutcome { released: String::new(), matched: Some("<END>".into()) });
        assert_eq!(s.push("more"), StopOutcome::default());
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn held_text_is_released_when_it_diverges() {
        let mut s = stops(&["stop"], false);
        assert_eq!(released(s.push("a st")), "a ");
        assert_eq!(released(s.push("o")), "");
        assert_eq!(released(s.push("rm s")), "storm ");
        assert_eq!(s.flush(), "s");
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn multi_byte_chars_are_never_split() {
        let mut s = stops(&["日本語", "é!"], false);
        assert_eq!(released(s.push("café")), "caf");
        assert_eq!(released(s.push("日")), "é");
        assert_eq!(released(s.push("本")), "");
        assert_eq!(released(s.push("人")), "日本人");
        let o = s.push("x日本語y");
        assert_eq!(o, StopOutcome { released: "x".into(), matched: Some("日本語".into()) });
    }

    #[test]
    fn include_flag_keeps_the_stop_string() {
        let mut s = stops(&["</s>"], true);
        assert_eq!(released(s.push("answer</")), "answer");
        let o = s.push("s>ignored");
        assert_eq!(o, StopOutcome { released: "</s>".into(), matched: Some("</s>".into()) });
    }

    #[test]
    fn earliest_match_wins_then_longest() {
        let mut s = stops(&["world", "lo w", "o"], false);
        let o = s.push("hello world");
        assert_eq!(o, StopOutcome { released: "hel".into(), matched: Some("lo w".into()) });
        let mut s = stops(&["o", "o w"], true);
        let o = s.push("hello world");
        assert_eq!(o, StopOutcome { released: "hello w".into(), matched: Some("o w".into()) });
    }

    #[test]
    fn overlapping_stop_prefixes() {
        let mut s = stops(&["ab", "bc"], false);
        assert_eq!(released(s.push("xa")), "x");
        assert_eq!(s.push("bc"), StopOutcome { released: String::new(), matched: Some("ab".into()) });
        // "abd" holds "ab"; "bc" then completes inside the held text, after the "a".
        let mut s = stops(&["abd", "bc"], false);
        assert_eq!(released(s.push("ab")), "");
        assert_eq!(s.push("c"), StopOutcome { released: "a".into(), matched: Some("bc".into()) });
    }

    #[test]
    fn no_stops_pass_text_through() {
        let mut s = stops(&["", ""], false);
        assert_eq!(released(s.push("abc")), "abc");
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn flush_releases_a_held_prefix() {
        let mut s = stops(&["\n\nUser:"], false);
        assert_eq!(released(s.push("done.\n\nUs")), "done.");
        assert_eq!(s.flush(), "\n\nUs");
    }
}
