//! A block's parameters tensor by tensor, as the model holds them (one `Var` each): what a
//! sharded run slices, since it divides every tensor over the ranks on its own
//! ([`crate::plan::shard_elems`]), so a rank's share is not the block's total divided by R.

use super::*;

/// One parameter tensor of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSize {
    /// Its elements.
    pub elems: u64,
    /// Its bytes as stored (the compute dtype, or a quantized base's GGML blocks).
    pub bytes: u64,
    /// Whether the optimizer updates it.
    pub trainable: bool,
}

/// The parameter tensors of a block, in the model's order: the same parameters
/// [`block_parameters`] counts (tested: same totals), one entry per weight, bias, norm and
/// LoRA matrix (A is `r × in`, B `out × r`).
pub fn block_tensors(d: &StepDims, kind: BlockKind) -> Vec<TensorSize> {
    let full = d.lora.is_none();
    let dense = |elems: u64, trainable: bool| TensorSize {
        elems,
        bytes: elems * d.weight_bytes,
        trainable,
    };
    match kind {
        BlockKind::Embeddings => vec![dense(d.vocab * d.hidden, full)],
        BlockKind::Head => {
            let mut out = Vec::with_capacity(2);
            if !d.tied {
                out.push(dense(d.vocab * d.hidden, full));
            }
            out.push(dense(d.hidden, full));
            out
        }
        BlockKind::Layer(_) => {
            let mut out = Vec::with_capacity(24);
            for (name, i, o, bias) in d.linears() {
                out.push(match (full, d.quantize.format_for(i)) {
                    (false, Some(f)) => TensorSize {
                        elems: i * o,
                        bytes: f.matrix_bytes(i, o),
                        trainable: false,
                    },
                    _ => dense(i * o, full),
                });
                if bias {
                    out.push(dense(o, full));
                }
                if let (false, Some(r)) = (full, d.lora_targets(name)) {
                    out.push(dense(r * i, true));
                    out.push(dense(o * r, true));
                }
            }
            out.push(dense(d.hidden, full));
            out.push(dense(d.hidden, full));
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{parse_devices, LoraSpec, PlanRequest, Strategy};

    fn request(lora: Option<LoraSpec>) -> PlanRequest {
        let path = crate::paths::shared_dir()
            .join("model-configs")
            .join("qwen2.5-7b.json");
        PlanRequest {
            model: crate::model::ModelConfig::from_file(&path).expect("model config"),
            precision: Precision::Bf16Mixed,
            micro_batch: 1,
            gradient_accumulation: 1,
            seq_len: 64,
            activation_checkpointing: false,
            optimizer_offload: false,
            lora,
            strategy: Strategy::Single,
            shard: Default::default(),
            devices: parse_devices("80GiB").expect("devices"),
            ops: crate::model::OpsMode::Auto,
            process: None,
            trained_tokens: None,
            head_loss: Default::default(),
            reference: Default::default(),
            generations_per_micro_step: None,
            world: Default::default(),
        }
    }

    /// The tensors add up to the block's parameter counts and weight bytes, full, LoRA and
    /// QLoRA (Qwen2 has q/k/v biases: separate tensors).
    #[test]
    fn the_tensors_add_up_to_the_blocks_parameters() {
        let loras = [
            None,
            Some(LoraSpec::all_linear(16)),
            Some(LoraSpec::all_linear(8).quantized(Quantization::Q4K)),
        ];
        for lora in loras {
            let d = StepDims::new(&request(lora.clone()));
            for kind in [BlockKind::Embeddings, BlockKind::Layer(0), BlockKind::Head] {
                let p = block_parameters(&d, kind);
                let t = block_tensors(&d, kind);
                let sum = |f: fn(&TensorSize) -> u64| t.iter().map(f).sum::<u64>();
                assert_eq!(sum(|t| t.elems), p.total, "{lora:?} {kind}");
                assert_eq!(
                    sum(|t| if t.trainable { t.elems } else { 0 }),
                    p.trainable,
                    "{lora:?} {kind}"
                );
                assert_eq!(sum(|t| t.bytes), p.weight_bytes(&d), "{lora:?} {kind}");
                let largest = t
                    .iter()
                    .filter(|t| t.trainable)
                    .map(|t| t.elems)
                    .max()
                    .unwrap_or(0);
                assert_eq!(largest, p.largest_trainable, "{lora:?} {kind}");
            }
        }
    }
}
