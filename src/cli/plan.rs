//! `tunestudio plan`: predict every device's memory for a run, say where it runs
//! out and by how much, rank the fixes, and (`--auto-fit`) fit it to the devices.
//! `--config run.toml --dry-run` then trains one step of that run as the trainer would and
//! compares its measured peak with the prediction, component by component.
//!
//! Exit status: 0 when the (fitted) plan fits, 2 when it does not (or the dry run is out of
//! memory, predicted or measured), 1 on errors (a dry run whose step fails included).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use tunestudio::plan::{
    self, format_bytes, AutoFit, DevicePlan, DryRunOutcome, DryRunReport, PeakMoment, Plan,
    PlanRequest,
};
use tunestudio::train;

mod request;

use request::request_and_config;

/// Arguments of `tunestudio plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A run config (`run.toml`): model, [training], [lora] and [devices] are read from it;
    /// the flags below override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The model's `config.json` (or a model folder, or a hub id in the local cache).
    #[arg(long, alias = "model")]
    pub model_config: Option<String>,
    /// Devices: `2x80GiB`, `80GB,40GB`, `cpu:24GiB`, `cuda:0=80GiB`, `cpu` (host memory),
    /// or GPU models as their driver reports them: `2xh100`, `a100-40gb`, `rtx4090`.
    #[arg(long)]
    pub devices: Option<String>,
    /// fp32, bf16-mixed, bf16 or fp16-mixed.
    #[arg(long)]
    pub precision: Option<String>,
    /// Samples per micro-batch, in the run's unit: rows (SFT), pairs (DPO, ORPO: two rows
    /// each) or prompts (GRPO: `num_generations` rows each); per device under data parallel.
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, alias = "gradient-accumulation")]
    pub accumulation: Option<usize>,
    /// Tokens per row (plan for the longest batch).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Recompute each layer in backward instead of keeping its activations.
    #[arg(long)]
    pub checkpointing: bool,
    /// Train LoRA adapters of this rank on a frozen base.
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// Comma-separated LoRA target modules (default: every linear layer).
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// QLoRA: the frozen base linears quantized as none, q8_0 or q4_k (needs LoRA: --lora-r,
    /// or `[lora] enabled` in --config).
    #[arg(long)]
    pub quantize: Option<String>,
    /// single, layer-split, data-parallel or sharded.
    #[arg(long)]
    pub strategy: Option<String>,
    /// What sharded data parallel divides over the ranks: gradients-and-optimizer (ZeRO-2, the
    /// default) or everything (ZeRO-3: the layers' weights too, each gathered as it runs and
    /// recomputed in the backward; not for GRPO or QLoRA).
    /// Implies --strategy sharded.
    #[arg(long)]
    pub shard: Option<String>,
    /// Keep AdamW's state (and fp32 master weights) in host RAM instead of on the GPUs.
    #[arg(long)]
    pub optimizer_offload: bool,
    /// Any run-config key, as the run config writes it (repeatable): `--set
    /// grpo.num_generations=8`, `--set training.optimizer_offload=host`. Applied to the run
    /// config (or its defaults) before the flags above; a key the run config does not have is
    /// an error. Settings without a flag of their own are planned this way.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The ops path the run will take: auto, native or generic (the GPU's code, forced on the
    /// CPU). Default: `TUNESTUDIO_OPS`, else auto.
    #[arg(long)]
    pub ops: Option<String>,
    /// Search for settings that fit every device with ≥ 5 % headroom (same effective batch).
    #[arg(long)]
    pub auto_fit: bool,
    /// Also print the memory of every block (embeddings, each layer, head).
    #[arg(long)]
    pub per_layer: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// With --config: then train one step of the run as the trainer would (no checkpoint, no
    /// evaluation) and compare its measured peak with the prediction, component by component.
    #[arg(long)]
    pub dry_run: bool,
}

/// Runs `tunestudio plan`.
pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        check_dry_run_args(&args)?;
    }
    let (req, config) = request_and_config(&args)?;
    let started = Instant::now();
    let the_plan = plan::plan(&req)?;
    let plan_secs = started.elapsed().as_secs_f64();
    let fitted = if args.auto_fit {
        Some(plan::auto_fit(&req)?)
    } else {
        None
    };
    let final_fits = match &fitted {
        Some(f) => f.found,
        None => the_plan.fits(),
    };
    let dry_config = config.filter(|_| args.dry_run);
    let dry_run = if args.json {
        let dry_run = dry_config.map(|c| run_dry_run(c, &req)).transpose()?;
        print_json(
            &req,
            &the_plan,
            plan_secs,
            fitted.as_ref(),
            dry_run.as_ref(),
        )?;
        dry_run
    } else {
        print_text(&args, &req, &the_plan, plan_secs, fitted.as_ref());
        let dry_run = dry_config.map(|c| run_dry_run(c, &req)).transpose()?;
        if let Some(d) = &dry_run {
            print_dry_run(d);
        }
        dry_run
    };
    Ok(exit_code(final_fits, dry_run.as_ref().map(|d| &d.report)))
}

/// The exit status: 1 when the dry run's step failed, 2 when the plan does not fit or the
/// dry run is out of memory (predicted, or measured), else 0.
fn exit_code(fits: bool, dry_run: Option<&DryRunReport>) -> ExitCode {
    match dry_run.map(|d| &d.outcome) {
        Some(DryRunOutcome::Failed { .. }) => ExitCode::FAILURE,
        Some(DryRunOutcome::OutOfMemory { .. } | DryRunOutcome::PredictedOutOfMemory) => {
            ExitCode::from(2)
        }
        _ if !fits => ExitCode::from(2),
        _ => ExitCode::SUCCESS,
    }
}

/// The flags that change what is planned, not what the run config trains.
fn plan_only_flags(args: &PlanArgs) -> Vec<&'static str> {
    [
        ("--model-config", args.model_config.is_some()),
        ("--devices", args.devices.is_some()),
        ("--precision", args.precision.is_some()),
        ("--micro-batch", args.micro_batch.is_some()),
        ("--accumulation", args.accumulation.is_some()),
        ("--seq-len", args.seq_len.is_some()),
        ("--checkpointing", args.checkpointing),
        ("--lora-r", args.lora_r.is_some()),
        ("--lora-targets", args.lora_targets.is_some()),
        ("--quantize", args.quantize.is_some()),
        ("--strategy", args.strategy.is_some()),
        ("--shard", args.shard.is_some()),
        ("--optimizer-offload", args.optimizer_offload),
        ("--ops", args.ops.is_some()),
        ("--auto-fit", args.auto_fit),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect()
}

/// `--dry-run` trains the run config as it is: it needs `--config`, and refuses the flags
/// that would plan something other than what the step runs.
fn check_dry_run_args(args: &PlanArgs) -> anyhow::Result<()> {
    let Some(config) = &args.config else {
        anyhow::bail!(
            "--dry-run needs --config run.toml: it trains one step of that run as the trainer \
             would (a model alone is not a run)"
        );
    };
    let others = plan_only_flags(args);
    if !others.is_empty() {
        anyhow::bail!(
            "--dry-run trains {} as it is, but {} would change only the plan: set {} in the run \
             config, or plan without --dry-run",
            config.display(),
            others.join(", "),
            if others.len() == 1 { "it" } else { "them" }
        );
    }
    Ok(())
}

/// A dry run with the plan it was compared with.
struct DryRun {
    /// The plan of the dry run's request ([`PlanRequest::for_dry_run`]).
    plan: Plan,
    /// Whether that plan leaves out an evaluation the run makes.
    without_evaluation: bool,
    /// The outcome.
    report: DryRunReport,
}

/// Plans the dry run (the run without evaluation: the dry run does not evaluate) and runs it.
fn run_dry_run(config: train::RunConfig, req: &PlanRequest) -> anyhow::Result<DryRun> {
    let (report, dry_plan) = train::dry_run(config, req)?;
    Ok(DryRun {
        without_evaluation: req.for_dry_run() != *req,
        plan: dry_plan,
        report,
    })
}

/// The dry run in text: what it compared, the summary line and the component table.
fn print_dry_run(d: &DryRun) {
    println!();
    println!(
        "Dry run: one training step of the run on {}, as the trainer takes it.",
        d.report.device_name
    );
    println!("  (compared with the plan of: {})", d.plan.settings);
    if d.without_evaluation {
        if let Some(dev) = d.plan.per_device.first() {
            println!(
                "  (it does not evaluate: compared with the plan of the same run without the \
                 evaluation, peak {} at the {})",
                format_bytes(dev.peak_bytes),
                dev.peak_moment()
            );
        }
    }
    println!("{}", d.report.summary);
    if let Some(c) = &d.report.components {
        println!();
        print!("{}", c.render());
    }
}

/// The plan (and the auto-fit) as tables.
fn print_text(
    args: &PlanArgs,
    req: &PlanRequest,
    the_plan: &Plan,
    plan_secs: f64,
    fitted: Option<&AutoFit>,
) {
    println!("Model:    {}", model_summary(req));
    println!("Settings: {}", req.settings_summary());
    println!(
        "Effective batch: {} rows/step{}; {} trainable parameters",
        req.effective_batch(),
        req.head_loss.rows_in_samples(req.effective_batch()),
        human_count(the_plan.trainable_parameters)
    );
    if req.trained_tokens.is_some() {
        println!(
            "Loss rows: {} per micro-batch, the most tokens any {} rows of the data train \
             (of {} positions)",
            req.loss_rows(),
            req.micro_batch,
            req.micro_batch * req.planned_seq_len().saturating_sub(1)
        );
    }
    println!();
    print_plan(req, the_plan, args.per_layer);
    if !the_plan.fixes.is_empty() {
        println!();
        println!("Fixes (best first):");
        for (i, f) in the_plan.fixes.iter().enumerate() {
            println!("  {}. {}", i + 1, f.description);
        }
    }
    if let Some(f) = fitted {
        println!();
        print_auto_fit(f);
    }
    println!();
    println!("(planned in {:.2} ms)", plan_secs * 1e3);
}

/// The plan (the auto-fit, the dry run) as one JSON object.
fn print_json(
    req: &PlanRequest,
    the_plan: &Plan,
    plan_secs: f64,
    fitted: Option<&AutoFit>,
    dry_run: Option<&DryRun>,
) -> anyhow::Result<()> {
    let value = serde_json::json!({
        "model": model_summary(req),
        "request": request_json(req),
        "plan": the_plan,
        "plan_ms": plan_secs * 1e3,
        "auto_fit": fitted.map(|f| serde_json::json!({
            "found": f.found,
            "changes": f.changes,
            "relative_throughput": f.relative_throughput,
            "request": request_json(&f.request),
            "plan": f.plan,
        })),
        "dry_run": dry_run.map(|d| serde_json::json!({
            "without_evaluation": d.without_evaluation,
            "plan": d.plan,
            "report": d.report,
        })),
    });
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// The request `tunestudio plan` plans for these arguments (the studio's tests compare
/// their plans with it).
#[cfg(all(test, feature = "gui"))]
pub(crate) fn build_request(args: &PlanArgs) -> anyhow::Result<PlanRequest> {
    Ok(request_and_config(args)?.0)
}

fn model_summary(req: &PlanRequest) -> String {
    let m = &req.model;
    format!(
        "{} — {} layers, hidden {}, vocab {}, {} parameters",
        m.architecture.model_type(),
        m.num_hidden_layers,
        m.hidden_size,
        m.vocab_size,
        human_count(m.num_parameters())
    )
}

fn request_json(req: &PlanRequest) -> serde_json::Value {
    serde_json::json!({
        "precision": req.precision,
        // The flag's (and the run config's) unit: rows, pairs or prompts; and the rows they are.
        "micro_batch": req.micro_batch / req.head_loss.rows_per_sample(),
        "micro_batch_unit": req.head_loss.sample_unit(),
        "micro_batch_rows": req.micro_batch,
        "gradient_accumulation": req.gradient_accumulation,
        "seq_len": req.seq_len,
        "planned_seq_len": req.planned_seq_len(),
        "activation_checkpointing": req.activation_checkpointing,
        "optimizer_offload": req.optimizer_offload,
        "lora": req.lora,
        "strategy": req.strategy,
        "shard": req.shard,
        "devices": req.devices,
        "effective_batch": req.effective_batch(),
        "loss_rows": req.loss_rows(),
        "loss_rows_from_data": req.trained_tokens.is_some(),
    })
}

fn human_count(n: u64) -> String {
    let f = n as f64;
    if f >= 1e9 {
        format!("{:.2} B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.1} M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1} K", f / 1e3)
    } else {
        n.to_string()
    }
}

fn gib(b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format_bytes(b)
    }
}

fn print_plan(req: &PlanRequest, p: &Plan, per_layer: bool) {
    let header = [
        "device", "layers", "weights", "master", "grads", "optim", "activ", "logits", "temp",
        "collect", "overhead", "peak", "at", "capacity", "status",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for d in &p.per_device {
        rows.push(device_row(d));
    }
    for idle in req.devices.iter().skip(p.per_device.len()) {
        let mut r = vec![idle.name.clone(), "idle".into()];
        r.extend(std::iter::repeat_n(String::new(), 11));
        r.push(format_bytes(idle.capacity_bytes));
        r.push("unused".into());
        rows.push(r);
    }
    print_table(&rows);
    print_resume(p);
    if p.host_offload_bytes > 0 {
        println!(
            "Host RAM: {} of optimizer state (moments{}) offloaded from the GPUs",
            format_bytes(p.host_offload_bytes),
            if req.precision.master_weights() {
                " and fp32 master weights"
            } else {
                ""
            }
        );
    }
    for d in &p.per_device {
        if let Some(f) = &d.process {
            print_process(&d.device.name, f);
        }
    }
    println!();
    println!("Verdict: {} — {}", p.verdict, p.summary);
    if per_layer {
        println!();
        let mut rows: Vec<Vec<String>> = vec![[
            "block", "params", "weights", "master", "grads", "optim", "activ", "total",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()];
        for l in &p.per_layer {
            rows.push(vec![
                l.name.clone(),
                human_count(l.parameters),
                gib(l.weights_bytes),
                gib(l.master_weights_bytes),
                gib(l.gradients_bytes),
                gib(l.optimizer_states_bytes),
                gib(l.activations_bytes),
                gib(l.total_bytes()),
            ]);
        }
        print_table(&rows);
    }
}

fn device_row(d: &DevicePlan) -> Vec<String> {
    let layers = if d.layers.is_empty() {
        "-".to_string()
    } else {
        format!("{}-{}", d.layers.start, d.layers.end - 1)
    };
    let status = if d.fits {
        format!(
            "ok, {} free ({:.0} %)",
            format_bytes(d.headroom_bytes),
            100.0 * d.headroom_fraction()
        )
    } else {
        let first = match d.first_oom_phase {
            Some(ph) if PeakMoment::Step(ph) != d.peak_moment() => format!(", from the {ph}"),
            _ => String::new(),
        };
        format!(
            "OUT OF MEMORY by {}{first}",
            format_bytes(d.shortfall_bytes)
        )
    };
    vec![
        d.device.name.clone(),
        layers,
        gib(d.weights_bytes),
        gib(d.master_weights_bytes),
        gib(d.gradients_bytes),
        gib(d.optimizer_states_bytes),
        gib(d.activations_bytes),
        gib(d.logits_and_loss_bytes),
        gib(d.temporaries_bytes),
        gib(d.collective_bytes),
        gib(d.overhead_bytes),
        format_bytes(d.peak_bytes),
        d.peak_moment().to_string(),
        format_bytes(d.device.capacity_bytes),
        status,
    ]
}

/// One line: each device's peak while a resume (or an out-of-memory refit) loads a checkpoint.
fn print_resume(p: &Plan) {
    let figures: Vec<String> = p
        .per_device
        .iter()
        .map(|d| format!("{} {}", d.device.name, format_bytes(d.resume_peak_bytes)))
        .collect();
    println!(
        "Resume from a checkpoint: {} (weights, optimizer state and one tensor being read)",
        figures.join(", ")
    );
}

/// The process's resident set on a CPU device, term by term (the table's columns are the
/// training step's tensors; the peak column is this total).
fn print_process(device: &str, f: &tunestudio::plan::ProcessFootprint) {
    println!();
    println!(
        "Process peak RSS on {device}: {} (largest moment: {})",
        format_bytes(f.peak_bytes),
        f.largest_moment
    );
    let mut rows: Vec<Vec<String>> = vec![vec!["term".into(), "bytes".into(), "source".into()]];
    let moment = |name: &str, bytes: u64, source: &str| {
        vec![name.to_string(), format_bytes(bytes), source.to_string()]
    };
    rows.push(moment(
        "training tensors (step peak)",
        f.training_tensors_bytes,
        "the columns above (a layer split: every CPU stage's)",
    ));
    if f.untouched_at_peak_bytes() > 0 {
        rows.push(vec![
            "gemm slab pages never touched".into(),
            format!("−{}", format_bytes(f.untouched_at_peak_bytes())),
            "allocated per thread, packed only up to 1.2 MiB (examples/gemm_slab_rss.rs)".into(),
        ]);
    }
    if f.evaluation_bytes > 0 {
        rows.push(moment(
            "evaluation heap",
            f.evaluation_bytes,
            "resident state + the loss op's logits chunk",
        ));
    }
    if f.loading_bytes > 0 {
        rows.push(moment(
            "loading heap",
            f.loading_bytes,
            "mapped safetensors pages + loaded weights",
        ));
    }
    for t in &f.terms {
        rows.push(moment(t.name, t.bytes, t.source));
    }
    print_table(&rows);
}

fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{:<w$}", s, w = widths[c]))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

fn print_auto_fit(f: &AutoFit) {
    if f.found {
        println!("Auto-fit: {}", f.request.settings_summary());
    } else {
        println!(
            "Auto-fit found nothing that fits; closest: {}",
            f.request.settings_summary()
        );
    }
    for c in &f.changes {
        println!("  - {c}");
    }
    println!(
        "  effective batch {} rows/step kept; estimated speed ×{:.2} vs as requested",
        f.request.effective_batch(),
        f.relative_throughput
    );
    println!();
    print_plan(&f.request, &f.plan, false);
}
