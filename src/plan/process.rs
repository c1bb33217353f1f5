//! What a CPU run's *process* holds besides the training tensors: the resident set (`VmHWM`,
//! what `top` and `/usr/bin/time -v` show) is the training step's heap plus the terms below,
//! and the step is not always the process's largest moment (the evaluation and the loading of
//! the weights can be larger).
//!
//! Every constant was measured on this project's binary (the large-block pool over mimalloc,
//! transparent huge pages off, see `src/main.rs`) with `examples/rss_breakdown.rs` (stage-by-stage
//! `VmRSS`/`VmHWM` next to the heap counted on top of that allocator) and `/usr/bin/time -v`:
//! the runtime, tokenizer, dataset and loading terms on the bundled demo (`assets/demo.toml`),
//! the allocator's retention on whole runs of `scripts/rss-vs-plan.sh` (the demo's 2-step run
//! is what `tests/it/plan_rss.rs` checks); how, and the numbers, are next to each constant.
//! The training-tensor figure of [`super::estimate`] stays one line of the breakdown.

use super::step_model::StepDims;

/// What the process loads besides the model's tensors: sizes on disk the planner turns into
/// resident bytes. Filled by the run-config adapter (`train::plan_request`); `None` in a
/// [`super::PlanRequest`] plans the training tensors only (what the counting allocator sees).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessInputs {
    /// Bytes of the model's `tokenizer.json` (0 when there is none).
    pub tokenizer_file_bytes: u64,
    /// Bytes of the dataset files (training and validation) on disk.
    pub dataset_file_bytes: u64,
    /// Bytes of the safetensors weights the loader maps (0 for a random initialisation).
    pub mapped_weights_bytes: u64,
    /// Whether the run evaluates on a validation split.
    pub evaluation: bool,
    /// Whether the studio (the GUI) runs in the same process.
    pub gui: bool,
    /// Only one training step runs (the dry run): no batch of another shape follows it, so
    /// the allocator's retention across shapes does not build up.
    #[serde(default)]
    pub single_step: bool,
}

/// One named term of the process's resident set.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProcessTerm {
    /// What it is ("tokenizer", "allocator retention", ...).
    pub name: &'static str,
    /// Its resident bytes.
    pub bytes: u64,
    /// Where the figure comes from (measured how, or derived from what).
    pub source: &'static str,
}

/// The process's resident set at its peak, on the device that carries it (the first CPU
/// device): the largest moment's heap and the terms that stay resident around it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProcessFootprint {
    /// The moment whose heap is the largest: "training step", "evaluation" or "loading".
    pub largest_moment: &'static str,
    /// The training step's tensors (the planner's step figure, as before).
    pub training_tensors_bytes: u64,
    /// The evaluation's heap (0 without evaluation).
    pub evaluation_bytes: u64,
    /// The heap while the weights are loaded (mapped file pages + loaded tensors).
    pub loading_bytes: u64,
    /// Pages of gemm's per-thread slabs that no product touches: counted in the training
    /// tensors (the heap sees each slab whole) but never resident, so left out of the peak
    /// when the training step is the largest moment (`GemmGeometry::resident_workspace_bytes`).
    pub untouched_workspace_bytes: u64,
    /// Everything else, named, with its source.
    pub terms: Vec<ProcessTerm>,
    /// The process's predicted peak resident set.
    pub peak_bytes: u64,
}

impl ProcessFootprint {
    /// The terms' sum (the resident set besides the largest moment's heap).
    pub fn baseline_bytes(&self) -> u64 {
        self.terms.iter().map(|t| t.bytes).sum()
    }

    /// The slab pages left out of the peak: [`Self::untouched_workspace_bytes`] when the
    /// training step is the largest moment (the other moments' heaps count no slab).
    pub fn untouched_at_peak_bytes(&self) -> u64 {
        if self.largest_moment == TRAINING_STEP {
            self.untouched_workspace_bytes
        } else {
            0
        }
    }
}

const MIB: u64 = 1 << 20;

/// [`ProcessFootprint::largest_moment`]: the training step.
pub(crate) const TRAINING_STEP: &str = "training step";
/// [`ProcessFootprint::largest_moment`]: the evaluation on the validation split.
pub(crate) const EVALUATION: &str = "evaluation";
/// [`ProcessFootprint::largest_moment`]: the loading of the weights.
pub(crate) const LOADING: &str = "loading";

/// The binary, its libraries and the runtime's threads before any model or data: measured
/// 10.8 MiB peak RSS for `tunestudio --version` (`/usr/bin/time -v`, 11,036 KiB).
const RUNTIME_BYTES: u64 = 11 * MIB;

/// Resident bytes per byte of `tokenizer.json` once the tokenizer has been loaded (its parse
/// touches pages the allocator keeps; the tokenizer itself is dropped after tokenising), less
/// the freed large blocks the pool keeps, which the training step's tensors take over: for
/// SmolLM2's 3,522,871-byte tokenizer, `examples/rss_breakdown.rs` reads RSS 8.2 → 27.5 MiB
/// with 13.9 MiB of them free in the pool, so 5.4 MiB (the parse peaks 35 MiB higher, but
/// mimalloc's purge returns its pages before training starts; without purging it kept 25.7).
const TOKENIZER_RSS_PER_FILE_BYTE: f64 = 1.6;

/// Resident bytes per byte of dataset file (the parsed rows, their chat template rendering and
/// the tokenized samples): `tunestudio train --max-steps 1` of tiny-mistral on 50,000 Alpaca
/// rows (the 999-row demo file repeated, 42,145,050 bytes) peaks 256.8 MiB above the same run
/// on 8 of its rows (494,872–495,128 vs 238,072–238,540 KiB). Without mimalloc's purge,
/// `tunestudio preview` of the 999 rows measured 15 × (the parse's freed pages stayed).
const DATASET_RSS_PER_FILE_BYTE: f64 = 6.4;

/// What loading the model and the data and running the trainer leave resident besides the
/// heap and the terms above (the config and weight parsing, the random initialisation's and
/// the collation's freed pages, the trainer's threads, the binary's code a step runs).
/// Measured where the step's heap is known: the demo trained on every position, longest batch
/// first (its first step is the plan's worst case), peaks at 180.1 MiB for 2 steps
/// (`/usr/bin/time -v tunestudio train`, 184,164–184,728 KiB); its step's heap was 152.0 MiB
/// besides the samples (`examples/rss_breakdown.rs`: heap peak 153.1, 1.1 of it the
/// tokenized rows); less the runtime, tokenizer and dataset terms, 10.7 MiB. Without
/// mimalloc's purge it was 13.9 MiB on the demo, 6.4 for tiny-mistral on 999 Alpaca rows and
/// 62.6 for tiny-llama on 300 C4 documents (long rows hold more while tokenised).
const LOADING_RESIDUE_BYTES: u64 = 11 * MIB;

/// The studio's window, fonts and GL buffers when the GUI runs in the process, on top of a
/// run's terms. Measured as the studio's run of the bundled demo against the CLI's: under
/// Xvfb with Mesa's llvmpipe (software GL), the Run panel's sampler read a peak of
/// 272.7–273.5 MiB in three 60-step runs (`scripts/screenshot.sh run`, metrics.jsonl), and
/// `tunestudio train` of the same config peaks at 152.1–160.0 MiB (median 152.5 of twelve
/// runs): 120 MiB. The idle studio with the demo loaded holds 160.7 MiB, 143 MiB above the
/// runtime, tokenizer and dataset terms, but a run reuses part of it (the Preview scan's
/// freed pages). A desktop GL driver maps its own buffers, which this does not measure.
const GUI_BYTES: u64 = 120 * MIB;

/// The binary's large-block pool (`mem::LargeBlockPool`, on top of mimalloc) keeps freed
/// blocks mapped and reuses them best fit, so over a run the resident set climbs above the
/// heap's high-water mark only by the fragments a varying batch shape leaves among the step's
/// many activation blocks. The loss's logits chunk, the step's largest block, is one block
/// each step that the pool refits or grows in place (replaying the demo's large allocations,
/// it left nothing behind), so the share is of the transient heap besides one logits chunk.
/// Measured as the whole run's `VmHWM` (`/usr/bin/time -v tunestudio train`) − the step's
/// heap − the other terms, per byte of that heap (`scripts/rss-vs-plan.sh`, Alpaca rows of
/// varying length, fp32): SmolLM2-135M (seq 128, micro-batch 4, 15 steps, 618 MiB of such
/// heap) 0.26–0.28 over five rounds, the one run where this term is large. The small runs
/// vary around it: the demo −0.11 to 0.75 from run to run (its peak −1.5 to +3.6 % of the
/// plan), tiny-llama on C4 0.57–1.03, tiny-mistral −0.33 to 0.03 and LoRA r 16 on SmolLM2
/// 0.10–0.12 (the plan is over by 6 % on those two).
const RETENTION_PER_TRANSIENT_BYTE: f64 = 0.26;

/// Rows of one chunk of the loss's logits: the rows the loss computes (trained rows only), at
/// most a chunk.
fn logits_chunk_rows(d: &StepDims) -> u64 {
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    d.loss_rows
        .min(rows)
        .min(crate::model::LOSS_CHUNK_TOKENS as u64)
}

/// The step's logits-sized blocks, which the pool refits each step rather than fragmenting:
/// one chunk of the loss (and gemm's buffers for its products), or for a preference step
/// every full-logits tensor (the three its graph keeps, the backward's and the residue:
/// [`super::step_model::full_logits_bytes`]).
fn logits_blocks_bytes(d: &StepDims) -> u64 {
    if d.full_logits {
        let (kept, backward) = super::step_model::full_logits_tensors(d);
        return (kept + backward) * super::step_model::full_logits_bytes(d);
    }
    logits_chunk_rows(d) * d.vocab * 4 + super::step_model::f32_head_pack_bytes(d, true)
}

/// The evaluation's heap above what stays resident (weights, master copy, moments): the
/// forward without a graph (the final norm output and its shifted copy) and the loss,
/// chunk by chunk (`CausalLm::eval_loss`, the op training uses): on the CPU the fused op holds
/// one chunk's f32 logits (and, in half precision, f32 copies of the rows and, off the bf16
/// dot-product path, of the head); the
/// device-generic op holds three chunk-sized f32 tensors (logits, `logits − max`, `exp`) plus
/// the compute-dtype matmul output in half precision.
pub(crate) fn evaluation_transient_bytes(d: &StepDims) -> u64 {
    if d.full_logits {
        // Preference pairs (`train::preference` evaluates, and computes the reference before
        // the first step, without a graph): the norm's output and the full f32 logits with
        // `logits − max` and its `exp` at once (in half precision the head's product too).
        let half_product = if d.act_bytes == 4 {
            0
        } else {
            d.tokens * d.vocab * d.act_bytes
        };
        return d.tokens * d.hidden * d.act_bytes
            + half_product
            + 3 * super::step_model::full_logits_bytes(d);
    }
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    // Logits exist for the trained rows only (both ops); the chunk in elements.
    let chunk = logits_chunk_rows(d) * d.vocab;
    let half = d.act_bytes != 4;
    let loss = if d.generic_ops {
        chunk * (12 + if half { d.act_bytes } else { 0 })
    } else {
        // A bf16 head on the bf16 dot-product path is not cast.
        let head_cast = if d.bf16_products { 0 } else { d.vocab };
        chunk * 4
            + if half {
                (head_cast + rows) * d.hidden * 4
            } else {
                0
            }
    };
    2 * d.tokens * d.hidden * d.act_bytes + loss
}

/// The process footprint of a CPU run: `resident` is the step's bytes that stay between steps
/// (weights, master copy, moments), `step_peak` the step's predicted peak, of which
/// `untouched_workspace_bytes` are never resident.
pub(crate) fn footprint(
    inputs: &ProcessInputs,
    d: &StepDims,
    resident: u64,
    weights: u64,
    step_peak: u64,
    untouched_workspace_bytes: u64,
) -> ProcessFootprint {
    let evaluation_bytes = if inputs.evaluation {
        resident + evaluation_transient_bytes(d)
    } else {
        0
    };
    let loading_bytes = if inputs.mapped_weights_bytes > 0 {
        inputs.mapped_weights_bytes + weights
    } else {
        0
    };
    let (largest_moment, heap) = [
        (
            TRAINING_STEP,
            step_peak.saturating_sub(untouched_workspace_bytes),
        ),
        (EVALUATION, evaluation_bytes),
        (LOADING, loading_bytes),
    ]
    .into_iter()
    .fold(
        (TRAINING_STEP, 0),
        |best, cur| {
            if cur.1 > best.1 {
                cur
            } else {
                best
            }
        },
    );
    let mut terms = vec![
        ProcessTerm {
            name: "binary, libraries, threads",
            bytes: RUNTIME_BYTES,
            source: "measured: peak RSS of `tunestudio --version`",
        },
        ProcessTerm {
            name: "tokenizer (pages its load touched)",
            bytes: (inputs.tokenizer_file_bytes as f64 * TOKENIZER_RSS_PER_FILE_BYTE) as u64,
            source: "1.6 × tokenizer.json bytes (measured on SmolLM2's tokenizer)",
        },
        ProcessTerm {
            name: "dataset (parsed and tokenized)",
            bytes: (inputs.dataset_file_bytes as f64 * DATASET_RSS_PER_FILE_BYTE) as u64,
            source: "6.4 × dataset file bytes (measured: a run on 50,000 Alpaca rows against 8)",
        },
        ProcessTerm {
            name: "model and data loading residue",
            bytes: LOADING_RESIDUE_BYTES,
            source: "measured: the demo's 2-step run besides its heap and the terms above",
        },
        ProcessTerm {
            name: "allocator retention (large-block pool over mimalloc)",
            bytes: if inputs.single_step {
                0
            } else {
                let fragmenting = step_peak
                    .saturating_sub(resident)
                    .saturating_sub(logits_blocks_bytes(d));
                (fragmenting as f64 * RETENTION_PER_TRANSIENT_BYTE) as u64
            },
            source: "0.26 × the step's transient heap besides one logits chunk (measured on \
                     SmolLM2-135M full fine-tuning, whole runs)",
        },
    ];
    if inputs.gui {
        terms.push(ProcessTerm {
            name: "studio window (GUI)",
            bytes: GUI_BYTES,
            source: "measured: the studio's demo run under Xvfb (llvmpipe) − the CLI's",
        });
    }
    let mut f = ProcessFootprint {
        largest_moment,
        training_tensors_bytes: step_peak,
        evaluation_bytes,
        loading_bytes,
        untouched_workspace_bytes,
        terms,
        peak_bytes: 0,
    };
    f.peak_bytes = heap + f.baseline_bytes();
    f
}
