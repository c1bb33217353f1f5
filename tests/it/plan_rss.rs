//! Memory truth (issue #17): the plan's peak for a CPU run is the process's peak resident set
//! (`VmHWM`, what `top` and `/usr/bin/time -v` show), not only its training tensors. The
//! bundled demo (every position trained, longest batch first) trains 2 steps (then evaluates
//! and saves a checkpoint, as every run ends) as a child process; its `VmHWM` is read from
//! `/proc/<pid>/status` until it exits and compared with `tunestudio plan --config` for the
//! same run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The demo config, with absolute paths, its output in `out` and its longest batch first.
pub(crate) fn demo_config(dir: &Path) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("assets/demo.toml")).unwrap();
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let text = text
        .replace(
            "source = \"demo-model\"",
            &format!("source = {}", quoted(&root.join("assets/demo-model"))),
        )
        // The longest batch first (as HF's LengthGroupedSampler does, so an out-of-memory
        // shows at step 1).
        .replace(
            "path = \"demo-data.json\"",
            &format!(
                "path = {}\ngroup_by_length = true",
                quoted(&root.join("assets/demo-data.json"))
            ),
        )
        .replace(
            "output_dir = \"../runs/demo\"",
            &format!("output_dir = {}", quoted(&dir.join("out"))),
        );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The demo config of [`demo_config`], trained on every position: the plan is the worst case,
/// the micro-batch that trains the most tokens, which is then the longest batch, and
/// `group_by_length` puts it first, so two steps meet it. Trained on completions only, the
/// four samples with the longest completions (the plan's bound) do not share a batch, and the
/// first steps peak 6 MiB (4 %) below it.
pub(crate) fn every_position_demo_config(dir: &Path) -> std::path::PathBuf {
    let path = demo_config(dir);
    let text = std::fs::read_to_string(&path).unwrap();
    let every = text.replace(
        "group_by_length = true",
        "group_by_length = true\ntrain_on_completions_only = false",
    );
    assert_ne!(every, text);
    std::fs::write(&path, every).unwrap();
    path
}

fn vm_hwm_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(target_os = "linux")]
#[test]
fn the_demo_peak_rss_is_the_planned_peak() {
    let tmp = tempfile::tempdir().unwrap();
    check_planned_peak_rss("demo", &every_position_demo_config(tmp.path()));
}

/// A layer split over two logical CPU devices is one process whose stages run in turn: its
/// resident set is the planned process peak of `cpu:0`, which counts every CPU stage's
/// tensors (cpu:1 holds the head, the demo's largest tensors).
#[cfg(target_os = "linux")]
#[test]
fn a_layer_split_over_logical_cpu_devices_peaks_at_the_planned_process_peak() {
    let tmp = tempfile::tempdir().unwrap();
    let config = every_position_demo_config(tmp.path());
    let text = std::fs::read_to_string(&config).unwrap();
    let split = text
        .replace("devices = [\"cpu\"]", "devices = [\"cpu:0\", \"cpu:1\"]")
        .replace("strategy = \"single\"", "strategy = \"layer-split\"");
    assert_ne!(
        split, text,
        "the demo config names its devices and strategy"
    );
    std::fs::write(&config, split).unwrap();
    check_planned_peak_rss("demo, layer split on cpu:0,cpu:1", &config);
}

/// The demo run on other data, as a user would point it at real rows: `data` (its path,
/// format auto-detected) cut at `max_length`, longest batch first.
fn real_rows_config(dir: &Path, data: &Path, max_length: usize) -> std::path::PathBuf {
    let path = demo_config(dir);
    let text = std::fs::read_to_string(&path).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let demo_data = format!(
        "{:?}",
        root.join("assets/demo-data.json").display().to_string()
    );
    let text = text
        .replace(&demo_data, &format!("{:?}", data.display().to_string()))
        .replace("format = \"alpaca\"", "format = \"auto\"")
        .replace("max_length = 128", &format!("max_length = {max_length}"));
    assert!(text.contains(&format!("max_length = {max_length}")) && !text.contains(&demo_data));
    std::fs::write(&path, text).unwrap();
    path
}

/// Issue #44 item 4, on real rows: Alpaca's demo set (999 rows, most far shorter than 1024
/// tokens) at `max_length = 1024`. Dynamic padding pads each micro-batch to its own longest
/// row, so the plan sizes activations by the data's longest batch (the plan says so), not
/// 4 × 1024 positions.
#[cfg(target_os = "linux")]
#[test]
fn alpaca_rows_at_max_length_1024_peak_at_the_plan_of_their_longest_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tunestudio::paths::shared_dir().join("datasets/alpaca_en_demo.json");
    let config = real_rows_config(tmp.path(), &data, 1024);
    let settings = planned_settings(&config);
    assert!(
        settings.contains("planned for the longest batch of this data: 4 × "),
        "{settings}"
    );
    // Before gemm's large packing buffers were cut into chunks (`matmul::PackChunks`), the
    // plan counted 2 × 24 MiB of the head's packing on an AVX2 CPU and whether the two threads'
    // buffers overlapped was rayon's scheduling: +5.1 % (studio build) and +5.8 % (headless)
    // on a 2-vCPU EPYC. With chunks: +3.1 %.
    check_planned_peak_rss("alpaca_en_demo at 1024", &config);
}

/// The seed's dataset shape: a Parquet file with a single `Prompt` column of plain text (every
/// token trained), rows shorter than `max_length = 1024` (the longest about 650 tokens).
#[cfg(target_os = "linux")]
#[test]
fn a_single_prompt_column_parquet_peaks_at_the_plan_of_its_longest_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let rows: Vec<String> = serde_json::from_str::<Vec<serde_json::Value>>(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo-data.json"),
        )
        .unwrap(),
    )
    .unwrap()
    .iter()
    .map(|r| {
        format!(
            "{} {}",
            r["instruction"].as_str().unwrap(),
            r["output"].as_str().unwrap()
        )
    })
    .collect();
    let data = tmp.path().join("seed.parquet");
    super::data_support::write_parquet(&data, &[super::data_support::Col::Strings("Prompt", rows)]);
    let config = real_rows_config(tmp.path(), &data, 1024);
    let settings = planned_settings(&config);
    assert!(
        settings.contains("planned for the longest batch of this data"),
        "{settings}"
    );
    check_planned_peak_rss("single-Prompt Parquet at 1024", &config);
}

/// The new user's run of issue #44 in SmolLM2-135M's shape (30 layers, hidden 576, its
/// tokenizer; random weights: no pretrained checkpoint is available offline): Hebrew Alpaca
/// rows far shorter than `max_length = 192`, micro-batch 4. Before, the plan counted 4 × 192
/// positions and was 14 % over the measured peak.
#[cfg(target_os = "linux")]
#[test]
fn smollm2_shape_on_short_hebrew_rows_peaks_at_the_plan_of_its_longest_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let config = smollm2_shape_hebrew_config(tmp.path());
    let settings = planned_settings(&config);
    assert!(
        settings.contains("planned for the longest batch of this data"),
        "{settings}"
    );
    check_planned_peak_rss("SmolLM2-135M shape, Hebrew rows at 192", &config);
}

/// The run config of the new user's run (issue #44) in `dir`: a model folder in SmolLM2-135M's
/// shape with the demo's tokenizer (no weights), `tests/fixtures/alpaca_he.json` at
/// `max_length = 192`, micro-batch 4, the longest batch first.
pub(crate) fn smollm2_shape_hebrew_config(dir: &Path) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = dir.join("smollm2-135m");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        tunestudio::paths::shared_dir().join("model-configs/smollm2-135m.json"),
        model.join("config.json"),
    )
    .unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(root.join("assets/demo-model").join(f), model.join(f)).unwrap();
    }
    let config = real_rows_config(dir, &root.join("tests/fixtures/alpaca_he.json"), 192);
    let text = std::fs::read_to_string(&config).unwrap();
    let demo_model = format!("{:?}", root.join("assets/demo-model").display().to_string());
    let text = text.replace(&demo_model, &format!("{:?}", model.display().to_string()));
    assert!(!text.contains(&demo_model));
    std::fs::write(&config, text).unwrap();
    config
}

/// Issue #40 item 5: preference training's step holds the full logits of its 2 × micro-batch
/// rows (`model::preference::model_sequence_logps`), not the SFT loss's chunks of trained rows.
/// DPO with LoRA on the demo model (vocabulary 49,152) and 16 pairs of `dpo_en_demo.json`, 2
/// pairs a step cut at 64 + 128 tokens, longest batch first: each micro-batch's f32 logits are
/// 4 × 192 × 49,152 × 4 bytes = 144 MiB, and the step holds ten of them at its peak, most of
/// the process's resident set. Measured 1504 MiB; planned 1501 MiB, and 201 MiB (−87 %)
/// without the planner's full-logits head term.
#[cfg(target_os = "linux")]
#[test]
fn a_dpo_run_with_lora_peaks_at_the_planned_full_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let config = dpo_lora_demo_config(tmp.path());
    let settings = planned_settings(&config);
    assert!(
        settings.contains("micro-batch 4 ") && settings.contains("seq 192"),
        "2 pairs are 4 rows of 64 + 128 tokens: {settings}"
    );
    assert!(settings.contains("full logits"), "{settings}");
    check_planned_peak_rss("DPO, LoRA r 8, 2 pairs × 192", &config);
}

/// A DPO plan is sized by the data's longest pair, as an SFT plan is by its longest batch:
/// with limits of 512 + 512 tokens, the demo's pairs pad to less than 1024 (985 tokens), and
/// `tunestudio plan --config` plans that length (`planned_seq_len`).
#[test]
fn a_dpo_plan_is_sized_by_the_longest_pair_of_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let config = dpo_lora_demo_config(tmp.path());
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("max_prompt_length = 64", "max_prompt_length = 512")
        .replace("max_completion_length = 128", "max_completion_length = 512")
        .replace(
            "\"pair-completion-truncated\", \"pair-prompt-truncated\"",
            "",
        );
    std::fs::write(&config, text).unwrap();
    let sized = plan_json(&config);
    // The longest of the 16 pairs, tokenized here as the trainer does.
    let run = tunestudio::train::RunConfig::load(&config).unwrap();
    let tok =
        tunestudio::data::TokenizerBundle::load(&run.resolve_path(Path::new(&run.model.source)))
            .unwrap();
    let pairs = tunestudio::train::preference::load_pair_splits(&run, &tok).unwrap();
    let longest = pairs.train.iter().map(|p| p.len()).max().unwrap();
    let request = &sized["request"];
    assert_eq!(request["seq_len"], 1024, "{request}");
    assert_eq!(
        request["planned_seq_len"].as_u64().unwrap() as usize,
        longest.next_multiple_of(8),
        "the longest pair has {longest} tokens: {request}"
    );
    assert!(
        longest.next_multiple_of(8) < 1024,
        "the demo's pairs are shorter than the limits: {longest}"
    );
}

/// The DPO run of [`a_dpo_run_with_lora_peaks_at_the_planned_full_logits`] in `dir`.
fn dpo_lora_demo_config(dir: &Path) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rows: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(tunestudio::paths::shared_dir().join("datasets/dpo_en_demo.json"))
            .unwrap(),
    )
    .unwrap();
    let data = dir.join("pairs.json");
    std::fs::write(&data, serde_json::to_string(&rows[..16]).unwrap()).unwrap();
    let config = format!(
        r#"output_dir = {out:?}
[model]
source = {model:?}
init = "random"
[data]
path = {data:?}
validation_ratio = 0.0
group_by_length = true
allow = ["learning-rate", "pair-completion-truncated", "pair-prompt-truncated"]
[training]
method = "dpo"
precision = "fp32"
micro_batch = 2
learning_rate = 0.001
schedule = "constant"
seed = 0
[preference]
max_prompt_length = 64
max_completion_length = 128
[lora]
enabled = true
r = 8
alpha = 16
[checkpoint]
save_every = 0
save_final = false
[devices]
devices = ["cpu"]
strategy = "single"
"#,
        out = dir.join("out").display().to_string(),
        model = root.join("assets/demo-model").display().to_string(),
        data = data.display().to_string(),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, config).unwrap();
    path
}

/// The settings line of `tunestudio plan --config`.
fn planned_settings(config: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--config"])
        .arg(config)
        .env_remove("TUNESTUDIO_OPS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("Settings:"))
        .unwrap_or_else(|| panic!("no settings line: {stdout}{stderr}"));
    format!("{line}\n{stderr}")
}

/// `tunestudio plan --json --config config` (the native or generic ops as the machine picks).
fn plan_json(config: &Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--json", "--config"])
        .arg(config)
        .env_remove("TUNESTUDIO_OPS")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Plans `config` with `tunestudio plan --config`, trains it 2 steps as a child process, and
/// compares the first device's planned peak (the process's) with the child's `VmHWM`: ±5 %.
fn check_planned_peak_rss(label: &str, config: &Path) {
    let tolerance = 0.05;
    let bin = env!("CARGO_BIN_EXE_tunestudio");
    let json = plan_json(config);
    let device = &json["plan"]["per_device"][0];
    let device = if device.is_null() {
        &json["per_device"][0]
    } else {
        device
    };
    let predicted = device["peak_bytes"].as_u64().unwrap();
    assert!(
        device["process"]["terms"]
            .as_array()
            .is_some_and(|t| !t.is_empty()),
        "the CPU plan names the process terms: {device}"
    );

    let mut child = Command::new(bin)
        .args(["train", "--max-steps", "2", "--config"])
        .arg(config)
        .env_remove("TUNESTUDIO_OPS")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // VmHWM only grows: the last reading before the process exits is its peak (the peak is
    // the evaluation, before the checkpoint is written, so it is long seen by then).
    let mut measured = 0u64;
    let status = loop {
        if let Some(hwm) = vm_hwm_bytes(child.id()) {
            measured = measured.max(hwm);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut stderr).unwrap();
    }
    assert!(status.success(), "{stderr}");
    let err = (predicted as f64 - measured as f64) / measured as f64;
    println!(
        "{label}: peak RSS {:.1} MiB measured, {:.1} MiB planned ({:+.1} %)",
        measured as f64 / (1 << 20) as f64,
        predicted as f64 / (1 << 20) as f64,
        100.0 * err
    );
    assert!(
        err.abs() <= tolerance,
        "{label}: planned {predicted} vs measured {measured} ({:+.1} %)",
        100.0 * err
    );
}

/// The trainer's pre-flight refuses a CPU run only when the plan the user sees does not fit:
/// the demo (its run config as the trainer reads it, its data tokenized as the trainer does) on
/// a host sized between its plan counting every loss row (about 176 MiB) and its plan with the
/// data's trained tokens (150 MiB, what `plan --config` and the studio show) passes; on a host
/// smaller than both it is refused; the data is tokenized only when the first plan is short.
#[test]
fn the_pre_flight_check_plans_the_trained_rows_the_plan_shows() {
    use tunestudio::train::memory::{check_request, PlanCheck};
    let tmp = tempfile::tempdir().unwrap();
    let config = tunestudio::train::RunConfig::load(&demo_config(tmp.path())).unwrap();
    let with_host = |host: &str| {
        let mut req = tunestudio::train::local_plan_request(&config).unwrap();
        req.devices = tunestudio::plan::parse_devices(&format!("cpu={host}")).unwrap();
        req
    };
    let trained = || tunestudio::train::samples::trained_tokens(&config).unwrap();
    let mut asked = false;
    let roomy = check_request(with_host("64GiB"), || {
        asked = true;
        trained()
    });
    assert_eq!(roomy, PlanCheck::Fits);
    assert!(
        !asked,
        "a run that fits its upper bound is not tokenized again"
    );
    // Host sizes from the two plans themselves (the CPU's gemm workspace makes them differ by
    // machine): halfway between them, and 10 % under the smaller.
    let peak = |req: tunestudio::plan::PlanRequest| {
        tunestudio::plan::plan(&req).unwrap().per_device[0].peak_bytes
    };
    let every_row = peak(with_host("64GiB"));
    let mut fitted_req = with_host("64GiB");
    fitted_req.trained_tokens = trained();
    let fitted = peak(fitted_req);
    assert!(fitted < every_row, "{fitted} vs {every_row}");
    let mib = |bytes: u64| format!("{}MiB", bytes >> 20);
    let halfway = mib((fitted + every_row) / 2);
    let between = check_request(with_host(&halfway), trained);
    assert!(
        matches!(between, PlanCheck::Fits | PlanCheck::Tight { .. }),
        "{between:?}"
    );
    assert!(matches!(
        check_request(with_host(&halfway), || None),
        PlanCheck::OutOfMemory { on_cpu: true, .. }
    ));
    assert!(matches!(
        check_request(with_host(&mib(fitted * 9 / 10)), trained),
        PlanCheck::OutOfMemory { on_cpu: true, .. }
    ));
}

/// Issue #59 item 7: a GRPO step's peak is its policy forward and backward over G completions
/// per prompt at prompt + `max_completion_length` tokens, the completion positions' head run
/// through the chunked loss op (each token's log-probability and entropy), planned as
/// `micro_batch × G` rows. The
/// demo model's random weights almost never sample its EOS (1 in 49,152 per token), so every
/// completion runs to `max_completion_length`: the length the plan assumes.
#[cfg(target_os = "linux")]
#[test]
fn a_grpo_run_with_lora_peaks_at_the_plan_of_its_full_length_completions() {
    let tmp = tempfile::tempdir().unwrap();
    let config = grpo_lora_demo_config(tmp.path());
    let settings = planned_settings(&config);
    assert!(
        settings.contains("micro-batch 8 "),
        "1 prompt × 8 generations are 8 rows: {settings}"
    );
    check_planned_peak_rss("GRPO, LoRA r 8, 1 prompt × G 8 × (48 + 96)", &config);
}

/// A GRPO + LoRA run of the demo model in `dir`: 4 conversational prompts cut at 48 tokens,
/// 8 completions of at most 96 tokens each, 1 prompt per micro-step, a format reward.
fn grpo_lora_demo_config(dir: &Path) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rows: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            serde_json::json!({
                "prompt": [{"role": "user", "content": format!("Write a long story about the number {i}, then give it a title.")}],
            })
        })
        .collect();
    let data = dir.join("prompts.json");
    std::fs::write(&data, serde_json::to_string(&rows).unwrap()).unwrap();
    let config = format!(
        r#"output_dir = {out:?}
[model]
source = {model:?}
init = "random"
[data]
path = {data:?}
validation_ratio = 0.0
allow = ["learning-rate"]
[training]
method = "grpo"
precision = "fp32"
micro_batch = 1
learning_rate = 0.00001
schedule = "constant"
seed = 0
[grpo]
num_generations = 8
max_prompt_length = 48
max_completion_length = 96
[[grpo.reward]]
kind = "format"
pattern = "[A-Z].*"
[lora]
enabled = true
r = 8
alpha = 16
[checkpoint]
save_every = 0
save_final = false
[devices]
devices = ["cpu"]
strategy = "single"
"#,
        out = dir.join("out").display().to_string(),
        model = root.join("assets/demo-model").display().to_string(),
        data = data.display().to_string(),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, config).unwrap();
    path
}
