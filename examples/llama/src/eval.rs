//! Validation loss: the model's mean cross-entropy over the answer tokens
//! of held-out samples, forward only (no gradient, no optimizer state),
//! the model read part by part from a [`ParamSource`] as generation reads
//! it ([`crate::train::EngineSource`] over a training engine: one unit in
//! host memory at a time, every rank reading the same parts together).

use zero::Result;

use super::data::{make_batch_with_pad, Sample};
use super::ops;
use super::train::{ParamSource, Part};
use super::{Block, BlockParams, Config};

/// Rows of logits computed at once by [`answer_loss`]: bounds the memory
/// of the LM head's output at a large vocabulary.
const LOGIT_ROWS: usize = 256;

/// The summed cross-entropy and the number of answer tokens of `batches`
/// batches of `micro` of `mine` (this rank's samples, in order; a batch
/// past their end is empty), padded with `pad`, each batch as long as its
/// longest sample. Every rank of an engine passes the same `batches` (so
/// that all read the same parts); a rank with no rows left reads them and
/// computes nothing.
#[allow(clippy::too_many_arguments)]
pub fn answer_loss(
    cfg: &Config,
    block: &Block,
    src: &mut dyn ParamSource,
    mine: &[&Sample],
    batches: usize,
    micro: usize,
    pad: u32,
    threads: usize,
) -> Result<(f64, usize)> {
    let dim = cfg.dim;
    let mut sum = 0f64;
    let mut count = 0usize;
    for i in 0..batches {
        let rows: &[&Sample] = mine
            .get(i * micro..((i + 1) * micro).min(mine.len()))
            .unwrap_or(&[]);
        let b = rows.len();
        let seq = rows.iter().map(|s| s.len()).max().unwrap_or(0);
        let (tokens, targets) =
            make_batch_with_pad(rows, seq, pad).map_err(|what| zero::Error::Unsupported {
                what: format!("validation batch: {what}"),
            })?;
        let embed = src.fetch(Part::Embed)?;
        let mut x = if b == 0 {
            Vec::new()
        } else {
            ops::embedding_forward(&embed[0], &tokens, dim)
        };
        drop(embed);
        for l in 0..cfg.n_layers {
            let p = src.fetch(Part::Layer(l))?;
            if b == 0 {
                continue;
            }
            let refs: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
            x = block
                .forward(&BlockParams::from_slices(&refs), &x, b, seq)
                .y;
        }
        let head = src.fetch(Part::Head)?;
        if b == 0 {
            continue;
        }
        // The LM head on the rows that carry loss, a slice at a time.
        let kept: Vec<usize> = (0..targets.len()).filter(|&r| targets[r] >= 0).collect();
        for chunk in kept.chunks(LOGIT_ROWS) {
            let xs: Vec<f32> = chunk
                .iter()
                .flat_map(|&r| x[r * dim..(r + 1) * dim].iter().copied())
                .collect();
            let (xn, _) = ops::rmsnorm_forward(&xs, &head[0], cfg.norm_eps);
            let logits = ops::linear_forward(&xn, &head[1], chunk.len(), dim, cfg.vocab, threads);
            let t: Vec<i32> = chunk.iter().map(|&r| targets[r]).collect();
            let (mean, _) = ops::cross_entropy(&logits, &t, cfg.vocab);
            sum += f64::from(mean) * chunk.len() as f64;
            count += chunk.len();
        }
    }
    Ok((sum, count))
}
