//! Spotting a marker (`</think>`) in output that arrives a token at a time, where a token may
//! hold part of it: the grammar's reasoning gate and the server's reasoning-token count.

/// Watches a byte stream for `marker`.
#[derive(Debug, Clone)]
pub struct MarkerWatch {
    marker: Vec<u8>,
    /// The stream's last bytes, as many as could still be the start of `marker`.
    tail: Vec<u8>,
}

impl MarkerWatch {
    pub fn new(marker: &str) -> Self {
        Self { marker: marker.as_bytes().to_vec(), tail: Vec::new() }
    }

    /// Add the next bytes; true once `marker` has appeared (in them or across earlier ones).
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        self.tail.extend_from_slice(bytes);
        if self.tail.windows(self.marker.len().max(1)).any(|w| w == self.marker.as_slice()) {
            return true;
        }
        let keep = self.marker.len().saturating_sub(1);
        if self.tail.len() > keep {
            self.tail.drain(..self.tail.len() - keep);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_marker_across_pieces() {
        let mut w = MarkerWatch::new("</think>");
        assert!(!w.push(b"a </thi"));
        assert!(!w.push(b"nk"));
        assert!(w.push(b">\n"));
        let mut w = MarkerWatch::new("</think>");
        assert!(!w.push(b"</ think>"));
        assert!(w.push(b"x</think>y"));
    }
}
