//! Saving and loading AdamW's state: the checkpoint tensors (`exp_avg.<name>`,
//! `exp_avg_sq.<name>`, `master.<name>`), streamed to a safetensors file or read back.

use super::*;

impl AdamW {
    /// The state for a checkpoint: `exp_avg.<name>`, `exp_avg_sq.<name>` and
    /// `master.<name>` (f32, CPU).
    pub fn state_tensors(&self) -> Result<HashMap<String, Tensor>, ModelError> {
        let mut out = HashMap::new();
        for s in &self.slots {
            let shape = s.var.shape().clone();
            let host = |x: &[f32]| Tensor::from_slice(x, shape.clone(), &Device::Cpu);
            let (m, v, master) = match &s.state {
                State::Host { m, v, master } => {
                    (host(m)?, host(v)?, master.as_deref().map(host).transpose()?)
                }
                State::Device { m, v, master } => (
                    m.to_device(&Device::Cpu)?,
                    v.to_device(&Device::Cpu)?,
                    master
                        .as_ref()
                        .map(|t| t.to_device(&Device::Cpu))
                        .transpose()?,
                ),
            };
            out.insert(format!("exp_avg.{}", s.name), m);
            out.insert(format!("exp_avg_sq.{}", s.name), v);
            if let Some(m) = master {
                out.insert(format!("master.{}", s.name), m);
            }
        }
        Ok(out)
    }

    /// Writes the state to a safetensors file under the names of [`AdamW::state_tensors`],
    /// one tensor at a time: host vectors are written from their own memory and a device
    /// tensor is copied to the host when its turn comes. Collecting the tensors first (as
    /// `state_tensors` does) holds a second copy of every moment while the file is written:
    /// 1.0 GiB more for SmolLM2-135M, twice the weights in f32 for any model — the process
    /// peak of a checkpoint, and tens of GB for a 7B model's host-offloaded state.
    pub fn save_state(&self, path: &std::path::Path) -> Result<(), ModelError> {
        let failed = Mutex::new(None);
        let mut views = Vec::with_capacity(3 * self.slots.len());
        for s in &self.slots {
            let shape = s.var.dims().to_vec();
            let (m, v, master) = match &s.state {
                State::Host { m, v, master } => (
                    StateData::Host(m),
                    StateData::Host(v),
                    master.as_deref().map(StateData::Host),
                ),
                State::Device { m, v, master } => (
                    StateData::Device(m),
                    StateData::Device(v),
                    master.as_ref().map(StateData::Device),
                ),
            };
            let view = |data| StateView {
                shape: shape.clone(),
                data,
                failed: &failed,
            };
            views.push((format!("exp_avg.{}", s.name), view(m)));
            views.push((format!("exp_avg_sq.{}", s.name), view(v)));
            if let Some(master) = master {
                views.push((format!("master.{}", s.name), view(master)));
            }
        }
        let written = safetensors::serialize_to_file(views, None, path);
        let failed = failed.lock().map_or(None, |mut f| f.take());
        match (written, failed) {
            (_, Some(message)) => Err(ModelError::Candle(candle_core::Error::Msg(format!(
                "cannot copy the optimizer state to the host for {}: {message}",
                path.display()
            )))),
            (Err(e), None) => Err(ModelError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            }),
            (Ok(()), None) => Ok(()),
        }
    }

    /// Restores a state saved by [`AdamW::state_tensors`].
    pub fn load_state_tensors(
        &mut self,
        t: &HashMap<String, Tensor>,
        steps_taken: u64,
    ) -> Result<(), ModelError> {
        self.load_state_from(t, steps_taken)
    }

    /// Restores a saved state one parameter at a time: every key and shape is checked first
    /// (nothing changes on a mismatch), then each parameter's moments are read, placed on its
    /// own device (or kept in host RAM) and the next one read. Each parameter's old state is
    /// freed before its saved one is read, so no device holds more than the optimizer's own
    /// state, and the host at most one parameter's m, v (and master) in f32 on their way to a
    /// GPU (the planner's resume figure, `plan::DevicePlan::resume_peak_bytes`, counts on this).
    pub fn load_state_from(
        &mut self,
        source: &dyn StateSource,
        steps_taken: u64,
    ) -> Result<(), ModelError> {
        let check = |key: &str, dims: &[usize]| -> Result<(), ModelError> {
            match source.dims(key) {
                None => Err(ModelError::Optimizer(format!("the optimizer state has no `{key}` (checkpoint from another model or LoRA setup?)"))),
                Some(found) if found != dims => Err(ModelError::Optimizer(format!(
                    "optimizer state `{key}` has shape {found:?}, the parameter {dims:?}"
                ))),
                Some(_) => Ok(()),
            }
        };
        for s in &self.slots {
            let dims = s.var.dims();
            check(&format!("exp_avg.{}", s.name), dims)?;
            check(&format!("exp_avg_sq.{}", s.name), dims)?;
            let key = format!("master.{}", s.name);
            if s.has_master() && source.dims(&key).is_some() {
                check(&key, dims)?;
            }
        }
        for s in &mut self.slots {
            let has_master = s.has_master();
            // The old state goes before the new one is read: on the CPU the vectors read are
            // the state itself, so a resume needs no memory beyond the optimizer's own. After a
            // failed read the optimizer is partly loaded; the caller discards it.
            s.state = State::empty();
            let m = source.load_f32(&format!("exp_avg.{}", s.name))?;
            let v = source.load_f32(&format!("exp_avg_sq.{}", s.name))?;
            let master = if has_master {
                let key = format!("master.{}", s.name);
                Some(match source.dims(&key) {
                    Some(_) => source.load_f32(&key)?,
                    None => to_f32_vec(s.var.as_tensor())?,
                })
            } else {
                None
            };
            s.state = State::Host { m, v, master };
            s.place(self.placement)?;
        }
        self.steps = steps_taken;
        Ok(())
    }
}

/// A saved optimizer state read one tensor at a time (a checkpoint's `optimizer.safetensors`
/// through `train::checkpoint::TensorFile`, or tensors already loaded).
pub trait StateSource {
    /// The shape of `key`, `None` when the state has no such tensor.
    fn dims(&self, key: &str) -> Option<Vec<usize>>;
    /// `key`'s values as f32 in host RAM.
    fn load_f32(&self, key: &str) -> Result<Vec<f32>, ModelError>;
}

impl StateSource for HashMap<String, Tensor> {
    fn dims(&self, key: &str) -> Option<Vec<usize>> {
        self.get(key).map(|t| t.dims().to_vec())
    }

    fn load_f32(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let t = self
            .get(key)
            .ok_or_else(|| ModelError::Optimizer(format!("the optimizer state has no `{key}`")))?;
        to_f32_vec(t)
    }
}

/// Where one state tensor's values are when a checkpoint writes them.
pub(super) enum StateData<'a> {
    Host(&'a [f32]),
    Device(&'a Tensor),
}

/// One f32 state tensor as [`AdamW::save_state`] writes it; a failed device copy is recorded
/// in `failed` (a `View` cannot return an error) and fails the save.
pub(super) struct StateView<'a> {
    shape: Vec<usize>,
    data: StateData<'a>,
    failed: &'a Mutex<Option<String>>,
}

impl safetensors::View for StateView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match &self.data {
            StateData::Host(values) => f32_le_bytes(values),
            StateData::Device(t) => match t.flatten_all().and_then(|t| t.to_vec1::<f32>()) {
                Ok(values) => std::borrow::Cow::Owned(f32_le_bytes(&values).into_owned()),
                Err(e) => {
                    if let Ok(mut f) = self.failed.lock() {
                        f.get_or_insert_with(|| e.to_string());
                    }
                    std::borrow::Cow::Owned(vec![0; self.data_len()])
                }
            },
        }
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * std::mem::size_of::<f32>()
    }
}

/// `values` as safetensors' little-endian bytes: borrowed on a little-endian host.
pub(super) fn f32_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and u8 has alignment 1; the length covers exactly the
        // slice's bytes, and the borrow keeps `values` alive.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        })
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}
