//! The forward pass (embeddings, every layer on its stage's device, the final norm), the
//! logits and the loss, and backward into a gradient store.

use super::super::error::ModelError;
use super::super::gradients::{Gradients, NamedParam};
use super::super::native_embedding;
use super::super::native_layer::{self, PassTables};
use super::super::ops::{self, lock};
use super::super::placed::{Home, Placed};
use super::super::{checkpoint, kernels};
use super::layer::{as_u32, build_attention_mask, rope_tables};
use super::*;
use candle_core::{DType, Device, Tensor, Var};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

impl CausalLm {
    /// The token whose embedding lookups give the embedding matrix no gradient, as
    /// transformers' decoders build `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`
    /// (Llama, Mistral, Qwen2): `config.pad_token_id` when the embeddings are trained and it
    /// is in the vocabulary. Only the lookup's part of that row is dropped: a tied lm-head
    /// still trains it. With pad = eos, as in SmolLM2's and many chat models' configs, this
    /// is a real token (`<|im_end|>` ends every ChatML turn), and full fine-tuning through
    /// transformers never trains its input embedding — measured on
    /// `fixtures/tiny-llama-dpo`, whose AdamW losses need it (`tests/it/preference_train.rs`).
    fn padding_idx(&self) -> Option<u32> {
        let pad = self.config.pad_token_id?;
        let trained = self.param(EMBED_NAME).is_some_and(|p| p.trainable);
        (trained && (pad as usize) < self.config.vocab_size).then_some(pad)
    }

    fn check_ids(&self, ids: &Tensor) -> Result<(), ModelError> {
        let max = ids.max_all()?.to_dtype(DType::U32)?.to_scalar::<u32>()?;
        if max as usize >= self.config.vocab_size {
            return Err(ModelError::Input(format!(
                "token id {max} is out of range for this model's vocab_size {} (tokenizer and model do not match?)",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    /// Runs embeddings, every layer and the final norm: `[b, t, hidden]` in the model dtype.
    pub(crate) fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        let ids = as_u32(input_ids, "input_ids")?.to_device(&self.device)?;
        let (b, t) = ids.dims2()?;
        if t == 0 || b == 0 {
            return Err(ModelError::Input("input_ids is empty".into()));
        }
        self.check_ids(&ids)?;
        let padding = padding_rows(&ids, attention_mask)?;
        let mut ctxs = StageCtxs::new(self, padding, (b, t), self.dropout_seed(train))?;
        let h = self.embed(&ids, train)?;
        let h = self.run_layers(h, &mut ctxs, train)?;
        kernels::rms_norm(&h, &self.modules.norm, self.config.rms_norm_eps, self.ops)
    }

    /// This forward's LoRA-dropout seed: a fresh one per training forward while dropout is on
    /// (checkpointed layers replay it to recompute the same masks), none otherwise.
    fn dropout_seed(&self, train: bool) -> Option<u64> {
        if train && self.lora.as_ref().is_some_and(|l| l.dropout > 0.0) {
            let n = self.forward_counter.fetch_add(1, Ordering::Relaxed);
            Some(self.dropout_seed_base ^ n.wrapping_mul(0x2545_F491_4F6C_DD1D))
        } else {
            None
        }
    }

    /// The token embeddings `[b, t, hidden]` of `ids` (`[b, t]` u32 on the model's device).
    fn embed(&self, ids: &Tensor, train: bool) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        let flat_ids = ids.flatten_all()?;
        let padding_idx = self.padding_idx();
        let rows = if train && self.native_embedding() {
            native_embedding::embedding(
                &self.modules.embed,
                flat_ids.to_vec1::<u32>()?,
                padding_idx,
                EMBED_NAME,
                &self.side_grads,
            )?
        } else {
            let rows = self.modules.embed.index_select(&flat_ids, 0)?;
            match padding_idx {
                // The pad token's rows come from a detached copy, so its lookups add
                // nothing to the embedding's gradient (`nn.Embedding(padding_idx=…)`).
                Some(pad) => flat_ids
                    .eq(pad)?
                    .unsqueeze(1)?
                    .broadcast_as(rows.shape())?
                    .where_cond(&rows.detach(), &rows)?,
                None => rows,
            }
        };
        Ok(rows.reshape((b, t, self.config.hidden_size))?)
    }

    /// Every decoder layer in order, each on its stage's device; returns the last layer's
    /// output on the head's device.
    fn run_layers(
        &self,
        embeddings: Tensor,
        ctxs: &mut StageCtxs<'_>,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        // The embeddings are stage 0's; every stage boundary is an explicit transfer.
        let mut h = Placed::new(embeddings, 0);
        for layer in &self.modules.layers {
            let ctx = ctxs.for_device(&layer.device)?;
            let home = Home {
                index: layer.owner,
                device: layer.device.clone(),
            };
            let x = h.to(&home)?.into_tensor();
            h = Placed::new(self.layer_forward(layer, &ctx, &x, train)?, layer.owner);
        }
        Ok(h.to(&self.head_home())?.into_tensor())
    }

    /// One layer on `x` (already on the layer's device): the native op where it applies,
    /// else the checkpointed or the plain candle layer.
    fn layer_forward(
        &self,
        layer: &Arc<Layer>,
        ctx: &Arc<Ctx>,
        x: &Tensor,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        if let Some(source) = &self.layer_source {
            checkpoint::gathered_layer(layer, source, ctx, x, &self.side_grads)
        } else if self.native_layers
            && self.native_kernels()
            && native_layer::applies(layer, ctx.ops, x)
        {
            Ok(native_layer::run(
                layer,
                &ctx.pass_tables()?,
                x,
                &self.side_grads,
                train && !self.checkpointing,
                ctx.dropout_seed,
            )?)
        } else if self.checkpointing {
            checkpoint::checkpointed_layer(layer, ctx, x, &self.side_grads)
        } else {
            layer.forward(x, ctx)
        }
    }

    /// Full logits `[b, t, vocab]` in f32 (for tests and generation; training uses
    /// [`CausalLm::loss`], which never materialises them all).
    pub fn logits(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, false)?;
        let (b, t, hidden) = h.dims3()?;
        let h2 = h.reshape((b * t, hidden))?;
        let logits = self.head_matmul(&h2)?.to_dtype(DType::F32)?;
        Ok(logits.reshape((b, t, self.config.vocab_size))?)
    }

    /// Whether training looks tokens up with the native embedding op (its gradient goes to
    /// the side table): native layers on, fused kernels, trainable dense f32 CPU embeddings.
    fn native_embedding(&self) -> bool {
        self.native_layers
            && self.native_kernels()
            && self.param(EMBED_NAME).is_some_and(|p| p.trainable)
            && native_embedding::applies(&self.modules.embed)
    }

    /// Where the fused loss sends the lm-head gradient instead of candle's store, under the same
    /// conditions as the native embedding (a tied head shares its side-table entry, so the
    /// embedding's backward adds into it in place).
    pub(crate) fn head_grad_sink(&self) -> Option<ops::WeightGradSink> {
        let name = self.head_param_name();
        let param = self.param(name)?;
        let head = &self.modules.lm_head;
        let usable = self.native_layers
            && self.native_kernels()
            && param.trainable
            && self
                .modules
                .head_transfer
                .as_ref()
                .is_none_or(|(owner, home)| {
                    Placed::new(head.clone(), *owner).transfer_shares_storage(home)
                })
            && head.id() == param.var.as_tensor().id()
            && native_embedding::applies(head);
        if !usable {
            return None;
        }
        let side = self.side_grads.clone();
        let name = name.to_string();
        Some(Box::new(move |g: Tensor| side.add(&name, g)))
    }

    /// The head's weight on the head's device, as the parameter is now: the parameter itself,
    /// or (a tied head under a layer split) a fresh differentiable transfer of it.
    pub(crate) fn head_weight(&self) -> Result<Tensor, ModelError> {
        match &self.modules.head_transfer {
            None => Ok(self.modules.lm_head.clone()),
            Some((owner, home)) => Ok(Placed::new(self.modules.lm_head.clone(), *owner)
                .to(home)?
                .into_tensor()),
        }
    }

    /// `[n, hidden] @ lm_head^T` → `[n, vocab]` in the model dtype.
    pub(crate) fn head_matmul(&self, h2: &Tensor) -> Result<Tensor, ModelError> {
        self.head_matmul_with(h2, &self.head_weight()?)
    }

    /// [`Self::head_matmul`] with the head's weight already fetched ([`Self::head_weight`]).
    pub(crate) fn head_matmul_with(
        &self,
        h2: &Tensor,
        head: &Tensor,
    ) -> Result<Tensor, ModelError> {
        if self.modules.lm_head_frozen {
            kernels::frozen_linear(h2, head, self.ops)
        } else {
            Ok(h2.matmul(&head.t()?)?)
        }
    }

    /// The summed causal-LM loss: labels are shifted inside (`labels[:, 1:]` scores
    /// `logits[:, :-1]`), -100 is ignored, and `sum / num_tokens` equals transformers'
    /// mean loss. See [`super::loss`] for how the logits are chunked.
    pub fn loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<LossOutput, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, true)?;
        super::super::loss::causal_lm_loss(self, &h, labels)
    }

    /// The summed loss for evaluation: no dropout, no graph kept, and the same chunked loss
    /// op training uses, which holds one chunk of logits at a time (the diagnostic
    /// [`CausalLm::token_losses`] holds three: logits, `logits − max` and their `exp`, which
    /// made evaluation the demo's largest moment, 323 MiB against 150 MiB for the step).
    pub fn eval_loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<(f64, usize), ModelError> {
        let h = self
            .hidden_states(input_ids, attention_mask, false)?
            .detach();
        let loss = super::super::loss::causal_lm_loss(self, &h, labels)?;
        let sum = loss.sum.detach().to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok((sum, loss.num_tokens))
    }

    /// Per-token cross-entropy `[b, t-1]` of the shifted labels (0 where ignored), f32.
    pub fn token_losses(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, false)?;
        super::super::loss::token_losses(self, &h, labels)
    }

    /// Gradients of every trainable parameter from `loss` (the `sum` of a [`LossOutput`],
    /// or anything derived from it). Fails with [`ModelError::MissingGradient`] when a
    /// trainable parameter received none.
    pub fn backward(&self, loss: &Tensor) -> Result<Gradients, ModelError> {
        let mut grads = Gradients::new();
        self.backward_into(loss, &mut grads)?;
        Ok(grads)
    }

    /// Adds the gradients of `loss` into `acc` (gradient accumulation over micro-batches)
    /// without ever holding two gradients of a parameter: each accumulated gradient is handed
    /// to the backward pass itself — to the side table for parameters whose gradient the
    /// native and checkpointed ops write there, through a [`ops::generic::gradient_tap`] to
    /// candle's store for the rest — so every new contribution is summed into it as it is
    /// produced, on any device. The peak is one gradient buffer per trainable parameter plus
    /// one parameter's transient (measured in `tests/train_memory.rs`).
    pub fn backward_into(&self, loss: &Tensor, acc: &mut Gradients) -> Result<(), ModelError> {
        let routed = std::mem::take(&mut *lock(&self.side_routed));
        // One sum of taps per stage: a tap lives on its parameter's device, and adding taps
        // of two stages would be a cross-device op (candle refuses it on two GPUs).
        let mut taps: std::collections::BTreeMap<usize, Placed> = Default::default();
        {
            self.side_grads.begin_backward();
            let mut side = self.side_grads.grads();
            side.clear();
            for (name, g) in std::mem::take(acc).into_pairs() {
                let param = self.param(&name).filter(|p| p.trainable);
                match param {
                    Some(p) if !routed.contains(&name) => {
                        let owner = self.param_owner(&name);
                        let tap =
                            Placed::new(ops::generic::gradient_tap(p.var.as_tensor(), g)?, owner);
                        let sum = match taps.remove(&owner) {
                            None => tap,
                            Some(sum) => sum.add(&tap, "gradient taps")?,
                        };
                        taps.insert(owner, sum);
                    }
                    _ => {
                        side.insert(name, g);
                    }
                }
            }
        }
        // The taps hang off the root, so candle processes them before the loss's graph. The
        // loss is the head's stage's; each stage's sum moves there explicitly.
        let head = self.head_home();
        let mut root = Placed::new(loss.clone(), head.index);
        if !taps.is_empty() {
            root = Placed::new(loss.to_dtype(DType::F32)?, head.index);
            for (_, sum) in taps {
                root = root.add(&sum.to(&head)?, "the loss and the gradient taps")?;
            }
        }
        let root = root.into_tensor();
        let mut store = root.backward()?;
        drop(root);
        let mut side = std::mem::take(&mut *self.side_grads.grads());
        let mut now_routed = std::collections::HashSet::new();
        for p in self.params.iter().filter(|p| p.trainable) {
            let from_side = side.remove(&p.name);
            if from_side.is_some() {
                now_routed.insert(p.name.clone());
            }
            // Taken out of the store so a summed gradient never sits beside its parts.
            let g = match (store.remove(p.var.as_tensor()), from_side) {
                (Some(a), Some(b)) => (a + b)?,
                (Some(a), None) => a,
                (None, Some(b)) => b,
                // Handed to the gradient sink as the backward produced it (sharded data
                // parallel's reduce-scatter, layer by layer).
                (None, None) if self.side_grads.streamed(&p.name) => continue,
                (None, None) => {
                    return Err(ModelError::MissingGradient {
                        name: p.name.clone(),
                    })
                }
            };
            acc.insert(&p.name, g);
        }
        *lock(&self.side_routed) = now_routed;
        Ok(())
    }

    /// Adds a parameter (LoRA factors) to the list.
    pub(crate) fn push_param(
        &mut self,
        name: String,
        t: Tensor,
        trainable: bool,
    ) -> Result<(), ModelError> {
        if let Some(&i) = self.index.get(&name) {
            self.params[i].var = Var::from_tensor(&t)?;
            self.params[i].trainable = trainable;
            return Ok(());
        }
        self.index.insert(name.clone(), self.params.len());
        self.params.push(NamedParam {
            weight_decay: !is_no_decay(&name),
            var: Var::from_tensor(&t)?,
            trainable,
            name,
        });
        Ok(())
    }

    /// Removes every parameter whose name matches `pred` (used when merging LoRA).
    pub(crate) fn remove_params(&mut self, pred: impl Fn(&str) -> bool) {
        self.params.retain(|p| !pred(&p.name));
        self.index = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
    }

    /// The device of decoder layer `layer`.
    pub fn layer_device(&self, layer: usize) -> Option<&Device> {
        self.layer_devices.get(layer)
    }
}

/// The attention mask's rows on the CPU (the masks are built there), checked against `ids`.
fn padding_rows(
    ids: &Tensor,
    attention_mask: Option<&Tensor>,
) -> Result<Option<Vec<Vec<u32>>>, ModelError> {
    let Some(m) = attention_mask else {
        return Ok(None);
    };
    let m = as_u32(m, "attention_mask")?;
    if m.dims() != ids.dims() {
        return Err(ModelError::Input(format!(
            "attention_mask has shape {:?} but input_ids has {:?}",
            m.dims(),
            ids.dims()
        )));
    }
    Ok(Some(m.to_device(&Device::Cpu)?.to_vec2::<u32>()?))
}

/// One forward's layer contexts (rope tables, masks), built once per device the layers sit on.
struct StageCtxs<'m> {
    lm: &'m CausalLm,
    padding: Option<Vec<Vec<u32>>>,
    /// `(batch, tokens)`.
    bt: (usize, usize),
    dropout_seed: Option<u64>,
    built: Vec<(Device, Arc<Ctx>)>,
}

impl<'m> StageCtxs<'m> {
    /// Builds the model device's context up front (the one every single-device layer uses).
    fn new(
        lm: &'m CausalLm,
        padding: Option<Vec<Vec<u32>>>,
        bt: (usize, usize),
        dropout_seed: Option<u64>,
    ) -> Result<Self, ModelError> {
        let mut ctxs = Self {
            lm,
            padding,
            bt,
            dropout_seed,
            built: Vec::new(),
        };
        ctxs.for_device(&lm.device)?;
        Ok(ctxs)
    }

    /// The context on `device`, built on first use.
    fn for_device(&mut self, device: &Device) -> Result<Arc<Ctx>, ModelError> {
        if let Some((_, c)) = self.built.iter().find(|(d, _)| d.same_device(device)) {
            return Ok(c.clone());
        }
        let c = self.build(device)?;
        self.built.push((device.clone(), c.clone()));
        Ok(c)
    }

    fn build(&self, device: &Device) -> Result<Arc<Ctx>, ModelError> {
        let (b, t) = self.bt;
        let lm = self.lm;
        let padding = self.padding.as_deref();
        let (cos, sin) = rope_tables(&lm.config, t, lm.dtype, device)?;
        let mask = build_attention_mask(padding, b, t, None, device)?;
        let sliding_mask = match lm.config.sliding_window {
            Some(w) if w < t => Some(build_attention_mask(padding, b, t, Some(w), device)?),
            _ => None,
        };
        Ok(Arc::new(Ctx {
            cos,
            sin,
            mask,
            sliding_mask,
            dropout_seed: self.dropout_seed,
            adapters: !lm.adapters_disabled.load(Ordering::Relaxed),
            ops: lm.ops,
            native_tables: OnceLock::new(),
        }))
    }
}

impl Ctx {
    /// The tables the native layers of this pass read ([`PassTables`]), built by the first one
    /// that asks.
    fn pass_tables(&self) -> candle_core::Result<Arc<PassTables>> {
        if let Some(tables) = self.native_tables.get() {
            return Ok(tables.clone());
        }
        let tables = Arc::new(PassTables::new(
            &self.cos,
            &self.sin,
            &self.mask,
            self.sliding_mask.as_ref(),
            self.adapters,
        )?);
        let _ = self.native_tables.set(tables.clone());
        Ok(tables)
    }
}
