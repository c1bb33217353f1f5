//! Shared by tests/plan_accuracy.rs and examples/plan_accuracy.rs: runs real training
//! steps (SmolLM2-135M shape, random init) and records the heap with the counting
//! allocator (which the including binary installs), next to the planner's prediction.

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::time::Instant;
use tunestudio::mem;
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, LoraConfig, ModelConfig};
use tunestudio::plan::{
    self, DevicePlan, DeviceSpec, LoraSpec, PlanRequest, Precision, StepPhase, Strategy,
};

#[derive(Debug, Clone)]
pub struct Case {
    pub precision: Precision,
    pub checkpointing: bool,
    pub lora: bool,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub accumulation: usize,
    /// LoRA rank (on all seven linears) when `lora` is on.
    pub lora_r: usize,
    /// Leading positions of every row whose labels are -100 (a prompt the data does not
    /// train); 0 trains every position.
    pub prompt_tokens: usize,
}

#[derive(Debug, Default, Clone)]
pub struct Measured {
    /// Heap in use before the step (model + optimizer), above the pre-model baseline.
    pub before: u64,
    pub fwd_peak: u64,
    pub after_fwd: u64,
    pub bwd_peak: u64,
    pub after_bwd: u64,
    /// Heap when backward returned, before the loss (and its graph) is dropped.
    pub bwd_end: u64,
    pub acc_peak: u64,
    pub opt_peak: u64,
    pub peak: u64,
    pub secs: f64,
    /// Heap rise while the model was built (and its adapters added), measured when its group
    /// started: the weights.
    pub weights: u64,
    /// Heap rise of `AdamW::new` (moments, and master copies in mixed precision).
    pub optimizer: u64,
    /// Σ bytes of the tensors in `Gradients` when the last backward returned.
    pub gradients: u64,
    /// Heap after the decoder's forward (embeddings, layers, final norm) − heap when the
    /// last micro-batch's forward started: the decoder's activations.
    pub decoder_kept: u64,
    /// Heap after the loss − heap after the decoder's forward: what the head keeps.
    pub head_kept: u64,
    /// Resident set − counted heap after the step (`VmRSS`), when readable.
    pub rss_baseline: Option<u64>,
}

impl Measured {
    /// The phase of the measured peak.
    pub fn peak_phase(&self) -> StepPhase {
        let bwd = self.bwd_peak.max(self.acc_peak);
        if self.opt_peak >= bwd && self.opt_peak >= self.fwd_peak {
            StepPhase::OptimizerStep
        } else if bwd >= self.fwd_peak {
            StepPhase::Backward
        } else {
            StepPhase::Forward
        }
    }

    /// The measured side of the per-component report (definitions in `plan::components`).
    pub fn components(&self, c: &Case) -> plan::ComponentSet {
        plan::ComponentSet {
            step: plan::StepComponents {
                weights_bytes: self.weights,
                optimizer_bytes: self.optimizer,
                gradients_bytes: self.gradients,
                activations_bytes: self.decoder_kept,
                logits_and_loss_bytes: self.head_kept,
                accumulating: c.accumulation > 1,
            },
            peak_bytes: self.peak,
            peak_phase: self.peak_phase(),
            baseline_bytes: self.rss_baseline,
        }
    }
}

/// The per-component report of one measured case.
pub fn component_report(c: &Case, m: &Measured, d: &DevicePlan) -> plan::ComponentReport {
    plan::ComponentReport::new(&d.predicted_components(), &m.components(c))
}

pub fn model_config() -> ModelConfig {
    let path = tunestudio::paths::shared_dir()
        .join("model-configs")
        .join("smollm2-135m.json");
    ModelConfig::from_file(&path).expect("smollm2-135m.json")
}

fn lora_cfg(r: usize) -> LoraConfig {
    LoraConfig {
        r,
        alpha: 16.0,
        dropout: 0.0,
        target_modules: vec![
            "q_proj".into(),
            "k_proj".into(),
            "v_proj".into(),
            "o_proj".into(),
            "gate_proj".into(),
            "up_proj".into(),
            "down_proj".into(),
        ],
    }
}

pub fn request(cfg: &ModelConfig, c: &Case) -> PlanRequest {
    PlanRequest {
        model: cfg.clone(),
        precision: c.precision,
        micro_batch: c.micro_batch,
        gradient_accumulation: c.accumulation,
        seq_len: c.seq_len,
        activation_checkpointing: c.checkpointing,
        optimizer_offload: false,
        lora: c.lora.then(|| LoraSpec {
            r: c.lora_r,
            target_modules: lora_cfg(c.lora_r).target_modules,
            quantize: Default::default(),
        }),
        strategy: Strategy::Single,
        shard: Default::default(),
        devices: vec![DeviceSpec::cpu(1 << 40)],
        // The models below read TUNESTUDIO_OPS too, so the plan follows the same path.
        ops: tunestudio::model::OpsMode::from_env().expect("TUNESTUDIO_OPS"),
        process: None,
        // The data's trained tokens, as `train::plan_request` passes them: every row trains
        // the positions after its prompt.
        trained_tokens: (c.prompt_tokens > 0).then(|| {
            tunestudio::plan::TrainedTokens::from_counts(
                c.seq_len,
                c.seq_len,
                vec![c.seq_len - c.prompt_tokens; c.micro_batch * c.accumulation],
            )
        }),
        head_loss: Default::default(),
        reference: Default::default(),
        generations_per_micro_step: None,
        world: Default::default(),
    }
}

/// Runs one optimizer step (with `accumulation` micro-batches) exactly as the trainer
/// does: loss → backward → (accumulate) → AdamW step, and records the heap at each point.
pub fn measure(model: &mut CausalLm, c: &Case, zero: u64, seed: u64) -> Measured {
    model.set_activation_checkpointing(c.checkpointing);
    let vocab = model.config().vocab_size as u32;
    let master = matches!(c.precision, Precision::Bf16Mixed | Precision::Fp16Mixed);
    let pre_opt = mem::current_bytes();
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), master).expect("adamw");
    if model.ops_mode() == tunestudio::model::OpsMode::Generic {
        // As the trainer does: the GPU's optimizer code, state as tensors.
        opt.set_state_placement(tunestudio::model::StatePlacement::Device)
            .expect("state placement");
    }
    let optimizer = mem::current_bytes() - pre_opt;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // As the trainer does (`train/step.rs`): the padding mask is always passed (all ones here).
    let mask = Tensor::ones((c.micro_batch, c.seq_len), DType::U32, &Device::Cpu).unwrap();
    let batches: Vec<(Tensor, Tensor)> = (0..c.accumulation)
        .map(|_| {
            let ids: Vec<u32> = (0..c.micro_batch * c.seq_len)
                .map(|_| rng.gen_range(0..vocab))
                .collect();
            let ids = Tensor::from_vec(ids, (c.micro_batch, c.seq_len), &Device::Cpu).unwrap();
            let mut labels = ids.to_dtype(DType::I64).unwrap();
            if c.prompt_tokens > 0 {
                let masked =
                    Tensor::full(-100i64, (c.micro_batch, c.prompt_tokens), &Device::Cpu).unwrap();
                let trained = labels.narrow(1, c.prompt_tokens, c.seq_len - c.prompt_tokens);
                labels = Tensor::cat(&[&masked, &trained.unwrap()], 1).unwrap();
            }
            (ids, labels)
        })
        .collect();
    let mut m = Measured {
        before: mem::current_bytes() - zero,
        weights: pre_opt - zero,
        ..Default::default()
    };
    let start = Instant::now();
    mem::reset_peak();
    // As the trainer does: each micro-batch's gradients are summed into one buffer per
    // parameter during its backward (`backward_into`).
    let mut grads = tunestudio::model::Gradients::new();
    let mut tokens = 0usize;
    for (ids, labels) in &batches {
        let fwd_start = mem::current_bytes();
        let mut decoder_end = 0;
        // `CausalLm::loss` in its two parts, to read the heap between decoder and head.
        let loss = tunestudio::model::loss::loss_in_parts(model, ids, Some(&mask), labels, || {
            decoder_end = mem::current_bytes();
        })
        .expect("loss");
        m.decoder_kept = decoder_end - fwd_start;
        m.head_kept = mem::current_bytes() - decoder_end;
        m.fwd_peak = m.fwd_peak.max(mem::reset_peak() - zero);
        m.after_fwd = mem::current_bytes() - zero;
        tokens += loss.num_tokens;
        model
            .backward_into(&loss.sum, &mut grads)
            .expect("backward");
        m.bwd_end = mem::current_bytes() - zero;
        drop(loss);
        m.bwd_peak = m.bwd_peak.max(mem::reset_peak() - zero);
        m.after_bwd = mem::current_bytes() - zero;
    }
    m.gradients = grads
        .iter()
        .map(|(_, g)| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum();
    opt.step(&grads, 1e-4, 1.0 / tokens.max(1) as f64)
        .expect("step");
    m.opt_peak = mem::reset_peak() - zero;
    m.rss_baseline = mem::process_rss_bytes().map(|rss| rss.saturating_sub(mem::current_bytes()));
    m.optimizer = optimizer;
    drop(grads);
    drop(opt);
    m.peak = m.fwd_peak.max(m.bwd_peak).max(m.acc_peak).max(m.opt_peak);
    m.secs = start.elapsed().as_secs_f64();
    m
}

pub fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

pub fn run_grid(cases: &[Case]) -> Vec<(Case, Measured, DevicePlan)> {
    run_grid_with(&model_config(), cases)
}

/// [`run_grid`] on another model shape.
pub fn run_grid_with(cfg: &ModelConfig, cases: &[Case]) -> Vec<(Case, Measured, DevicePlan)> {
    assert!(mem::is_installed());
    warm_up_process();
    let cfg = cfg.clone();
    let mut out = Vec::new();
    // Group by dtype and LoRA rank so each model is built once (LoRA freezes the base for
    // good), in the order the cases first name them.
    let mut keys: Vec<(DType, Option<usize>)> = Vec::new();
    for c in cases {
        let key = (dtype_of(c.precision), c.lora.then_some(c.lora_r));
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    for (dtype, lora) in keys {
        {
            let group: Vec<&Case> = cases
                .iter()
                .filter(|c| dtype_of(c.precision) == dtype && c.lora.then_some(c.lora_r) == lora)
                .collect();
            let zero = mem::current_bytes();
            let mut model = CausalLm::random_init(&cfg, 7, dtype, &Device::Cpu).expect("init");
            if let Some(r) = lora {
                model.apply_lora(&lora_cfg(r), 3).expect("lora");
            }
            for (i, c) in group.into_iter().enumerate() {
                let m = measure(&mut model, c, zero, 11 + i as u64);
                let predicted = step_plan(
                    plan::plan(&request(&cfg, c))
                        .expect("plan")
                        .per_device
                        .remove(0),
                );
                print_row(c, &m, &predicted);
                out.push((c.clone(), m, predicted));
            }
        }
    }
    out
}

/// The plan of one step as this harness measures it: its zero is taken after
/// [`warm_up_process`], when gemm's per-thread workspace
/// (`plan::step_model::host_gemm_workspace_bytes`, part of a CPU plan's peak) already exists,
/// so the comparison leaves it out of the prediction too: out of the peak, the temporaries,
/// every phase and the training tensors' peak (which the per-component report totals; left in,
/// it put the report's peak +3.5 % over the measured one on a Sapphire Rapids, whose larger
/// caches give a 6.4 MiB workspace, while the step's own line read +0.9 %).
pub fn step_plan(mut d: DevicePlan) -> DevicePlan {
    let workspace = tunestudio::plan::step_model::host_gemm_workspace_bytes();
    d.peak_bytes -= workspace;
    d.training_tensors_bytes -= workspace;
    d.temporaries_bytes -= workspace;
    for p in &mut d.phases {
        p.bytes -= workspace;
    }
    d
}

/// The dtype the trainer builds the model in for a precision.
pub fn dtype_of(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16Mixed | Precision::Bf16 => DType::BF16,
        Precision::Fp16Mixed => DType::F16,
    }
}

/// The first training step of a process keeps 3.15 MB for good (rayon's pool and matmul
/// workspaces, measured: `before` of every later step is that much higher; the same 3.15 MB
/// whichever model comes first). That is process baseline, not a step's memory, so one
/// throwaway step runs before anything is measured.
pub fn warm_up_process() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let cfg = ModelConfig::from_file(
            &tunestudio::paths::shared_dir().join("fixtures/tiny-llama/config.json"),
        )
        .expect("tiny-llama config");
        let model = CausalLm::random_init(&cfg, 1, DType::F32, &Device::Cpu).expect("init");
        let ids = Tensor::from_vec((0..32u32).collect::<Vec<_>>(), (1, 32), &Device::Cpu).unwrap();
        let labels = ids.to_dtype(DType::I64).unwrap();
        let loss = model.loss(&ids, None, &labels).expect("loss");
        model.backward(&loss.sum).expect("backward");
    });
}

/// The predicted peak of one phase.
pub fn phase(d: &DevicePlan, p: StepPhase) -> u64 {
    d.phases
        .iter()
        .find(|x| x.phase == p)
        .map(|x| x.bytes)
        .unwrap_or(0)
}

/// The counting allocator is process-wide: tests that measure must not overlap.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the measuring lock (one measurement at a time in a test binary), once the heap has
/// settled: the previous test released the lock before its thread ended, and that thread's
/// thread-locals (gemm's scratch buffer, ≈ 1 MiB) are freed afterwards. Freed inside the next
/// test's measurement, they made its weights row read 1009 KiB low now and then.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    let guard = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let mut last = mem::current_bytes();
    let mut stable_reads = 0;
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        let now = mem::current_bytes();
        stable_reads = if now == last { stable_reads + 1 } else { 0 };
        last = now;
        if stable_reads == 5 {
            break;
        }
    }
    guard
}

/// Sets `TUNESTUDIO_OPS=generic` (models and plans follow it) until the returned guard drops,
/// however the test ends, so later tests run the default path. Take [`exclusive`] first.
pub fn generic_ops() -> impl Drop {
    struct Unset;
    impl Drop for Unset {
        fn drop(&mut self) {
            std::env::remove_var(tunestudio::model::OPS_ENV);
        }
    }
    std::env::set_var(tunestudio::model::OPS_ENV, "generic");
    Unset
}

/// Relative error of a prediction, in percent.
pub fn err_pct(predicted: u64, measured: u64) -> f64 {
    100.0 * (predicted as f64 - measured as f64) / measured.max(1) as f64
}

/// Prints one row of the accuracy table (MiB).
pub fn print_row(c: &Case, m: &Measured, d: &DevicePlan) {
    let bwd = m.bwd_peak.max(m.acc_peak);
    println!(
        "{:<10} {:<5} {:<5} {:>2} {:>4} {:>3} | fwd {:>7.1}/{:>7.1} bwd {:>7.1}/{:>7.1} opt {:>7.1}/{:>7.1} | peak {:>7.1} MiB measured, {:>7.1} predicted ({:<8}) {:+6.2} % | {:>5.1} s",
        c.precision.name(),
        c.checkpointing,
        c.lora,
        c.micro_batch,
        c.seq_len,
        c.accumulation,
        mib(m.fwd_peak),
        mib(phase(d, StepPhase::Forward)),
        mib(bwd),
        mib(phase(d, StepPhase::Backward)),
        mib(m.opt_peak),
        mib(phase(d, StepPhase::OptimizerStep)),
        mib(m.peak),
        mib(d.peak_bytes),
        d.peak_phase.to_string(),
        err_pct(d.peak_bytes, m.peak),
        m.secs
    );
}

/// The table's header.
pub fn print_header() {
    println!(
        "precision  ckpt  lora   b  seq acc | phase peaks, measured/predicted (MiB)                      | step peak"
    );
}

pub fn case(p: Precision, ckpt: bool, lora: bool, b: usize, t: usize) -> Case {
    Case {
        precision: p,
        checkpointing: ckpt,
        lora,
        micro_batch: b,
        seq_len: t,
        accumulation: 1,
        lora_r: 8,
        prompt_tokens: 0,
    }
}

/// The full grid: fp32 / bf16-mixed × checkpointing × LoRA × micro-batch 1/4 × seq 64/256,
/// plus one gradient-accumulation step.
pub fn grid() -> Vec<Case> {
    use Precision::{Bf16Mixed as B, Fp32 as F};
    let mut g = vec![
        case(F, false, false, 1, 64),
        case(F, false, false, 4, 64),
        case(F, false, false, 1, 256),
        case(F, true, false, 1, 256),
        case(F, true, false, 4, 64),
        case(F, false, true, 1, 256),
        case(F, true, true, 4, 64),
        case(B, false, false, 1, 64),
        case(B, true, false, 1, 256),
        case(B, false, false, 4, 64),
        case(B, false, true, 1, 256),
        case(B, true, true, 4, 64),
        Case {
            accumulation: 2,
            ..case(F, false, false, 1, 64)
        },
    ];
    if let Ok(filter) = std::env::var("PLAN_ACCURACY_FILTER") {
        g.retain(|c| format!("{c:?}").contains(&filter));
    }
    g
}
