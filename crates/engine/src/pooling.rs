//! Embeddings: how a prompt's final hidden states (after the model's last norm) become one vector.
//! A pooling request is a prompt-only sequence; the runner hands back the hidden rows its chunks
//! ask for, and a [`Pooler`] folds them in as the prompt's chunks arrive, so chunked prefill needs
//! no buffer of the whole prompt. The configuration follows vLLM's `--pooler-config` and
//! sentence-transformers' `modules.json` / `1_Pooling/config.json`.

use flint_model::LogitsRows;

/// Which hidden rows make the embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingType {
    /// The last token's (Qwen3-Embedding, decoder models generally).
    Last,
    /// The mean over every prompt token.
    Mean,
    /// The first token's.
    Cls,
}

impl PoolingType {
    /// vLLM's names (`LAST`, `MEAN`, `CLS`), any case.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "LAST" | "LASTTOKEN" | "LAST_TOKEN" => Some(PoolingType::Last),
            "MEAN" => Some(PoolingType::Mean),
            "CLS" => Some(PoolingType::Cls),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PoolingType::Last => "LAST",
            PoolingType::Mean => "MEAN",
            PoolingType::Cls => "CLS",
        }
    }

    /// Every position's hidden state counts: a prefix-cache hit would skip some.
    pub fn needs_every_row(self) -> bool {
        !matches!(self, PoolingType::Last)
    }

    /// The hidden rows a chunk of a pooling sequence returns: it starts at `context_len` and,
    /// when `last`, ends the prompt.
    pub fn rows(self, context_len: usize, last: bool) -> LogitsRows {
        match self {
            PoolingType::Last if last => LogitsRows::Last,
            PoolingType::Mean => LogitsRows::All,
            PoolingType::Cls if context_len == 0 => LogitsRows::All,
            _ => LogitsRows::None,
        }
    }
}

/// How a server pools: the type and whether vectors are L2-normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolerConfig {
    pub pooling_type: PoolingType,
    pub normalize: bool,
}

impl Default for PoolerConfig {
    fn default() -> Self {
        Self { pooling_type: PoolingType::Last, normalize: true }
    }
}

/// What an embedding request asks of its sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolingParams {
    pub config: PoolerConfig,
    /// Keep the first this many dimensions (Matryoshka), then normalise again if normalising.
    pub dimensions: Option<usize>,
}

/// One sequence's embedding as its chunks arrive: a running f64 sum for the mean, the row itself
/// for the first and last tokens.
#[derive(Debug, Clone)]
pub struct Pooler {
    params: PoolingParams,
    sum: Vec<f64>,
    rows: usize,
}

impl Pooler {
    pub fn new(params: PoolingParams) -> Self {
        Self { params, sum: Vec::new(), rows: 0 }
    }

    /// Fold in the hidden rows a chunk returned (`hidden` is `rows · width`), which
    /// [`PoolingType::rows`] chose for it; `first_pos` is the prompt position of its first row.
    /// A preempted sequence computes its prompt again: rows already folded in are skipped.
    pub fn push(&mut self, hidden: &[f32], width: usize, first_pos: usize) {
        if width == 0 {
            return;
        }
        let n = hidden.len() / width;
        match self.params.config.pooling_type {
            PoolingType::Mean => {
                self.sum.resize(width, 0.0);
                let skip = self.rows.saturating_sub(first_pos);
                for row in hidden.chunks_exact(width).skip(skip) {
                    for (s, &x) in self.sum.iter_mut().zip(row) {
                        *s += f64::from(x);
                    }
                    self.rows += 1;
                }
            }
            PoolingType::Cls if self.rows == 0 && n > 0 => {
                self.sum = hidden[..width].iter().map(|&x| f64::from(x)).collect();
                self.rows = 1;
            }
            PoolingType::Last if n > 0 => {
                self.sum = hidden[(n - 1) * width..n * width].iter().map(|&x| f64::from(x)).collect();
                self.rows = 1;
            }
            _ => {}
        }
    }

    /// No row has arrived yet.
    pub fn is_empty(&self) -> bool {
        self.rows == 0 || self.sum.is_empty()
    }

    /// The embedding: pooled, truncated to `dimensions`, L2-normalised when configured (in f64,
    /// then rounded once to f32). `None` if no row arrived (an engine bug, reported upstream).
    pub fn finish(&self) -> Option<Vec<f32>> {
        if self.is_empty() {
            return None;
        }
        let scale = 1.0 / self.rows as f64;
        let mut v: Vec<f64> = self.sum.iter().map(|&s| s * scale).collect();
        if let Some(d) = self.params.dimensions {
            v.truncate(d.max(1));
        }
        if self.params.config.normalize {
            // As torch.nn.functional.normalize: x / max(‖x‖, 1e-12).
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= norm);
        }
        Some(v.into_iter().map(|x| x as f32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: PoolingType, normalize: bool, dimensions: Option<usize>) -> PoolingParams {
        PoolingParams { config: PoolerConfig { pooling_type: t, normalize }, dimensions }
    }

    /// Rows 0..4 of width 2, as chunks of 3 and 1 would deliver them.
    fn feed(t: PoolingType, p: &mut Pooler) {
        let rows: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        for (ctx, chunk) in [(0usize, &rows[..6]), (3, &rows[6..])] {
            let n = chunk.len() / 2;
            let sel = t.rows(ctx, ctx + n == 4).rows(n);
            p.push(&chunk[sel.start * 2..sel.end * 2], 2, ctx + sel.start);
        }
    }

    #[test]
    fn chunks_pool_to_the_mean_first_and_last_rows() {
        for (t, want) in
            [(PoolingType::Mean, [4.0, 5.0]), (PoolingType::Cls, [1.0, 2.0]), (PoolingType::Last, [7.0, 8.0])]
        {
            let mut p = Pooler::new(params(t, false, None));
            feed(t, &mut p);
            assert_eq!(p.finish().unwrap(), want, "{t:?}");
            // Preempted after both chunks and computed again: the same vector.
            feed(t, &mut p);
            assert_eq!(p.finish().unwrap(), want, "{t:?} recomputed");
        }
    }

    #[test]
    fn normalising_and_truncating() {
        let mut p = Pooler::new(params(PoolingType::Last, true, None));
        p.push(&[3.0, 4.0], 2, 0);
        assert_eq!(p.finish().unwrap(), [0.6, 0.8]);
        let mut p = Pooler::new(params(PoolingType::Last, true, Some(1)));
        p.push(&[-3.0, 4.0], 2, 0);
        assert_eq!(p.finish().unwrap(), [-1.0], "truncated first, then renormalised");
        assert!(Pooler::new(params(PoolingType::Mean, true, None)).finish().is_none());
        assert_eq!(PoolingType::parse("mean"), Some(PoolingType::Mean));
        assert_eq!(PoolingType::parse("lasttoken"), Some(PoolingType::Last));
        assert_eq!(PoolingType::parse("max"), None);
    }
}
