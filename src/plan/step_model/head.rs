//! The head and the loss: the fused linear cross-entropy, the generic path, and a preference
//! step's full logits.

use super::*;

/// Logits-sized f32 tensors a preference step's backward adds above the three its graph keeps
/// (see [`full_logits_head_terms`]).
pub(crate) const FULL_LOGITS_BACKWARD_TENSORS: u64 = 7;

/// The bytes of one micro-batch's f32 logits, every position of every row for preference
/// pairs, every completion position for GRPO (the unit of the full-logits head's terms).
pub fn full_logits_bytes(d: &StepDims) -> u64 {
    d.logit_positions * d.vocab * 4
}

/// The head of a preference step (DPO, IPO, ORPO: `model::preference::model_sequence_logps`
/// on the 2 × micro-batch rows of chosen and rejected answers), the same on the native and
/// the generic path: the final norm's output `[n, h]` goes through the head as it is (a view,
/// no shifted copy), and the logits of **every** position exist at once in f32 — nothing is
/// chunked, and ignored rows are not skipped.
///
/// * Kept until the loss is dropped (candle's graph): the logits (in half precision the
///   head's product in the compute dtype too, and its f32 cast is the logits), `logits − max`
///   and its `exp` (the log-sum-exp's operands), and per position the few `[rows, t]` values
///   of the log-softmax at the target (max, sum, its log, the log-sum-exp, the gathered
///   logit, their difference, the masked product, targets and mask); per pair the stored
///   reference's two log-probabilities as tensors. (The reference for the whole run is 8
///   bytes a pair in a `Vec`: inside the dataset's process term.)
/// * Backward: [`FULL_LOGITS_BACKWARD_TENSORS`] more logits-sized f32 tensors at its peak,
///   candle's zero-then-add on every logits-sized gradient edge (the gather's scatter into a
///   zero tensor, the sum's broadcast gradient, `exp`'s product, both operands of the
///   subtraction, the reshape before the head product). The subtraction's right operand is
///   the detached max broadcast to the logits' shape: its full-size gradient is no graph
///   node, so it stays in candle's store until backward returns (the residue). Measured with the counting allocator
///   (demo model, LoRA r 8, fp32, 2 × 384 and 1 × 256 pairs × tokens): the step's heap
///   peaked 10.11 and 10.09 logits above the weights on the native path, 10.40 and 10.31
///   with `TUNESTUDIO_OPS=generic`, of which 3.11 / 3.09 (3.40 / 3.31) were kept after the
///   forward — the decoder's activations the rest.
/// * A trained head (full fine-tuning): its weight gradient arrives when the logits'
///   gradient is the only logits-sized one left besides the kept three and the max's, as five
///   weight-sized buffers (the module docs).
///
/// GRPO's head (`model::grpo::model_completion_logps`, [`StepDims::sampled_logits`]) runs on
/// the completion positions only ([`StepDims::logit_positions`]): their hidden rows are cut
/// out first (a copy kept by the graph), and the logits divided by the temperature are one
/// more logits-sized tensor kept, with one more gradient in the backward.
pub(super) fn full_logits_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let positions = d.logit_positions;
    let logits = full_logits_bytes(d);
    let half_product = if a == 4 { 0 } else { positions * v * a };
    let pairs = d.micro_batch.div_ceil(2);
    let (kept_logits, backward_logits) = full_logits_tensors(d);
    let cut_rows = if d.sampled_logits {
        positions * h * a
    } else {
        0
    };
    let kept = n * h * a
        + cut_rows
        + half_product
        + kept_logits * logits
        + positions * 9 * 4
        + pairs * 2 * 4;
    let full = d.lora.is_none();
    let weight = if full { v * h * g } else { 0 };
    let backward = (backward_logits * logits).max(2 * logits + 5 * weight);
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: 0,
        backward_transient_bytes: backward,
        backward_grad_bytes: if full { (v * h + h) * g } else { 0 },
        residue_bytes: logits,
        freed_kept_bytes: 0,
    }
}

/// GRPO's head (`model::grpo::model_completion_logps`): the completion positions' hidden rows
/// `[P, h]` (P = [`StepDims::logit_positions`]) are cut out of the final norm's output (a copy
/// the graph keeps) and divided by the temperature (another; none at 1, counted anyway: a
/// few MB), then go through the SFT head's loss op, each row's loss on its own (fused on the
/// CPU, generic elsewhere), which also gives each row's entropy: the SFT head's terms with the
/// P rows as its rows, all of them trained (the plan takes full-length completions). The
/// reference's and the old policy's passes run the same op without a graph, before it.
///
/// Before the chunked head (2026-12-05) the whole batch's f32 logits existed at once, about
/// eleven logits-sized tensors: the G 16 × 512-token demo step planned 18.1 GiB.
pub(super) fn completions_head_terms(d: &StepDims) -> BlockTerms {
    let positions = d.logit_positions;
    // The op sees the P cut rows as one row of P + 1 positions (so no `hidden[:, :-1]` copy:
    // the cut is its own copy, counted below).
    let rows = StepDims {
        micro_batch: 1,
        seq_len: positions + 1,
        loss_rows: positions,
        full_logits: false,
        ..d.clone()
    };
    let mut terms = if d.generic_ops {
        generic_head_terms(&rows)
    } else {
        fused_head_terms(&rows)
    };
    // The cut and scaled rows; per position the log-probability, entropy, mask and label.
    terms.kept_bytes += 2 * positions * d.hidden * d.act_bytes + positions * 4 * 4;
    terms
}

/// Logits-sized f32 tensors of a full-logits head: (kept by the graph after the forward, added
/// at the backward's peak). GRPO's temperature scaling adds one of each.
pub(crate) fn full_logits_tensors(d: &StepDims) -> (u64, u64) {
    let scaled = u64::from(d.sampled_logits);
    (3 + scaled, FULL_LOGITS_BACKWARD_TENSORS + scaled)
}

/// gemm's buffers for the fused head's `f32` products of one loss chunk: the logits, and with
/// `backward` the hidden gradient and the weight gradient when the head is trained. The pool
/// cuts them from the same free block every step (like the logits chunk), so they add to the
/// step's peak, not to the allocator's retention.
pub(crate) fn f32_head_pack_bytes(d: &StepDims, backward: bool) -> u64 {
    if d.bf16_products || d.generic_ops || d.full_logits {
        return 0;
    }
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    let chunk = d.loss_rows.min(rows).min(LOSS_CHUNK_ROWS);
    let trained = d.lora.is_none();
    super::native_layer::f32_linear_pack_bytes(chunk, d.hidden, d.vocab, trained, backward)
}

/// The head on the fused CPU path (`ops::linear_cross_entropy`).
pub(super) fn fused_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let full = d.lora.is_none();
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    // Logits exist for the trained rows only, chunk by chunk.
    let active = d.loss_rows.min(rows);
    let chunk = active.min(LOSS_CHUNK_ROWS);
    let mut kept = n * h * a; // final norm output
    if d.micro_batch > 1 {
        // hidden[:, :-1] is not contiguous for b > 1: the reshape copies it.
        kept += rows * h * a;
    }
    if a != 4 {
        // The fused loss works in f32: casts of the hidden rows and of lm_head (a bf16 head
        // on the bf16 dot-product path is multiplied as it is).
        kept += rows * h * 4 + if d.bf16_products { 0 } else { v * h * 4 };
    }
    // The packing buffers of the bf16 path, or of gemm's f32 products, while a chunk's
    // logits (forward) or its gradients (backward) are computed.
    let (packing, packing_fwd) = if d.bf16_products {
        let all = bf16_pack_bytes([(chunk, h, v), (chunk, v, h), (v, chunk, h)]);
        (all, all)
    } else {
        (f32_head_pack_bytes(d, true), f32_head_pack_bytes(d, false))
    };
    // Loss op state: labels (i64) and active rows (usize) copies, per-row
    // log-sum-exp and loss (f32), and the last chunk's probabilities (each
    // chunk's logits are a buffer of exactly its rows). Another micro-batch of
    // fewer trained rows may leave a larger last chunk, so past one chunk the
    // plan keeps a whole one.
    let last_rows = if active == 0 {
        0
    } else if active > LOSS_CHUNK_ROWS && d.loss_rows < rows {
        chunk
    } else {
        active - (active.div_ceil(chunk) - 1) * chunk
    };
    let last_chunk = last_rows * v * 4;
    kept += rows * (8 + 8 + 4 + 4) + last_chunk;
    // Backward of the fused loss: while it runs, its f32 weight and hidden
    // gradients next to the cached last chunk (kept); once it returns the chunk
    // is gone and candle adds each gradient it receives into a zero tensor. With
    // native layers the weight gradient goes to the side table instead (one
    // weight-sized buffer, not three).
    // A frozen head (LoRA) gets no weight gradient at all.
    let head_w = if full { v * h * 4 } else { 0 };
    let in_op = head_w + rows * h * 4 + rows * 8 + chunk * h * 4 + packing;
    let weight_bufs = if d.native_embedding { 1 } else { 3 };
    // In half precision the side table gets the gradient rounded inside the op, while
    // its f32 original is still alive.
    let rounded = if d.native_embedding && g != 4 && full {
        v * h * g
    } else {
        0
    };
    let f32_head =
        in_op.max((weight_bufs * head_w + rounded + 2 * rows * h * 4).saturating_sub(last_chunk));
    // Earlier chunks are recomputed in full-size buffers once the cached last one is
    // consumed.
    let multi_chunk_extra = (chunk - last_rows) * v * 4;
    // Half precision: the f32 gradients flow back through the casts
    // (f32 sum + half cast + zero + sum), after the chunk is freed.
    let cast_back = if a != 4 && full && !d.native_embedding {
        (v * h * (4 + 3 * g)).saturating_sub(last_chunk)
    } else {
        0
    };
    // The norm's and lm_head's gradients appear here; with tied embeddings the
    // shared matrix's gradient first appears here too.
    let head_grads = if full { (v * h + h) * g } else { 0 };
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: packing_fwd,
        backward_transient_bytes: f32_head.max(cast_back) + multi_chunk_extra,
        backward_grad_bytes: head_grads,
        residue_bytes: 0,
        freed_kept_bytes: last_chunk,
    }
}

/// The head on the generic path (`ops::generic::linear_cross_entropy`): between forward and
/// backward the loss keeps one log-sum-exp (and label) per row; each chunk's `[rows × vocab]`
/// f32 logits exist only inside the op.
pub(super) fn generic_head_terms(d: &StepDims) -> BlockTerms {
    let n = d.tokens;
    let (a, g, h, v) = (d.act_bytes, d.grad_bytes, d.hidden, d.vocab);
    let rows = d.micro_batch * d.seq_len.saturating_sub(1);
    // Only the rows that carry a label go through the head (`loss::causal_lm_loss` selects
    // them first when some are ignored).
    let active = d.loss_rows.min(rows);
    let selected = active < rows;
    let chunk = active.min(LOSS_CHUNK_ROWS);
    let full = d.lora.is_none();
    // Final norm output; log-sum-exp and target per active row.
    let mut kept = n * h * a + active * (4 + 4);
    if d.micro_batch > 1 {
        // hidden[:, :-1] is not contiguous for b > 1: the reshape copies it.
        kept += rows * h * a;
    }
    if selected {
        // The selected rows (a copy, the op's input) and their indices.
        kept += active * (h * a + 4);
    }
    // Forward of a chunk: the logits, logits − max and their exp live until the
    // log-sum-exp statement ends (f32; in half precision the matmul output is cast first).
    let logits_f32 = chunk * v * 4;
    let forward = (3 * logits_f32).max(chunk * v * (a + 4));
    // Backward of a chunk: the same three while the probabilities are formed, then at most
    // two (probabilities and their gradient). The rows' gradient is assembled from its
    // chunks (a cat), and candle adds it into a zero tensor.
    let rows_grad = active * h * a;
    // In half precision the chunk's matmul output lives until its f32 cast's statement ends.
    let half_logits = if a == 4 { 0 } else { chunk * v * a };
    let chunk_peak = 3 * logits_f32 + half_logits + rows_grad;
    let mut rows_end = 3 * rows_grad;
    if selected {
        // The selection's backward adds the rows' gradient into a zero tensor of every row
        // (`index_add`: the zeros and the sum, next to the selected rows' gradient).
        rows_end = rows_end.max(rows_grad + 2 * rows * h * a);
    }
    // A trained head: its gradient per chunk (summed over chunks), then candle's zero-then-add
    // into the store, three weight-sized buffers at once.
    let weight = if full { 3 * v * h * g } else { 0 };
    let head_grads = if full { (v * h + h) * g } else { 0 };
    BlockTerms {
        kept_bytes: kept,
        forward_transient_bytes: forward,
        backward_transient_bytes: chunk_peak.max(rows_end).max(weight + rows_grad),
        backward_grad_bytes: head_grads,
        residue_bytes: 0,
        freed_kept_bytes: 0,
    }
}
