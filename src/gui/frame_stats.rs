//! The studio's own time per frame (the status bar's debug readout, and the frame-time
//! tests): a rolling window, no drawing.

/// A rolling window of frame times (the UI code's own time per frame).
#[derive(Debug, Clone)]
pub struct FrameStats {
    samples_ms: Vec<f32>,
    next: usize,
    /// Frames measured since start.
    pub frames: u64,
}

impl Default for FrameStats {
    fn default() -> Self {
        FrameStats {
            samples_ms: Vec::with_capacity(240),
            next: 0,
            frames: 0,
        }
    }
}

impl FrameStats {
    const WINDOW: usize = 240;

    /// Records one frame.
    pub fn record(&mut self, ms: f32) {
        if self.samples_ms.len() < Self::WINDOW {
            self.samples_ms.push(ms);
        } else {
            self.samples_ms[self.next] = ms;
        }
        self.next = (self.next + 1) % Self::WINDOW;
        self.frames += 1;
    }

    /// Mean frame time in the window.
    pub fn mean_ms(&self) -> f32 {
        if self.samples_ms.is_empty() {
            0.0
        } else {
            self.samples_ms.iter().sum::<f32>() / self.samples_ms.len() as f32
        }
    }

    /// The 95th percentile in the window.
    pub fn p95_ms(&self) -> f32 {
        self.percentile(0.95)
    }

    /// The longest frame in the window.
    pub fn max_ms(&self) -> f32 {
        self.samples_ms.iter().copied().fold(0.0, f32::max)
    }

    fn percentile(&self, q: f32) -> f32 {
        if self.samples_ms.is_empty() {
            return 0.0;
        }
        let mut v = self.samples_ms.clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let i = ((v.len() - 1) as f32 * q).round() as usize;
        v[i.min(v.len() - 1)]
    }

    /// "frame 1.2 ms avg · 2.5 ms p95 · 4.0 ms max (240 frames)".
    pub fn summary(&self) -> String {
        format!(
            "frame {:.2} ms avg · {:.2} ms p95 · {:.2} ms max ({} frames)",
            self.mean_ms(),
            self.p95_ms(),
            self.max_ms(),
            self.frames
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_stats_roll_over_the_window() {
        let mut f = FrameStats::default();
        for i in 0..500 {
            f.record(if i % 100 == 0 { 20.0 } else { 1.0 });
        }
        assert_eq!(f.frames, 500);
        assert!(f.mean_ms() > 1.0 && f.mean_ms() < 2.0, "{}", f.mean_ms());
        assert_eq!(f.max_ms(), 20.0);
        assert_eq!(f.p95_ms(), 1.0);
    }
}
