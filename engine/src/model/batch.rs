//! Several sequences in one forward (continuous batching): each brings its [`Session`] and
//! its next tokens (a decoded token, or a chunk of its prompt); the block is the
//! concatenation of all their rows.
//!
//! Per layer, the dense projections and the router run once over all rows (each weight read
//! once for every sequence), RoPE and the KV write use each row's own position, attention runs
//! per sequence over its own cache, and the MoE takes the union of every row's routed experts,
//! so one expert read serves every sequence routed to it. Every kernel computes each row on
//! its own, whatever rows share its call (see [`crate::kernels::matmul`] and `moe_block`), so
//! a sequence's logits are bit for bit those it gets alone through [`Model::forward`] or
//! [`Model::forward_greedy`], and its sampled tokens those of [`Model::forward_sample`]:
//! batching changes the speed, never a token.
//!
//! Non-goals: scheduling (which sequences join a step, how a prompt is chunked) belongs to
//! the caller; observers ([`super::Observer`]) are not offered here.

use super::{Model, Scratch, SeqRows, Session};
use crate::error::{Error, Result};
use crate::kernels::matmul;
use crate::ops;
use crate::sampling::Sampler;

use super::head::Choice;

/// What a sequence of a batched step wants after its last token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Nothing: a chunk of a prompt whose end is still to come.
    Nothing,
    /// The logits of its last token ([`Batch::logits`]).
    Logits,
    /// The greedy choice for its last token ([`Batch::choice`]): through the screened head
    /// when the model has one, as [`Model::forward_greedy`].
    Greedy,
    /// A token its sampler draws for its last token ([`Model::batch_sample`], after the
    /// step): through the screened head when the model has one and the sampler can prove the
    /// draw, as [`Model::forward_sample`]; else from its logits (computed with the other
    /// sequences' when the model has no screen).
    Sample,
}

/// One sequence's part of a batched step.
#[derive(Debug)]
pub struct Seq<'a> {
    /// Its session (KV cache and position).
    pub session: &'a mut Session,
    /// The tokens to run at its next positions: at least one, at most
    /// [`Session::max_step`].
    pub tokens: &'a [u32],
    /// What it wants from the head.
    pub want: Want,
}

/// What a sequence got from the last step.
#[derive(Clone, Copy, Debug)]
enum Output {
    None,
    /// Its row in [`Batch::logits`].
    Row(usize),
    Choice(Choice),
    /// Its rows in [`Batch::screen_x`] and [`Batch::screen_approx`], to sample from.
    Screen(usize),
}

/// The buffers of batched steps, reused from step to step, and each sequence's output of the
/// last one.
#[derive(Debug, Default)]
pub struct Batch {
    s: Scratch,
    /// Final-normed last rows of the sequences whose logits are computed, `[n, H]`.
    last: Vec<f32>,
    /// Their logits `[n, V]`.
    logits: Vec<f32>,
    /// Per sequence of the last step.
    out: Vec<Output>,
    /// Sequences whose logits are computed, and their rows in the block.
    rows: Vec<(usize, usize)>,
    /// The normed last rows of the sequences the screen chooses for, `[m, H]`, and their
    /// 8-bit logits `[m, V]` (the 8-bit head read once for all of them).
    screen_x: Vec<f32>,
    screen_approx: Vec<f32>,
    /// The whole head's logits of a sampled sequence whose draw the screen could not prove.
    fallback: Vec<f32>,
}

impl Batch {
    /// Empty buffers; they grow to the largest step run.
    pub fn new() -> Self {
        Self::default()
    }

    /// The logits of sequence `i` of the last step, if it wanted them (or wanted a greedy
    /// choice the screen could not make, or a token drawn and the model has no screen).
    pub fn logits(&self, i: usize, vocab: usize) -> Option<&[f32]> {
        match self.out.get(i) {
            Some(Output::Row(r)) => Some(&self.logits[r * vocab..(r + 1) * vocab]),
            _ => None,
        }
    }

    /// The greedy choice for sequence `i` of the last step, if it wanted one.
    pub fn choice(&self, i: usize, vocab: usize) -> Option<Choice> {
        match self.out.get(i) {
            Some(Output::Choice(c)) => Some(*c),
            Some(Output::Row(_)) => self.logits(i, vocab).map(Choice::of),
            _ => None,
        }
    }
}

impl Session {
    /// The most tokens one [`Seq`] of this session may bring to a batched step (the prefill
    /// block the session was made with: a sliding layer's ring holds its window and one
    /// block).
    pub fn max_step(&self) -> usize {
        self.block
    }
}

impl Model {
    /// Runs one step of several sequences together (see the module docs): each sequence's
    /// tokens at its session's next positions. Afterwards [`Batch::logits`] and
    /// [`Batch::choice`] give what each wanted, bit for bit what it would get alone.
    ///
    /// On an error (bad input, an expert that could not be had) no session's position has
    /// advanced: the step can be run again.
    pub fn forward_batch(&self, batch: &mut Batch, seqs: &mut [Seq<'_>]) -> Result<()> {
        batch.out.clear();
        if seqs.is_empty() {
            return Ok(());
        }
        for (i, q) in seqs.iter().enumerate() {
            if q.tokens.is_empty() {
                return Err(Error::Input(format!(
                    "sequence {i} of the batch has no tokens"
                )));
            }
            if q.tokens.len() > q.session.block {
                return Err(Error::Input(format!(
                    "sequence {i} of the batch brings {} tokens, more than its session's step of {}",
                    q.tokens.len(),
                    q.session.block
                )));
            }
            self.check_input(q.session, q.tokens)?;
        }
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let t: usize = seqs.iter().map(|q| q.tokens.len()).sum();
        let s = &mut batch.s;
        s.ensure(t, cfg);
        s.embed_row.resize(h * self.embed.fmt.size(), 0);
        let mut row = 0;
        for q in seqs.iter() {
            for &tok in q.tokens {
                self.read_rows(&self.embed, &[tok as usize], &mut s.embed_row)?;
                (self.embed.fmt).widen_into(&s.embed_row, &mut s.x[row * h..(row + 1) * h]);
                row += 1;
            }
        }
        // Each session's attention scores buffer, taken out for the step (moves, no
        // allocation) and put back whatever happens.
        let mut scores: Vec<Vec<f32>> = seqs
            .iter_mut()
            .map(|q| std::mem::take(&mut q.session.s.scores))
            .collect();
        let layers = (|| {
            for (l, layer) in self.layers.iter().enumerate() {
                let mut row = 0;
                let mut parts: Vec<SeqRows<'_>> = seqs
                    .iter_mut()
                    .zip(scores.iter_mut())
                    .map(|(q, sc)| {
                        let n = q.tokens.len();
                        let part = SeqRows {
                            kv: &mut q.session.kv[l],
                            scores: sc,
                            p0: q.session.pos,
                            row,
                            t: n,
                        };
                        row += n;
                        part
                    })
                    .collect();
                self.attention(layer, s, t, &mut parts);
                drop(parts);
                self.mlp(l, layer, s, t, None)?;
                if self.experts.wants_hints() {
                    self.predict_next(l, t, s);
                }
            }
            Ok::<_, Error>(())
        })();
        for (q, sc) in seqs.iter_mut().zip(scores) {
            q.session.s.scores = sc;
        }
        layers?;
        self.check_mapped()?;
        for q in seqs.iter_mut() {
            q.session.pos += q.tokens.len();
        }
        self.batch_head(batch, seqs)?;
        self.check_mapped()
    }

    /// The head of a batched step: each sequence's last row final-normed; greedy choices
    /// through the screen where the model has one (the sequence's own screen scratch and
    /// statistics, as alone), and the 8-bit logits of the sequences to sample from; every
    /// other wanted row's logits in one product.
    fn batch_head(&self, batch: &mut Batch, seqs: &mut [Seq<'_>]) -> Result<()> {
        let cfg = &self.cfg;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let w = self.vector(&self.final_norm);
        let head_mat = self.mat(&self.lm_head);
        let read = |rows: &[usize], bytes: &mut [u8]| self.read_rows(&self.lm_head, rows, bytes);
        let Batch {
            s,
            last,
            logits,
            out,
            rows,
            screen_x,
            screen_approx,
            fallback: _,
        } = batch;
        rows.clear();
        // The last row of each sequence, final-normed.
        screen_x.clear();
        let mut end = 0;
        for q in seqs.iter() {
            end += q.tokens.len();
            let r = end - 1;
            if q.want == Want::Nothing {
                continue;
            }
            let x = &mut s.h[r * h..(r + 1) * h];
            ops::rms_norm(&s.x[r * h..(r + 1) * h], &w, cfg.rms_norm_eps, x);
            if matches!(q.want, Want::Greedy | Want::Sample) && self.screen.is_some() {
                screen_x.extend_from_slice(x);
            }
        }
        // The greedy and sampled sequences' 8-bit logits in one pass over the 8-bit head.
        if let Some(sc) = &self.screen {
            if !screen_x.is_empty() {
                sc.approx_many(screen_x, screen_approx);
            }
        }
        let (mut screened, mut end) = (0, 0);
        for (i, q) in seqs.iter_mut().enumerate() {
            end += q.tokens.len();
            let r = end - 1;
            if q.want == Want::Nothing {
                out.push(Output::None);
                continue;
            }
            if q.want == Want::Sample && self.screen.is_some() {
                // Drawn after the step, with the sequence's sampler (`batch_sample`).
                out.push(Output::Screen(screened));
                screened += 1;
                continue;
            }
            if q.want == Want::Greedy {
                if let Some(sc) = &self.screen {
                    let x = &s.h[r * h..(r + 1) * h];
                    let vr = head_mat.rows();
                    let approx = &screen_approx[screened * vr..(screened + 1) * vr];
                    screened += 1;
                    let qs = &mut q.session.s;
                    let c = sc.choose_from(
                        &head_mat,
                        x,
                        approx,
                        &mut qs.screen,
                        &mut qs.screen_stats,
                        Some(&read),
                    )?;
                    if let Some(c) = c {
                        out.push(Output::Choice(c));
                        continue;
                    }
                }
                q.session.s.screen_stats.full += 1;
            }
            out.push(Output::Row(rows.len()));
            rows.push((i, r));
        }
        let n = rows.len();
        if n > 0 {
            last.resize(n * h, 0.0);
            for (j, &(_, r)) in rows.iter().enumerate() {
                last[j * h..(j + 1) * h].copy_from_slice(&s.h[r * h..(r + 1) * h]);
            }
            logits.resize(n * v, 0.0);
            matmul(&head_mat, &last[..n * h], &mut logits[..n * v]);
        }
        Ok(())
    }

    /// The token `sampler` draws for sequence `i` of the last [`forward_batch`](Self::forward_batch)
    /// step, which wanted [`Want::Sample`]; `session` is that sequence's session and `history`
    /// the tokens its repetition penalty applies to. Always the token [`Sampler::sample`]
    /// draws from the whole exact head's logits, as [`forward_sample`](Self::forward_sample)
    /// gives alone: through the screen when the model has one and the sampler can prove the
    /// draw, else from the whole head ([`Session::screen_stats`] counts how).
    pub fn batch_sample(
        &self,
        batch: &mut Batch,
        i: usize,
        session: &mut Session,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let sample = |sampler: &mut Sampler, logits: &[f32]| {
            sampler
                .sample(logits, history)
                .map_err(|e| Error::Input(e.to_string()))
        };
        let k = match batch.out.get(i) {
            Some(Output::Screen(k)) => *k,
            Some(Output::Row(r)) => {
                // No screen: the logits were computed with the step.
                session.s.screen_stats.full += 1;
                return sample(sampler, &batch.logits[r * v..(r + 1) * v]);
            }
            _ => {
                return Err(Error::Input(format!(
                    "sequence {i} of the last step did not ask for a token to be drawn"
                )))
            }
        };
        let screen = self.screen.as_ref().expect("a screened row has a screen");
        let head_mat = self.mat(&self.lm_head);
        let x = &batch.screen_x[k * h..(k + 1) * h];
        let vr = head_mat.rows();
        let approx = &batch.screen_approx[k * vr..(k + 1) * vr];
        let read = |rows: &[usize], bytes: &mut [u8]| self.read_rows(&self.lm_head, rows, bytes);
        let s = &mut session.s;
        let got = screen.sample_from(
            &head_mat,
            x,
            approx,
            sampler,
            history,
            &mut s.screen,
            &mut s.screen_stats,
            Some(&read),
        )?;
        self.check_mapped()?;
        if let Some(tok) = got {
            return Ok(tok);
        }
        s.screen_stats.full += 1;
        // The row alone, as `forward_sample` computes it (each row's bits are its own).
        batch.fallback.resize(v, 0.0);
        matmul(&head_mat, x, &mut batch.fallback[..v]);
        self.check_mapped()?;
        sample(sampler, &batch.fallback[..v])
    }
}
