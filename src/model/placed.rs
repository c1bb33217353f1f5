//! Tensors that know which logical device owns them.
//!
//! A run's logical devices (`cpu:0`, `cpu:1`, `cuda:0`, a second stream of `cuda:0`) are the
//! stages of a layer split or the ranks of data parallel. On GPUs each is its own candle
//! device, and candle refuses an op whose operands sit on two of them
//! (`DeviceMismatchBinaryOp`). Logical CPU devices are all one `Device::Cpu`, so candle
//! cannot see such a mistake there, and no CPU test could.
//!
//! Every place where tensors of different stages or ranks meet (the gradient taps and the
//! loss they hang from, the activations crossing a stage boundary) combines [`Placed`]
//! tensors: [`Placed::add`] refuses two owners with [`ModelError::CrossDevice`] on every
//! device, the CPU included, and [`Placed::to`] is the one explicit transfer. The rule
//! costs one integer compare per combination, so it is always on, not only in tests.

use candle_core::{Device, Tensor};

use super::error::ModelError;

/// Set to `1`: a transfer between two logical CPU devices copies the tensor, as a transfer
/// between two GPUs does, instead of sharing its storage ([`Placed::to`]). Tests of layer
/// splits and data parallel on logical CPU devices set it; it costs a copy per transfer.
pub const DISTINCT_CPU_DEVICES_ENV: &str = "TUNESTUDIO_DISTINCT_CPU_DEVICES";

/// Whether [`DISTINCT_CPU_DEVICES_ENV`] is on (read per transfer: a few per forward pass).
pub fn distinct_cpu_devices() -> bool {
    std::env::var(DISTINCT_CPU_DEVICES_ENV).is_ok_and(|v| v.trim() == "1")
}

/// A logical device as the model sees it: its position among the run's devices (the stage
/// under a layer split, the rank under data parallel) and the candle device its tensors
/// live on.
#[derive(Debug, Clone)]
pub struct Home {
    /// Position among the run's `[devices]` entries.
    pub index: usize,
    /// The candle device (shared by every logical CPU device).
    pub device: Device,
}

impl Home {
    /// The only device of a run on one device.
    pub fn single(device: &Device) -> Self {
        Home {
            index: 0,
            device: device.clone(),
        }
    }
}

/// A tensor and the logical device that owns it.
#[derive(Debug, Clone)]
pub struct Placed {
    tensor: Tensor,
    owner: usize,
}

impl Placed {
    /// `tensor`, owned by logical device `owner`.
    pub fn new(tensor: Tensor, owner: usize) -> Self {
        Placed { tensor, owner }
    }

    /// The owning logical device's index.
    pub fn owner(&self) -> usize {
        self.owner
    }

    /// The tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The tensor, by value.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }

    /// `self + other`, both owned by the same logical device; `what` names the sum in the
    /// error (e.g. "gradient taps").
    pub fn add(&self, other: &Placed, what: &str) -> Result<Placed, ModelError> {
        self.same_owner(other, what)?;
        Ok(Placed::new((&self.tensor + &other.tensor)?, self.owner))
    }

    /// Fails unless both are owned by the same logical device.
    pub fn same_owner(&self, other: &Placed, what: &str) -> Result<(), ModelError> {
        if self.owner == other.owner {
            Ok(())
        } else {
            Err(ModelError::CrossDevice {
                what: what.to_string(),
                left: self.owner,
                right: other.owner,
            })
        }
    }

    /// The explicit transfer to `home` (a no-op when it already owns it). Differentiable:
    /// candle's backward moves the gradient back.
    ///
    /// Between two GPUs (or two streams of one) the result is a copy: a later in-place update
    /// of the source (an optimizer step) does not reach it. Between logical CPU devices candle
    /// shares the storage, so a copy kept across steps would look fresh on the CPU and be
    /// stale on GPUs (the tied head of a layer split was, until a GPU ran it). With
    /// [`DISTINCT_CPU_DEVICES_ENV`] set, a transfer between logical CPU devices copies too, so
    /// CPU tests see what GPUs see.
    pub fn to(&self, home: &Home) -> Result<Placed, ModelError> {
        let moved = if self.transfer_shares_storage(home) {
            self.tensor.clone()
        } else if self.tensor.device().same_device(&home.device) {
            // Only the view's elements: `Tensor::copy` clones a CPU view's whole storage
            // (a rank's range of a gradient would cost the whole gradient).
            self.tensor.force_contiguous()?
        } else {
            self.tensor.to_device(&home.device)?
        };
        Ok(Placed::new(moved, home.index))
    }

    /// Whether [`Self::to`] hands back this very storage: the same candle device, and no copy
    /// forced between two logical CPU devices.
    pub fn transfer_shares_storage(&self, home: &Home) -> bool {
        self.tensor.device().same_device(&home.device)
            && (self.owner == home.index || !distinct_cpu_devices())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_of_two_logical_cpu_devices_do_not_add_without_a_transfer() {
        let a = Placed::new(Tensor::new(1f32, &Device::Cpu).unwrap(), 0);
        let b = Placed::new(Tensor::new(2f32, &Device::Cpu).unwrap(), 1);
        let err = a.add(&b, "gradient taps").unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::CrossDevice {
                    left: 0,
                    right: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("gradient taps"), "{err}");
        let moved = b
            .to(&Home {
                index: 0,
                device: Device::Cpu,
            })
            .unwrap();
        let sum = a.add(&moved, "gradient taps").unwrap();
        assert_eq!(sum.owner(), 0);
        assert_eq!(sum.tensor().to_scalar::<f32>().unwrap(), 3.0);
    }
}
