//! The data order: the data module's seeded batch sampler per epoch and a position in it.
//!
//! The micro-batches of epoch `e` depend only on the seed, `e` and the sample lengths
//! ([`crate::data::batch_indices`]), so a run resumed from `(epoch, micro-batch index)` sees
//! exactly the rows the uninterrupted run would have seen.

/// Walks the training samples in micro-batches, epoch after epoch.
#[derive(Debug, Clone)]
pub struct DataLoader {
    lengths: Vec<usize>,
    micro_batch: usize,
    group_by_length: bool,
    seed: u64,
    epoch: u64,
    index: usize,
    batches: Vec<Vec<usize>>,
}

/// Mixes a seed with a stream id and counter into an independent seed (splitmix64),
/// so initialisation, dropout and anything else random never share a stream.
pub fn derive_seed(seed: u64, stream: u64, counter: u64) -> u64 {
    let mut z = seed
        ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ counter.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl DataLoader {
    /// A loader over samples of the given token `lengths`, at epoch 0.
    pub fn new(lengths: Vec<usize>, micro_batch: usize, group_by_length: bool, seed: u64) -> Self {
        let mut l = DataLoader {
            lengths,
            micro_batch: micro_batch.max(1),
            group_by_length,
            seed,
            epoch: 0,
            index: 0,
            batches: Vec::new(),
        };
        l.batches = l.batches_for(0);
        l
    }

    /// The micro-batches (sample indices) of `epoch`.
    pub fn batches_for(&self, epoch: u64) -> Vec<Vec<usize>> {
        crate::data::batch_indices(
            &self.lengths,
            self.micro_batch,
            self.group_by_length,
            true,
            self.seed,
            epoch,
        )
    }

    /// `(epoch, index of the next micro-batch in the epoch)`.
    pub fn position(&self) -> (u64, usize) {
        (self.epoch, self.index)
    }

    /// Moves to a saved position.
    pub fn set_position(&mut self, epoch: u64, index: usize) {
        if epoch != self.epoch {
            self.batches = self.batches_for(epoch);
        }
        self.epoch = epoch;
        self.index = index.min(self.batches.len());
    }

    /// Micro-batches per epoch.
    pub fn micro_batches_per_epoch(&self) -> usize {
        self.batches.len()
    }

    /// Optimizer steps per epoch with `accumulation` micro-batches per step (the last step
    /// of an epoch may have fewer micro-batches; steps never span two epochs).
    pub fn steps_per_epoch(&self, accumulation: usize) -> u64 {
        self.micro_batches_per_epoch().div_ceil(accumulation.max(1)) as u64
    }

    /// Fraction of epochs done.
    pub fn epoch_progress(&self) -> f64 {
        self.epoch as f64 + self.index as f64 / self.batches.len().max(1) as f64
    }

    /// The longest optimizer step the data allows, without moving the position: `accumulation`
    /// micro-batches of the longest samples, longest first (each is padded to its own longest
    /// row). The planner plans every micro-batch as long as `max_length`; this is that worst
    /// case as far as the rows reach it, whatever the order of the epochs.
    pub fn longest_step(&self, accumulation: usize) -> Vec<Vec<usize>> {
        let mut by_length: Vec<usize> = (0..self.lengths.len()).collect();
        by_length.sort_by_key(|&i| std::cmp::Reverse(self.lengths[i]));
        by_length
            .chunks(self.micro_batch)
            .take(accumulation.max(1))
            .map(<[usize]>::to_vec)
            .collect()
    }

    /// The micro-batches of the next optimizer step: up to `accumulation` of them,
    /// starting a new epoch first when the current one is used up.
    pub fn next_step(&mut self, accumulation: usize) -> Vec<Vec<usize>> {
        if self.lengths.is_empty() {
            return Vec::new();
        }
        if self.index >= self.batches.len() {
            self.epoch += 1;
            self.index = 0;
            self.batches = self.batches_for(self.epoch);
        }
        let end = (self.index + accumulation.max(1)).min(self.batches.len());
        let out = self.batches[self.index..end].to_vec();
        self.index = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_step_takes_the_longest_rows_and_keeps_the_position() {
        let mut l = DataLoader::new(vec![5, 90, 20, 90, 7, 60, 1], 2, false, 1);
        let before = l.position();
        assert_eq!(l.longest_step(2), vec![vec![1, 3], vec![5, 2]]);
        assert_eq!(
            l.longest_step(9).concat().len(),
            7,
            "no more rows than there are"
        );
        assert_eq!(l.position(), before);
        let _ = l.next_step(1);
        assert_eq!(l.longest_step(1), vec![vec![1, 3]]);
    }

    #[test]
    fn epochs_are_seeded_and_positions_restore() {
        let mut a = DataLoader::new(vec![5; 10], 3, false, 7);
        assert_eq!(a.steps_per_epoch(2), 2);
        let s1 = a.next_step(2);
        assert_eq!(s1.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3]);
        let s2 = a.next_step(2);
        assert_eq!(s2.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 1]);
        let mut seen: Vec<usize> = s1.concat().into_iter().chain(s2.concat()).collect();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        let pos = a.position();
        let next = a.next_step(2);
        assert_eq!(a.position().0, 1);
        let mut b = DataLoader::new(vec![5; 10], 3, false, 7);
        b.set_position(pos.0, pos.1);
        assert_eq!(b.next_step(2), next);
        assert_ne!(a.batches_for(0), a.batches_for(1));
    }
}
