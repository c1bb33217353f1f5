//! Balancing a pipeline (layer) split: which contiguous range of decoder
//! layers each device holds.
//!
//! Like transformers' `device_map="auto"`, the embeddings live on the first
//! device and the final norm + `lm_head` on the last; unlike it, the split is
//! balanced by what each layer costs *during training* (weights, gradients,
//! optimizer states, activations — the planner's per-layer bytes) and by each
//! device's capacity, not by weights alone filling devices in order.

use crate::units::format_bytes;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// What the model's parts cost on whatever device holds them (from the planner).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageCosts {
    /// Token embeddings (always on the first device).
    pub embeddings_bytes: u64,
    /// Each decoder layer, in order.
    pub layer_bytes: Vec<u64>,
    /// Final norm + `lm_head` + the loss (always on the last device).
    pub head_bytes: u64,
}

/// A balanced layer split over `device_bytes.len()` devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSplit {
    /// The decoder layers each device holds (contiguous, in device order; may be empty).
    pub ranges: Vec<Range<usize>>,
    /// Bytes each device holds (its layers, plus embeddings on the first, head on the last).
    pub device_bytes: Vec<u64>,
    /// Bytes each device can hold.
    pub capacities_bytes: Vec<u64>,
}

/// Why a split could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No devices were given.
    #[error("a layer split needs at least one device; choose one or more devices in the run's `devices` setting")]
    NoDevices,
    /// A device has zero capacity.
    #[error("device {device} has a capacity of 0 bytes; remove it from the run's devices or check that it is detected")]
    ZeroCapacity {
        /// Position of the device in the list.
        device: usize,
    },
    /// The per-layer cost list is empty.
    #[error("the model has no decoder layers to split; check the model's config.json (num_hidden_layers)")]
    NoLayers,
    /// A layer index was out of range.
    #[error("layer {layer} does not exist (the model has {layers} layers)")]
    NoSuchLayer {
        /// The layer asked for.
        layer: usize,
        /// How many layers there are.
        layers: usize,
    },
}

impl LayerSplit {
    /// Number of devices.
    pub fn num_devices(&self) -> usize {
        self.ranges.len()
    }

    /// Number of decoder layers split.
    pub fn num_layers(&self) -> usize {
        self.ranges.last().map(|r| r.end).unwrap_or(0)
    }

    /// The device (position) holding `layer`.
    pub fn device_of_layer(&self, layer: usize) -> Result<usize, PlacementError> {
        self.ranges
            .iter()
            .position(|r| r.contains(&layer))
            .ok_or(PlacementError::NoSuchLayer {
                layer,
                layers: self.num_layers(),
            })
    }

    /// The device (position) of every layer, in layer order.
    pub fn layer_devices(&self) -> Vec<usize> {
        self.ranges
            .iter()
            .enumerate()
            .flat_map(|(d, r)| r.clone().map(move |_| d))
            .collect()
    }

    /// `device_bytes / capacity` of the fullest device.
    pub fn max_utilization(&self) -> f64 {
        self.device_bytes
            .iter()
            .zip(&self.capacities_bytes)
            .map(|(&b, &c)| {
                if c == 0 {
                    f64::INFINITY
                } else {
                    b as f64 / c as f64
                }
            })
            .fold(0.0, f64::max)
    }

    /// Whether every device's share fits its capacity.
    pub fn fits(&self) -> bool {
        self.device_bytes
            .iter()
            .zip(&self.capacities_bytes)
            .all(|(b, c)| b <= c)
    }

    /// One line per device: "device 0: embeddings + layers 0–11 (3.2 GiB of 80.0 GiB)".
    pub fn describe(&self, labels: &[String]) -> Vec<String> {
        let last = self.ranges.len().saturating_sub(1);
        self.ranges
            .iter()
            .enumerate()
            .map(|(d, r)| {
                let mut parts = Vec::new();
                if d == 0 {
                    parts.push("embeddings".to_string());
                }
                match r.len() {
                    0 => {}
                    1 => parts.push(format!("layer {}", r.start)),
                    _ => parts.push(format!("layers {}–{}", r.start, r.end - 1)),
                }
                if d == last {
                    parts.push("norm + lm_head".to_string());
                }
                if parts.is_empty() {
                    parts.push("nothing".to_string());
                }
                let label = labels
                    .get(d)
                    .cloned()
                    .unwrap_or_else(|| format!("device {d}"));
                format!(
                    "{label}: {} ({} of {})",
                    parts.join(" + "),
                    format_bytes(self.device_bytes[d]),
                    format_bytes(self.capacities_bytes[d])
                )
            })
            .collect()
    }
}

/// Load of one device relative to its capacity, compared exactly
/// (cross-multiplied in u128) so the optimum does not depend on rounding.
#[derive(Debug, Clone, Copy)]
struct Ratio {
    bytes: u64,
    capacity: u64,
}

impl Ratio {
    fn less_than(self, other: Ratio) -> bool {
        (self.bytes as u128) * (other.capacity as u128)
            < (other.bytes as u128) * (self.capacity as u128)
    }

    fn max(self, other: Ratio) -> Ratio {
        if self.less_than(other) {
            other
        } else {
            self
        }
    }
}

/// Splits the layers into contiguous ranges, one per device in order, so that
/// the fullest device (bytes / capacity) is as empty as possible.
///
/// Exact dynamic programme over (device, first layer not yet placed):
/// O(devices × layers²), trivial for real models (≤ 16 devices, ≤ 128 layers).
/// Every device gets at least one layer when there are at least as many
/// layers as devices (a device the user chose is never left idle, and the
/// planner predicts memory for the same rule); with more devices than layers
/// the extra devices get none.
/// Among equally good splits the one found first (scanning cut points from the
/// left) is kept, so the result is deterministic.
///
/// The split is returned even when it does not fit (see [`LayerSplit::fits`]),
/// so the planner can show by how much.
pub fn balance_layers(
    costs: &StageCosts,
    capacities_bytes: &[u64],
) -> Result<LayerSplit, PlacementError> {
    balance_layers_with_fixed(costs, capacities_bytes, &vec![0; capacities_bytes.len()])
}

/// [`balance_layers`] where device `d` also pays `fixed_bytes[d]` whatever it holds
/// (a CUDA context, the largest in-layer transient): the planner's and the trainer's
/// split, so the layer ranges a plan shows are the ones training uses.
pub fn balance_layers_with_fixed(
    costs: &StageCosts,
    capacities_bytes: &[u64],
    fixed_bytes: &[u64],
) -> Result<LayerSplit, PlacementError> {
    let devices = capacities_bytes.len();
    if devices == 0 {
        return Err(PlacementError::NoDevices);
    }
    if let Some(device) = capacities_bytes.iter().position(|&c| c == 0) {
        return Err(PlacementError::ZeroCapacity { device });
    }
    let layers = costs.layer_bytes.len();
    if layers == 0 {
        return Err(PlacementError::NoLayers);
    }
    // prefix[i] = bytes of layers 0..i
    let mut prefix = vec![0u64; layers + 1];
    for (i, &b) in costs.layer_bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i].saturating_add(b);
    }
    let load = |d: usize, start: usize, end: usize| -> u64 {
        let mut bytes =
            (prefix[end] - prefix[start]).saturating_add(fixed_bytes.get(d).copied().unwrap_or(0));
        if d == 0 {
            bytes = bytes.saturating_add(costs.embeddings_bytes);
        }
        if d == devices - 1 {
            bytes = bytes.saturating_add(costs.head_bytes);
        }
        bytes
    };
    // best[d][i]: the smallest max ratio placing layers 0..i on devices 0..=d;
    // cut[d][i]: where device d's range starts in that optimum.
    let min_len = usize::from(layers >= devices);
    let mut best = vec![vec![None::<Ratio>; layers + 1]; devices];
    let mut cut = vec![vec![0usize; layers + 1]; devices];
    for (i, slot) in best[0].iter_mut().enumerate().skip(min_len) {
        *slot = Some(Ratio {
            bytes: load(0, 0, i),
            capacity: capacities_bytes[0],
        });
    }
    for d in 1..devices {
        let (done, rest) = best.split_at_mut(d);
        let previous = &done[d - 1];
        for i in 0..=layers {
            if i < min_len {
                continue;
            }
            let mut chosen: Option<(Ratio, usize)> = None;
            // Device d takes layers j..i, with at least `min_len` of them.
            for (j, before) in previous.iter().enumerate().take(i + 1 - min_len) {
                let Some(before) = *before else {
                    continue;
                };
                let here = Ratio {
                    bytes: load(d, j, i),
                    capacity: capacities_bytes[d],
                };
                let candidate = before.max(here);
                if chosen.is_none_or(|(c, _)| candidate.less_than(c)) {
                    chosen = Some((candidate, j));
                }
            }
            if let Some((ratio, j)) = chosen {
                rest[0][i] = Some(ratio);
                cut[d][i] = j;
            }
        }
    }
    // Walk the cuts back from (last device, all layers).
    let mut ranges = vec![0..0; devices];
    let mut end = layers;
    for d in (0..devices).rev() {
        let start = if d == 0 { 0 } else { cut[d][end] };
        ranges[d] = start..end;
        end = start;
    }
    let device_bytes = ranges
        .iter()
        .enumerate()
        .map(|(d, r)| load(d, r.start, r.end))
        .collect();
    Ok(LayerSplit {
        ranges,
        device_bytes,
        capacities_bytes: capacities_bytes.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(emb: u64, layers: &[u64], head: u64) -> StageCosts {
        StageCosts {
            embeddings_bytes: emb,
            layer_bytes: layers.to_vec(),
            head_bytes: head,
        }
    }

    /// Brute force over every set of cut points, for cross-checking.
    fn brute_force_max(c: &StageCosts, caps: &[u64]) -> f64 {
        let n = c.layer_bytes.len();
        let d = caps.len();
        let mut best = f64::INFINITY;
        // cut points: d-1 non-decreasing values in 0..=n
        fn rec(cuts: &mut Vec<usize>, d: usize, n: usize, f: &mut dyn FnMut(&[usize])) {
            if cuts.len() == d - 1 {
                f(cuts);
                return;
            }
            let lo = cuts.last().copied().unwrap_or(0);
            for x in lo..=n {
                cuts.push(x);
                rec(cuts, d, n, f);
                cuts.pop();
            }
        }
        rec(&mut Vec::new(), d, n, &mut |cuts| {
            let mut bounds = vec![0];
            bounds.extend_from_slice(cuts);
            bounds.push(n);
            if n >= d && bounds.windows(2).any(|w| w[1] == w[0]) {
                return; // every device must hold a layer
            }
            let mut worst: f64 = 0.0;
            for k in 0..d {
                let mut b: u64 = c.layer_bytes[bounds[k]..bounds[k + 1]].iter().sum();
                if k == 0 {
                    b += c.embeddings_bytes;
                }
                if k == d - 1 {
                    b += c.head_bytes;
                }
                worst = worst.max(b as f64 / caps[k] as f64);
            }
            best = best.min(worst);
        });
        best
    }

    #[test]
    fn equal_devices_get_balanced_contiguous_ranges() {
        let c = costs(100, &[10; 8], 100);
        let split = balance_layers(&c, &[1000, 1000]).unwrap();
        assert_eq!(split.ranges, vec![0..4, 4..8]);
        assert_eq!(split.device_bytes, vec![140, 140]);
        assert_eq!(split.layer_devices(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
        assert!(split.fits());
    }

    #[test]
    fn heavy_embeddings_push_layers_to_later_devices() {
        let c = costs(60, &[10; 6], 0);
        let split = balance_layers(&c, &[1000, 1000, 1000]).unwrap();
        // device 0 already holds 60 in embeddings: it keeps the one layer it must hold
        assert_eq!(split.ranges[0], 0..1);
        assert_eq!(split.device_bytes.iter().max(), Some(&70));
        assert_eq!(split.device_bytes.iter().sum::<u64>(), 120);
        // more devices than layers: the extra ones stay empty
        let c = costs(1, &[10, 10], 1);
        let split = balance_layers(&c, &[100, 100, 100]).unwrap();
        assert_eq!(split.num_layers(), 2);
        assert_eq!(split.ranges.iter().filter(|r| r.is_empty()).count(), 1);
    }

    #[test]
    fn capacities_shift_layers_to_the_bigger_device() {
        let c = costs(0, &[10; 9], 0);
        let split = balance_layers(&c, &[100, 200]).unwrap();
        assert_eq!(split.ranges, vec![0..3, 3..9]);
        assert!((split.max_utilization() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn matches_brute_force_on_irregular_costs() {
        let layer_sets: [&[u64]; 4] = [
            &[5, 1, 9, 3, 7, 2, 8],
            &[1, 1, 1, 50, 1, 1],
            &[30, 2, 2, 2, 30],
            &[7],
        ];
        let caps_sets: [&[u64]; 4] = [&[10, 10], &[10, 20, 5], &[100, 100, 100, 100], &[3, 9]];
        for layers in layer_sets {
            for caps in caps_sets {
                let c = costs(4, layers, 6);
                let split = balance_layers(&c, caps).unwrap();
                let expected = brute_force_max(&c, caps);
                assert!(
                    (split.max_utilization() - expected).abs() < 1e-12,
                    "{layers:?} {caps:?}: {} vs {expected}",
                    split.max_utilization()
                );
                assert_eq!(split.num_layers(), layers.len());
                // contiguous and covering
                let mut next = 0;
                for r in &split.ranges {
                    assert_eq!(r.start, next);
                    next = r.end;
                }
            }
        }
    }

    #[test]
    fn reports_overflow_and_bad_input() {
        let c = costs(0, &[100, 100], 0);
        let split = balance_layers(&c, &[50, 50]).unwrap();
        assert!(!split.fits());
        assert_eq!(balance_layers(&c, &[]), Err(PlacementError::NoDevices));
        assert_eq!(
            balance_layers(&c, &[1, 0]),
            Err(PlacementError::ZeroCapacity { device: 1 })
        );
        assert_eq!(
            balance_layers(&costs(0, &[], 0), &[1]),
            Err(PlacementError::NoLayers)
        );
        assert!(split.device_of_layer(5).is_err());
        let lines = split.describe(&["cpu:0".into(), "cpu:1".into()]);
        assert!(
            lines[0].starts_with("cpu:0: embeddings + layer 0"),
            "{lines:?}"
        );
        assert!(lines[1].contains("norm + lm_head"), "{lines:?}");
    }
}
