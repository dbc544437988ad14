//! The deterministic workload `kda run` drives, so a test can rebuild every input it used and
//! check its figures against the library computed directly: `requests` fresh prefills of
//! `prompt_tokens` tokens each (request `r` in state slot `r`), then `decode_steps` steps in
//! which every request decodes one token.
//!
//! Hidden states are bf16, uniform in `[-1, 1)`, drawn from one [`Gen`] per step: seed
//! `seed ^ step_salt(step)` with step 0 the prefill and step `s + 1` decode step `s`.

use half::bf16;
use kda_model::layer::{BatchMeta, RequestSlots};

use crate::Gen;

/// A prefill-then-decode workload.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub decode_steps: usize,
    pub seed: u64,
}

/// Mixes the step number into the seed (a fixed odd multiplier, so steps never collide).
const fn step_salt(step: usize) -> u64 {
    (step as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Workload {
    /// Tokens of the prefill batch.
    pub fn prefill_tokens(&self) -> usize {
        self.requests * self.prompt_tokens
    }

    /// The prefill batch: every request fresh, request `r` in slot `r`.
    pub fn prefill_meta(&self) -> BatchMeta {
        let slots: Vec<usize> = (0..self.requests).collect();
        BatchMeta::prefills(&vec![self.prompt_tokens; self.requests], &slots)
    }

    /// Decode step `step` (from 0): one token per request, after the prompt and `step` earlier
    /// decoded tokens.
    pub fn decode_meta(&self, step: usize) -> BatchMeta {
        let mut meta = BatchMeta::empty();
        for r in 0..self.requests {
            meta.push(1, self.prompt_tokens + step, RequestSlots::Single(r));
        }
        meta
    }

    fn hidden(&self, step: usize, rows: usize, hidden: usize) -> Vec<bf16> {
        Gen::new(self.seed ^ step_salt(step)).uniform_bf16(rows * hidden, -1.0, 1.0)
    }

    /// The prefill's hidden states, `[requests * prompt_tokens, hidden]` row-major.
    pub fn prefill_hidden(&self, hidden: usize) -> Vec<bf16> {
        self.hidden(0, self.prefill_tokens(), hidden)
    }

    /// Decode step `step`'s hidden states, `[requests, hidden]` row-major.
    pub fn decode_hidden(&self, step: usize, hidden: usize) -> Vec<bf16> {
        self.hidden(step + 1, self.requests, hidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_and_inputs_are_deterministic_and_distinct() {
        let w = Workload { requests: 3, prompt_tokens: 5, decode_steps: 2, seed: 7 };
        let p = w.prefill_meta();
        assert_eq!(p.query_start_loc, [0, 5, 10, 15]);
        assert_eq!(p.num_computed_tokens, [0, 0, 0]);
        assert_eq!(p.slots[2], RequestSlots::Single(2));
        let d = w.decode_meta(1);
        assert_eq!(
            (d.query_start_loc.as_slice(), d.num_actual_tokens),
            ([0, 1, 2, 3].as_slice(), 3)
        );
        assert_eq!(d.num_computed_tokens, [6, 6, 6]);
        assert_eq!(w.prefill_hidden(4).len(), 60);
        assert_eq!(w.prefill_hidden(4), w.prefill_hidden(4));
        assert_ne!(w.decode_hidden(0, 4), w.decode_hidden(1, 4));
        assert!(w.decode_hidden(0, 4).iter().all(|v| (-1.0..1.0).contains(&v.to_f32())));
    }
}
