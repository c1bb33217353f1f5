//! Run config: parsing, every problem reported at once by field name, round trips,
//! relative paths. No model is loaded.

use std::path::Path;
use tunestudio::train::{ConfigError, Precision, RunConfig, ScheduleKind};

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A valid config next to a model folder and a data file inside `dir`.
fn valid_toml(dir: &Path) -> String {
    std::fs::create_dir_all(dir.join("model")).unwrap();
    std::fs::write(dir.join("model/config.json"), "{}").unwrap();
    std::fs::write(dir.join("data.json"), "[]").unwrap();
    r#"
output_dir = "out"
[model]
source = "model"
init = "random"
[data]
path = "data.json"
[training]
micro_batch = 2
"#
    .to_string()
}

fn problems(err: &ConfigError) -> Vec<String> {
    err.problems().iter().map(|p| p.field.clone()).collect()
}

#[test]
fn valid_config_loads_with_relative_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "run.toml", &valid_toml(tmp.path()));
    let c = RunConfig::load(&path).unwrap();
    assert_eq!(c.training.micro_batch, 2);
    assert_eq!(c.training.precision, Precision::Fp32);
    assert_eq!(c.training.schedule, ScheduleKind::Cosine);
    assert_eq!(c.output_path(), tmp.path().join("out"));
    assert_eq!(
        c.model_source(),
        tmp.path().join("model").display().to_string()
    );
    assert_eq!(
        c.resolved_data().path,
        tmp.path().join("data.json").display().to_string()
    );
}

#[test]
fn save_and_load_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "run.toml", &valid_toml(tmp.path()));
    let mut c = RunConfig::load(&path).unwrap();
    c.training.precision = Precision::Bf16Mixed;
    c.training.max_steps = Some(7);
    c.lora.enabled = true;
    c.lora.target_modules = vec!["q_proj".into()];
    let saved = tmp.path().join("saved.toml");
    c.save(&saved).unwrap();
    let text = std::fs::read_to_string(&saved).unwrap();
    assert!(text.contains("precision = \"bf16-mixed\""), "{text}");
    let back = RunConfig::load(&saved).unwrap();
    assert_eq!(back, c);
    // Defaults serialise and parse too.
    let d = RunConfig::default();
    let d2 = RunConfig::from_toml_str(&d.to_toml_string().unwrap(), Path::new("")).unwrap();
    assert_eq!(d, d2);
}

#[test]
fn five_invalid_fields_are_all_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let mut text = valid_toml(tmp.path());
    text = text.replace("micro_batch = 2", "micro_batch = 0\ngradient_accumulation = 0\nlearning_rate = -1.0\nprecision = \"fp8\"\nwarmup_ratio = 1.5");
    text.push_str("[devices]\nstrategy = \"zero3\"\n");
    let path = write(tmp.path(), "run.toml", &text);
    let err = RunConfig::load(&path).unwrap_err();
    let fields = problems(&err);
    for f in [
        "training.micro_batch",
        "training.gradient_accumulation",
        "training.learning_rate",
        "training.precision",
        "training.warmup_ratio",
        "devices.strategy",
    ] {
        assert!(
            fields.contains(&f.to_string()),
            "{f} missing from {fields:?}\n{err}"
        );
    }
    assert_eq!(fields.len(), 6, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("training.gradient_accumulation: must be ≥ 1 (got 0)"),
        "{msg}"
    );
}

#[test]
fn unknown_precision_names_field_and_allowed_values() {
    let tmp = tempfile::tempdir().unwrap();
    let text = valid_toml(tmp.path()).replace("micro_batch = 2", "precision = \"fp8\"");
    let path = write(tmp.path(), "run.toml", &text);
    let err = RunConfig::load(&path).unwrap_err();
    let p = &err.problems()[0];
    assert_eq!(p.field, "training.precision");
    for allowed in Precision::NAMES {
        assert!(p.message.contains(allowed), "{} lacks {allowed}", p.message);
    }
    assert!(p.message.contains("fp8"), "{}", p.message);
}

#[test]
fn accumulation_zero_and_unknown_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let text = valid_toml(tmp.path()).replace(
        "micro_batch = 2",
        "gradient_accumulation = 0\nbatch_size = 8",
    );
    let path = write(tmp.path(), "run.toml", &text);
    let err = RunConfig::load(&path).unwrap_err();
    let fields = problems(&err);
    assert!(
        fields.contains(&"training.gradient_accumulation".to_string()),
        "{err}"
    );
    assert!(fields.contains(&"training.batch_size".to_string()), "{err}");
    let unknown = err
        .problems()
        .iter()
        .find(|p| p.field == "training.batch_size")
        .unwrap();
    assert!(
        unknown.message.contains("micro_batch"),
        "should list valid keys: {}",
        unknown.message
    );
}

#[test]
fn unwritable_output_dir_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    // A file where a folder is needed: unwritable even for root.
    std::fs::write(tmp.path().join("blocker"), "x").unwrap();
    let text =
        valid_toml(tmp.path()).replace("output_dir = \"out\"", "output_dir = \"blocker/run\"");
    let path = write(tmp.path(), "run.toml", &text);
    let err = RunConfig::load(&path).unwrap_err();
    let p = err
        .problems()
        .iter()
        .find(|p| p.field == "output_dir")
        .unwrap_or_else(|| panic!("no output_dir problem in {err}"));
    assert!(p.message.contains("blocker"), "{}", p.message);
}

#[test]
fn missing_model_folder_and_bad_data_are_reported_together() {
    let tmp = tempfile::tempdir().unwrap();
    let text = valid_toml(tmp.path())
        .replace("source = \"model\"", "source = \"./no-such-model\"")
        .replace(
            "path = \"data.json\"",
            "path = \"data.json\"\nmax_length = 1",
        );
    let path = write(tmp.path(), "run.toml", &text);
    let err = RunConfig::load(&path).unwrap_err();
    let fields = problems(&err);
    assert!(fields.contains(&"model.source".to_string()), "{err}");
    assert!(fields.contains(&"data.max_length".to_string()), "{err}");
}

#[test]
fn toml_syntax_error_names_the_line() {
    let err = RunConfig::from_toml_str("[training\nmicro_batch = 1", Path::new("")).unwrap_err();
    assert!(matches!(err, ConfigError::Syntax { .. }));
    assert!(err.to_string().contains("line 1"), "{err}");
}
