//! The steps on the benchmark model: `throughput` (training tokens per second) and
//! `memory-grid` (the planner's peak against the measured one over precisions,
//! micro-batches, lengths and checkpointing).

use super::*;

/// A batch of random tokens (labels = inputs, nothing ignored).
fn random_batch(
    vocab: usize,
    rows: usize,
    seq: usize,
    device: &Device,
    seed: u64,
) -> Result<DeviceBatch, DevicesError> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..rows * seq)
        .map(|_| rng.gen_range(0..vocab as u32))
        .collect();
    let input_ids = Tensor::from_vec(ids, (rows, seq), device)?;
    let labels = input_ids.to_dtype(DType::I64)?;
    Ok(DeviceBatch {
        input_ids,
        attention_mask: None,
        labels,
    })
}

/// One training step as the trainer takes it: loss sum, backward, AdamW with
/// token normalisation. Returns the mean loss.
fn train_step(model: &CausalLm, opt: &mut AdamW, batch: &DeviceBatch) -> Result<f64, DevicesError> {
    let out = model.loss(
        &batch.input_ids,
        batch.attention_mask.as_ref(),
        &batch.labels,
    )?;
    let mean = out.mean()?;
    let tokens = out.num_tokens.max(1);
    let grads = model.backward(&out.sum)?;
    drop(out);
    opt.step(&grads, 1e-4, 1.0 / tokens as f64)?;
    Ok(mean)
}

/// The model shape the performance steps use: SmolLM2-135M on a GPU, the
/// tiny fixture's shape on the CPU (so `--cpu` stays quick).
fn bench_config(o: &CheckOptions) -> Result<(ModelConfig, String), DevicesError> {
    let path = match o.mode {
        CheckMode::Gpu => crate::paths::shared_dir()
            .join("model-configs")
            .join("smollm2-135m.json"),
        CheckMode::Cpu => o.fixture_dir.join("config.json"),
    };
    let config = ModelConfig::from_file(&path)?;
    Ok((config, path.display().to_string()))
}

fn synchronize(device: &Device) -> Result<(), DevicesError> {
    device.synchronize()?;
    Ok(())
}

pub(super) fn step_throughput(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    let device = main_device(o.mode)?;
    let (config, origin) = bench_config(o)?;
    // GPU: pure bf16 (as `model.to(torch.bfloat16)` + torch AdamW, the
    // PyTorch run gpu-check.sh compares with); CPU: f32.
    let (dtype, rows, seq, steps) = match o.mode {
        CheckMode::Gpu => (DType::BF16, 8, 512, 10),
        CheckMode::Cpu => (DType::F32, 2, 64, 3),
    };
    let model = CausalLm::random_init(&config, 0, dtype, &device)?;
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), false)?;
    let batch = random_batch(config.vocab_size, rows, seq, &device, 1)?;
    // Warm-up: kernels load, pools fill, moments are allocated.
    let first_loss = train_step(&model, &mut opt, &batch)?;
    synchronize(&device)?;
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = first_loss;
    for _ in 0..steps {
        let started = Instant::now();
        last_loss = train_step(&model, &mut opt, &batch)?;
        synchronize(&device)?;
        times.push(started.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let median = times[times.len() / 2];
    let tokens = (rows * seq) as f64;
    let tokens_per_sec = tokens / median;
    let params = config.num_parameters() as f64;
    let mut metrics = BTreeMap::new();
    metrics.insert("tokens_per_sec".to_string(), tokens_per_sec);
    metrics.insert("median_step_secs".to_string(), median);
    metrics.insert("tokens_per_step".to_string(), tokens);
    metrics.insert("parameters".to_string(), params);
    let detail = format!(
        "{origin} ({:.1} M parameters) {dtype:?}, batch {rows} × seq {seq}: median step {median:.4} s,          {tokens_per_sec:.0} tokens/s, {:.1} TFLOP/s (6·N·T); loss {first_loss:.3} → {last_loss:.3}",
        params / 1e6,
        6.0 * params * tokens_per_sec / 1e12
    );
    // Repeating one batch must lower its loss; anything else means the step is broken.
    Ok(if last_loss < first_loss && tokens_per_sec.is_finite() {
        Outcome::PassWith(detail, metrics)
    } else {
        Outcome::FailWith(detail, metrics)
    })
}

/// One configuration of the memory grid.
struct GridPoint {
    precision: crate::plan::Precision,
    micro_batch: usize,
    seq_len: usize,
    checkpointing: bool,
}

/// The run of one memory-grid point: the step alone, on one device.
fn grid_point_run(config: &ModelConfig, g: &GridPoint, spec: &crate::plan::DeviceSpec) -> CheckRun {
    CheckRun {
        model: config.clone(),
        precision: g.precision,
        micro_batch: g.micro_batch,
        seq_len: g.seq_len,
        activation_checkpointing: g.checkpointing,
        strategy: Strategy::Single,
        devices: vec![spec.clone()],
    }
}

pub(super) fn step_memory_grid(o: &CheckOptions) -> Result<Outcome, DevicesError> {
    use crate::plan::{self, DeviceSpec};
    let device = main_device(o.mode)?;
    let (config, origin) = bench_config(o)?;
    let inv = super::super::discover();
    let grid = memory_grid(o.mode);
    let spec = match o.mode {
        CheckMode::Gpu => DeviceSpec::cuda(
            0,
            inv.gpu_by_cuda_ordinal(0)
                .map(|g| g.total_bytes)
                .unwrap_or(80 << 30),
        ),
        CheckMode::Cpu => DeviceSpec::cpu(inv.cpu().map(|c| c.total_bytes).unwrap_or(8 << 30)),
    };
    let mut lines = Vec::new();
    let mut metrics = BTreeMap::new();
    let mut worst_error = 0.0f64;
    let mut zero_reading = false;
    let mut measured_any = false;
    // How the CPU peak was measured (the GPU's is the CUDA pool's, exact).
    let mut cpu_method = String::new();
    for (i, g) in grid.iter().enumerate() {
        let req = (o.planner)(&grid_point_run(&config, g, &spec));
        let the_plan =
            plan::plan(&req).map_err(|e| DevicesError::Input(format!("planner: {e}")))?;
        let Some(dp) = the_plan.per_device.first() else {
            continue;
        };
        let predicted = dp.peak_bytes.saturating_sub(dp.overhead_bytes);
        let measured = match measure_point(o.mode, &config, &device, g, &the_plan, &mut cpu_method)?
        {
            Ok(m) => m,
            Err(summary) => return Ok(Outcome::Fail(format!("dry run failed: {summary}"))),
        };
        let label = format!(
            "{} mb{}×{}{}",
            g.precision,
            g.micro_batch,
            g.seq_len,
            if g.checkpointing { " ckpt" } else { "" }
        );
        match measured {
            Some(m) => {
                measured_any = true;
                // A reading of 0 (an allocator pool that was never asked) is a broken
                // measurement, not a perfect prediction.
                zero_reading |= m == 0;
                let err = (m as f64 - predicted as f64) / (m.max(1) as f64);
                if err.abs() > worst_error.abs() {
                    worst_error = err;
                }
                metrics.insert(format!("grid{i}_predicted_bytes"), predicted as f64);
                metrics.insert(format!("grid{i}_measured_bytes"), m as f64);
                lines.push(format!(
                    "{label}: predicted {} measured {} ({:+.1} %)",
                    crate::units::format_bytes(predicted),
                    crate::units::format_bytes(m),
                    -100.0 * err
                ));
            }
            None => lines.push(format!(
                "{label}: predicted {} (not measurable here)",
                crate::units::format_bytes(predicted)
            )),
        }
    }
    metrics.insert("worst_relative_error".to_string(), worst_error);
    let exact = o.mode == CheckMode::Gpu
        || cpu_method == crate::plan::MeasureMethod::CountingAllocator.to_string();
    let detail = format!(
        "{origin}: {}{}",
        lines.join("; "),
        if exact {
            String::new()
        } else {
            format!(" [measured by {cpu_method}: includes the process's own baseline; informational, not a pass]")
        }
    );
    // An exact measurement (the CUDA pool, the counting allocator) judges the planner:
    // more than 5 % off in either direction fails (under-prediction makes a run that
    // "fits" run out of memory; over-prediction makes auto-fit give away speed). A
    // process-RSS measurement also holds the executable, the allocator's cache and
    // page rounding, so it is reported as figures only.
    Ok(if !measured_any {
        Outcome::Skip(format!("nothing measurable: {detail}"))
    } else if !exact {
        Outcome::InformWith(detail, metrics)
    } else if zero_reading {
        Outcome::FailWith(format!("a measured peak of 0 bytes: {detail}"), metrics)
    } else if worst_error.abs() <= MEMORY_GRID_TOLERANCE {
        Outcome::PassWith(detail, metrics)
    } else {
        Outcome::FailWith(detail, metrics)
    })
}

/// The memory grid of a mode: precisions, batch shapes and checkpointing that a GPU holds
/// easily, and two small points on the CPU.
fn memory_grid(mode: CheckMode) -> Vec<GridPoint> {
    use crate::plan::Precision;
    match mode {
        CheckMode::Gpu => vec![
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 1,
                seq_len: 256,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: true,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 4,
                seq_len: 512,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 8,
                seq_len: 1024,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Bf16Mixed,
                micro_batch: 8,
                seq_len: 1024,
                checkpointing: true,
            },
        ],
        CheckMode::Cpu => vec![
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 1,
                seq_len: 64,
                checkpointing: false,
            },
            GridPoint {
                precision: Precision::Fp32,
                micro_batch: 2,
                seq_len: 128,
                checkpointing: true,
            },
        ],
    }
}

/// The measured peak of one grid point's training step, in bytes beyond what was in use
/// before (`None`: not measurable here); on the CPU `cpu_method` says how it was measured.
/// `Ok(Err(summary))` when the CPU dry run failed.
fn measure_point(
    mode: CheckMode,
    config: &ModelConfig,
    device: &Device,
    g: &GridPoint,
    the_plan: &crate::plan::Plan,
    cpu_method: &mut String,
) -> Result<Result<Option<u64>, String>, DevicesError> {
    use crate::plan::Precision;
    let (dtype, master) = match g.precision {
        Precision::Fp32 => (DType::F32, false),
        Precision::Bf16 => (DType::BF16, false),
        Precision::Bf16Mixed => (DType::BF16, true),
        Precision::Fp16Mixed => (DType::F16, true),
    };
    let build = || -> Result<(CausalLm, AdamW, DeviceBatch), DevicesError> {
        let mut model = CausalLm::random_init(config, 0, dtype, device)?;
        model.set_activation_checkpointing(g.checkpointing);
        let opt = AdamW::new(model.params(), AdamWConfig::default(), master)?;
        let batch = random_batch(config.vocab_size, g.micro_batch, g.seq_len, device, 2)?;
        Ok((model, opt, batch))
    };
    let measured = match mode {
        CheckMode::Gpu => {
            synchronize(device)?;
            let before = super::super::cuda_pool::used_bytes(0)?;
            super::super::cuda_pool::reset_peak(0)?;
            let (model, mut opt, batch) = build()?;
            train_step(&model, &mut opt, &batch)?;
            synchronize(device)?;
            let peak = super::super::cuda_pool::peak_used_bytes(0)?;
            drop((model, opt, batch));
            synchronize(device)?;
            Some(peak.saturating_sub(before))
        }
        CheckMode::Cpu => {
            // The planner's dry run measures the step (allocator or RSS);
            // weights and moments exist before it, as in a real run.
            let (model, mut opt, batch) = build()?;
            let report = super::super::dry_run(the_plan, 0, || {
                train_step(&model, &mut opt, &batch).map(|_| ())
            });
            if !report.ok() {
                return Ok(Err(report.summary));
            }
            *cpu_method = report.method.to_string();
            report.measured_peak_bytes
        }
    };
    Ok(Ok(measured))
}
