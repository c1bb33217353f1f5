//! AdamW exactly as `torch.optim.AdamW` (decoupled weight decay, bias correction), with
//! fp32 moments, parameter groups and optional fp32 master weights for half-precision
//! parameters.
//!
//! The update is one fused multithreaded pass over each parameter's f32 data (candle_nn's
//! AdamW issues about a dozen allocating tensor ops per parameter, which cost more than
//! forward and backward together on CPU).

use super::error::ModelError;
use super::gradients::{Gradients, NamedParam};
use super::ops::{contiguous_slice, Elem};
use candle_core::{CpuStorage, InplaceOp2, Layout};
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Mutex;

mod state_file;
mod update;

pub use state_file::StateSource;
use update::*;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    /// Default learning rate (each `step` passes the scheduled one).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (`p -= lr · wd · p`).
    pub weight_decay: f64,
    /// Decay norms and biases too (torch's default single group); when false they form
    /// a group with weight decay 0, as HF Trainer does.
    pub decay_norms_and_biases: bool,
}

impl Default for AdamWConfig {
    /// torch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_norms_and_biases: false,
        }
    }
}

/// `[training] optimizer_offload`: where a run keeps AdamW's state when its parameters are on a
/// GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerOffload {
    /// On the parameter's device (the default).
    #[default]
    None,
    /// In host RAM (ZeRO-Offload's idea): 8 bytes per parameter (12 with fp32 master
    /// weights) leave the GPU, for a host↔device copy of every gradient and parameter per step.
    Host,
}

impl OptimizerOffload {
    /// `Host` when `offloaded`, else `None` (a front end's on/off switch).
    pub fn host_if(offloaded: bool) -> Self {
        if offloaded {
            OptimizerOffload::Host
        } else {
            OptimizerOffload::None
        }
    }

    /// Whether the state lives in host RAM.
    pub fn is_host(self) -> bool {
        self == OptimizerOffload::Host
    }
}

/// Where the optimizer keeps its moments (and master weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatePlacement {
    /// On each parameter's device: host vectors updated in place for CPU parameters (the
    /// native fast path), device tensors for every other device.
    #[default]
    Auto,
    /// Device tensors on every parameter's device, updated with tensor ops: the code a GPU
    /// runs, also on the CPU (`TUNESTUDIO_OPS=generic`).
    Device,
    /// Host RAM whatever the parameter's device (ZeRO-Offload's idea): frees 8–12 bytes per
    /// parameter on the GPU for a host↔device copy of each gradient and parameter per step.
    Host,
}

/// One parameter's moments and optional fp32 master copy.
enum State {
    /// f32 vectors in host RAM.
    Host {
        m: Vec<f32>,
        v: Vec<f32>,
        master: Option<Vec<f32>>,
    },
    /// f32 tensors on the parameter's device.
    Device {
        m: Tensor,
        v: Tensor,
        master: Option<Tensor>,
    },
}

struct Slot {
    name: String,
    var: Var,
    decay: bool,
    state: State,
}

impl Slot {
    fn has_master(&self) -> bool {
        match &self.state {
            State::Host { master, .. } => master.is_some(),
            State::Device { master, .. } => master.is_some(),
        }
    }

    /// Moves the state to `placement` (a no-op when it is there already).
    fn place(&mut self, placement: StatePlacement) -> Result<(), ModelError> {
        let on_device = match placement {
            StatePlacement::Host => false,
            StatePlacement::Device => true,
            StatePlacement::Auto => !self.var.device().is_cpu(),
        };
        let dims = self.var.dims().to_vec();
        let device = self.var.device().clone();
        self.state = match (
            std::mem::replace(&mut self.state, State::empty()),
            on_device,
        ) {
            (State::Host { m, v, master }, true) => {
                let t = |x: Vec<f32>| Tensor::from_vec(x, dims.as_slice(), &device);
                State::Device {
                    m: t(m)?,
                    v: t(v)?,
                    master: master.map(t).transpose()?,
                }
            }
            (State::Device { m, v, master }, false) => State::Host {
                m: to_f32_vec(&m)?,
                v: to_f32_vec(&v)?,
                master: master.as_ref().map(to_f32_vec).transpose()?,
            },
            (same, _) => same,
        };
        Ok(())
    }
}

impl State {
    fn empty() -> Self {
        State::Host {
            m: Vec::new(),
            v: Vec::new(),
            master: None,
        }
    }
}

/// The optimizer: one state slot per trainable parameter.
pub struct AdamW {
    cfg: AdamWConfig,
    slots: Vec<Slot>,
    steps: u64,
    placement: StatePlacement,
}

/// Elements per rayon task in the update.
const CHUNK: usize = 1 << 15;
/// Elements per inner block of the typed update (a few KiB: stays in L1).
const BLOCK: usize = 256;

fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl AdamW {
    /// Creates state for every trainable parameter of `params`; `master_weights` keeps
    /// fp32 copies of bf16/f16 parameters.
    pub fn new(
        params: &[NamedParam],
        cfg: AdamWConfig,
        master_weights: bool,
    ) -> Result<Self, ModelError> {
        for (what, v) in [("beta1", cfg.beta1), ("beta2", cfg.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ModelError::Optimizer(format!(
                    "{what} must be in [0, 1), got {v}"
                )));
            }
        }
        let mut slots = Vec::new();
        for p in params.iter().filter(|p| p.trainable) {
            let n = p.var.elem_count();
            let master = if master_weights && p.var.dtype() != DType::F32 {
                Some(to_f32_vec(p.var.as_tensor())?)
            } else {
                None
            };
            let mut slot = Slot {
                name: p.name.clone(),
                var: p.var.clone(),
                decay: p.weight_decay || cfg.decay_norms_and_biases,
                state: State::Host {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                    master,
                },
            };
            slot.place(StatePlacement::Auto)?;
            slots.push(slot);
        }
        Ok(Self {
            cfg,
            slots,
            steps: 0,
            placement: StatePlacement::Auto,
        })
    }

    /// Moves every parameter's state to `placement` (see [`StatePlacement`]); later steps,
    /// checkpoints and resumes keep it there.
    pub fn set_state_placement(&mut self, placement: StatePlacement) -> Result<(), ModelError> {
        for s in &mut self.slots {
            s.place(placement)?;
        }
        self.placement = placement;
        Ok(())
    }

    /// Where the state lives.
    pub fn state_placement(&self) -> StatePlacement {
        self.placement
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// One update with learning rate `lr`; every gradient is first multiplied by
    /// `grad_multiplier` (token normalisation, clipping, loss-scale undo).
    pub fn step(
        &mut self,
        grads: &Gradients,
        lr: f64,
        grad_multiplier: f64,
    ) -> Result<(), ModelError> {
        // Validate everything first so a bad call leaves the state untouched.
        for s in &self.slots {
            let g = grads.get(&s.name).ok_or_else(|| {
                ModelError::Optimizer(format!(
                    "no gradient was given for trainable parameter `{}`",
                    s.name
                ))
            })?;
            if g.dims() != s.var.dims() {
                return Err(ModelError::Optimizer(format!(
                    "the gradient of `{}` has shape {:?}, the parameter {:?}",
                    s.name,
                    g.dims(),
                    s.var.dims()
                )));
            }
        }
        self.steps += 1;
        let t = self.steps as i32;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(t);
        let bc2_sqrt = (1.0 - b2.powi(t)).sqrt();
        let step_size = (lr / bc1) as f32;
        let bc2_sqrt = bc2_sqrt as f32;
        let eps = self.cfg.eps as f32;
        let one_m_b1 = (1.0 - b1) as f32;
        let (b2f, one_m_b2) = (b2 as f32, (1.0 - b2) as f32);
        let mult = grad_multiplier as f32;
        let coeffs = Coeffs {
            step_size,
            bc2_sqrt,
            eps,
            one_m_b1,
            b2: b2f,
            one_m_b2,
            mult,
        };
        for s in self.slots.iter_mut() {
            let Some(g) = grads.get(&s.name) else {
                continue;
            };
            let decay = if s.decay {
                (1.0 - lr * self.cfg.weight_decay) as f32
            } else {
                1.0
            };
            match &mut s.state {
                State::Device { m, v, master } => {
                    device_update(&s.var, m, v, master, g, decay, coeffs)?;
                }
                State::Host { m, v, master } => {
                    host_update(&s.var, m, v, master, g, decay, coeffs)?;
                }
            }
        }
        Ok(())
    }

    /// Number of `step` calls so far (drives bias correction).
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// Bytes of the state as allocated: every moment and master copy (f32), wherever it lives.
    pub fn state_bytes(&self) -> u64 {
        let f32_bytes = std::mem::size_of::<f32>() as u64;
        let tensor = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        self.slots
            .iter()
            .map(|s| match &s.state {
                State::Host { m, v, master } => {
                    (m.len() + v.len() + master.as_ref().map_or(0, Vec::len)) as u64 * f32_bytes
                }
                State::Device { m, v, master } => {
                    tensor(m) + tensor(v) + master.as_ref().map_or(0, tensor)
                }
            })
            .sum()
    }
}
