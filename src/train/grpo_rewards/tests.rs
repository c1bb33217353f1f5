//! The reward functions against TRL's GRPO fixture, the answer rules, validation, and command
//! programs (Python scripts written by the tests).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::answer::{answers_match, final_answer, parse_number, reference_answer};
use super::builtin::length_penalty;
use super::*;

/// The fixture's format rule: a bare number or `The answer is N.`.
const FORMAT: &str = r"(The answer is )?-?\d+\.?";

fn row(answer: Value) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("answer".into(), answer);
    m
}

/// `(prompt, answer, completion, tokens)` → inputs borrowing `rows`.
fn inputs<'a>(
    rows: &'a [Map<String, Value>],
    batch: &'a [(usize, &'a str, usize)],
) -> Vec<RewardInput<'a>> {
    batch
        .iter()
        .map(|&(r, completion, completion_tokens)| RewardInput {
            prompt: "What is it?",
            completion,
            completion_tokens,
            row: &rows[r],
        })
        .collect()
}

/// TRL's fixture rows: two prompts (answers 12 and 21), four completions each.
fn fixture_rows() -> Vec<Map<String, Value>> {
    vec![row(json!("12")), row(json!("21"))]
}

const FIXTURE_BATCH: [(usize, &str, usize); 8] = [
    (0, "12", 3),
    (0, "The answer is 12.", 8),
    (0, "13", 3),
    (0, "I don't know", 5),
    (1, "21", 3),
    (1, "12 + 9 = 21", 10),
    (1, "The answer is 22.", 8),
    (1, "I think 12 + 9 is 20.", 14),
];

/// TRL's fixture scored its format reward 0.5 with weight 0.5; ours scores 1.0, so weight 0.25
/// gives the same summed rewards.
fn fixture_specs() -> Vec<RewardSpec> {
    vec![
        RewardSpec::accuracy("answer"),
        RewardSpec::format(FORMAT).with_weight(0.25),
    ]
}

fn metric(metrics: &[(String, f64)], key: &str) -> f64 {
    metrics
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no metric {key} in {metrics:?}"))
        .1
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() < 1e-6, "{what}: {got} vs {want}");
}

#[test]
fn fixture_batch_scores_and_metrics_match_trl() {
    let rows = fixture_rows();
    let mut set = RewardSet::start(&fixture_specs(), Path::new(".")).unwrap();
    let scores = set.score(&inputs(&rows, &FIXTURE_BATCH)).unwrap();
    assert_eq!(scores.names, ["accuracy", "format"]);
    assert_eq!(scores.per_function[0], [1., 1., 0., 0., 1., 1., 0., 0.]);
    assert_eq!(scores.per_function[1], [1., 1., 1., 0., 1., 0., 1., 0.]);
    assert_eq!(
        scores.weighted(),
        [1.25, 1.25, 0.25, 0., 1.25, 1., 0.25, 0.]
    );
    // TRL's `batch_metrics` (format's are twice TRL's: 1.0 per match instead of 0.5).
    let m = scores.metrics();
    assert_close(metric(&m, "rewards/accuracy/mean"), 0.5, "accuracy mean");
    assert_close(
        metric(&m, "rewards/accuracy/std"),
        0.534522533416748,
        "accuracy std",
    );
    assert_close(
        metric(&m, "rewards/format/mean"),
        2.0 * 0.3125,
        "format mean",
    );
    assert_close(
        metric(&m, "rewards/format/std"),
        2.0 * 0.2587745785713196,
        "format std",
    );
    assert_close(metric(&m, "reward"), 0.65625, "reward");
    assert_close(metric(&m, "reward_std"), 0.581523597240448, "reward_std");
    assert_eq!(m.len(), 6);
}

#[test]
fn fixture_rewards_match_the_reference_file() {
    let path = crate::paths::shared_dir().join("fixtures/tiny-llama-grpo/reference.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipped: no {}", path.display());
        return;
    };
    let reference: Value = serde_json::from_str(&text).unwrap();
    let answers: Vec<Map<String, Value>> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| row(p["answer"].clone()))
        .collect();
    let completions = reference["completions"].as_array().unwrap();
    let batch: Vec<(usize, &str, usize)> = completions
        .iter()
        .map(|c| {
            let prompt = c["prompt"].as_u64().unwrap() as usize;
            (
                prompt,
                c["text"].as_str().unwrap(),
                c["tokens"].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let mut set = RewardSet::start(&fixture_specs(), Path::new(".")).unwrap();
    let scores = set.score(&inputs(&answers, &batch)).unwrap();
    for (i, c) in completions.iter().enumerate() {
        let accuracy = c["rewards"]["accuracy"].as_f64().unwrap() as f32;
        let format = c["rewards"]["format"].as_f64().unwrap() as f32;
        assert_eq!(
            scores.per_function[0][i], accuracy,
            "accuracy of {}",
            c["text"]
        );
        assert_eq!(
            scores.per_function[1][i],
            2.0 * format,
            "format of {}",
            c["text"]
        );
        assert_eq!(scores.weighted()[i], c["reward"].as_f64().unwrap() as f32);
    }
    let trl = &reference["batch_metrics"];
    let m = scores.metrics();
    for key in [
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "rewards/accuracy/std",
    ] {
        assert_close(metric(&m, key), trl[key].as_f64().unwrap(), key);
    }
}

#[test]
fn edge_batch_metrics_match_trl() {
    let rows = fixture_rows();
    let batch = [
        (0, "12", 3),
        (0, "The answer is 12.", 8),
        (0, "13", 3),
        (0, "I don't know", 5),
        (1, "21", 3),
        (1, "The answer is 21.", 8),
        (1, "21", 3),
        (1, "The answer is 21.", 8),
    ];
    let mut set = RewardSet::start(&fixture_specs(), Path::new(".")).unwrap();
    let scores = set.score(&inputs(&rows, &batch)).unwrap();
    assert_eq!(
        scores.weighted(),
        [1.25, 1.25, 0.25, 0., 1.25, 1.25, 1.25, 1.25]
    );
    let m = scores.metrics();
    assert_close(metric(&m, "reward"), 0.96875, "reward");
    assert_close(metric(&m, "reward_std"), 0.5250425338745117, "reward_std");
    assert_close(metric(&m, "rewards/accuracy/mean"), 0.75, "accuracy mean");
    assert_close(
        metric(&m, "rewards/accuracy/std"),
        0.46291008591651917,
        "accuracy std",
    );
}

#[test]
fn metrics_of_given_weighted_rewards() {
    let scores = RewardScores {
        per_function: vec![vec![1.25, 1.25, 0.25, 0., 1.25, 1.25, 1.25, 1.25]],
        names: vec!["given".into()],
        weights: vec![1.0],
    };
    let m = scores.metrics();
    assert_close(metric(&m, "reward"), 0.96875, "reward");
    assert_close(metric(&m, "reward_std"), 0.5250425, "reward_std");
    let one = RewardScores {
        per_function: vec![vec![0.5]],
        names: vec!["one".into()],
        weights: vec![2.0],
    };
    assert_eq!(metric(&one.metrics(), "reward"), 1.0);
    assert_eq!(metric(&one.metrics(), "reward_std"), 0.0);
    assert_eq!(metric(&one.metrics(), "rewards/one/std"), 0.0);
}

fn accuracy_of(completion: &str, answer: Value) -> f32 {
    let rows = [row(answer)];
    let mut set = RewardSet::start(&[RewardSpec::accuracy("answer")], Path::new(".")).unwrap();
    set.score(&inputs(&rows, &[(0, completion, 1)]))
        .unwrap()
        .per_function[0][0]
}

#[test]
fn accuracy_takes_the_boxed_answer_else_the_last_number() {
    assert_eq!(accuracy_of("12 + 9 = 21", json!("21")), 1.0);
    assert_eq!(accuracy_of("The answer is 22.", json!("21")), 0.0);
    assert_eq!(accuracy_of(r"so \boxed{21}", json!("21")), 1.0);
    assert_eq!(accuracy_of(r"\boxed{21} or maybe 22", json!("21")), 1.0);
    assert_eq!(accuracy_of(r"\boxed{20} no, \boxed{21}", json!("21")), 1.0);
    assert_eq!(
        accuracy_of(r"\boxed{\frac{1}{2}}", json!(r"\frac{1}{2}")),
        1.0
    );
    assert_eq!(accuracy_of("I don't know", json!("21")), 0.0);
    assert_eq!(accuracy_of("It costs $1,234.", json!("1234")), 1.0);
    assert_eq!(accuracy_of("12.0", json!(12)), 1.0);
    assert_eq!(accuracy_of("-3.5", json!(-3.5)), 1.0);
    assert_eq!(
        accuracy_of("x-3", json!("-3")),
        0.0,
        "a hyphen is not a sign"
    );
    assert_eq!(
        accuracy_of("42", json!("She pays 6 * 7 = 42 dollars.\n#### 42")),
        1.0,
        "GSM8K solution"
    );
    assert_eq!(accuracy_of("so 1,2", json!("12")), 0.0);
}

#[test]
fn answer_rules() {
    assert_eq!(final_answer("12 + 9 = 21"), Some("21"));
    assert_eq!(final_answer("The answer is 12."), Some("12"));
    assert_eq!(final_answer(r"\boxed{x^{2}} then 5"), Some("x^{2}"));
    assert_eq!(final_answer(r"\boxed{unclosed 7"), Some("7"));
    assert_eq!(final_answer("about -4 degrees"), Some("-4"));
    assert_eq!(parse_number("1,234"), Some(1234.0));
    assert_eq!(parse_number("1,2"), None);
    assert_eq!(parse_number(" $5. "), Some(5.0));
    assert!(answers_match("12", "12.0"));
    assert!(answers_match("yes", " yes "));
    assert!(!answers_match("Yes", "no"));
    assert_eq!(reference_answer(&json!("#### 1,234")), Some("1,234".into()));
    assert_eq!(reference_answer(&json!(r"so \boxed{7}.")), Some("7".into()));
    assert_eq!(reference_answer(&json!(null)), None);
}

#[test]
fn accuracy_with_a_pattern_takes_its_first_group() {
    let rows = [row(json!("Paris"))];
    let spec = RewardSpec {
        pattern: Some(r"<answer>(.*?)</answer>".into()),
        ..RewardSpec::accuracy("answer")
    };
    let mut set = RewardSet::start(&[spec], Path::new(".")).unwrap();
    let batch = [
        (0, "<answer>Lyon</answer> no: <answer> Paris </answer>", 1),
        (0, "Paris", 1),
    ];
    let scores = set.score(&inputs(&rows, &batch)).unwrap();
    assert_eq!(scores.per_function[0], [1.0, 0.0]);
}

#[test]
fn accuracy_without_the_column_names_it() {
    let rows = [row(json!("12"))];
    let mut set = RewardSet::start(&[RewardSpec::accuracy("solution")], Path::new(".")).unwrap();
    let e = set.score(&inputs(&rows, &[(0, "12", 1)])).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, RewardError::MissingColumn { .. }), "{msg}");
    assert!(msg.contains("rewards/accuracy"), "{msg}");
    assert!(
        msg.contains("`solution`") && msg.contains("its columns: answer"),
        "{msg}"
    );
    assert!(msg.contains("set `column`"), "{msg}");
    let nulls = [row(json!(null))];
    let mut set = RewardSet::start(&[RewardSpec::accuracy("answer")], Path::new(".")).unwrap();
    let e = set.score(&inputs(&nulls, &[(0, "12", 1)])).unwrap_err();
    assert!(matches!(e, RewardError::BadColumnValue { .. }), "{e}");
}

#[test]
fn format_matches_the_whole_trimmed_completion() {
    let rows = [row(json!("12"))];
    let mut set = RewardSet::start(&[RewardSpec::format(FORMAT)], Path::new(".")).unwrap();
    let batch = [
        (0, "12", 1),
        (0, "The answer is 12.", 1),
        (0, "12 + 9 = 21", 1),
        (0, "  12\n", 1),
        (0, "I think 12", 1),
    ];
    let scores = set.score(&inputs(&rows, &batch)).unwrap();
    assert_eq!(scores.per_function[0], [1.0, 1.0, 0.0, 1.0, 0.0]);
    let tags = RewardSpec::format(r"<think>.*</think>\s*<answer>.*</answer>");
    let mut set = RewardSet::start(&[tags], Path::new(".")).unwrap();
    let batch = [
        (0, "<think>a\nb</think>\n<answer>12</answer>", 1),
        (0, "<answer>12</answer>", 1),
    ];
    assert_eq!(
        set.score(&inputs(&rows, &batch)).unwrap().per_function[0],
        [1.0, 0.0]
    );
}

#[test]
fn length_penalises_beyond_the_target() {
    assert_eq!(length_penalty(5, 10), 0.0);
    assert_eq!(length_penalty(10, 10), 0.0);
    assert_eq!(length_penalty(15, 10), -0.5);
    assert_eq!(length_penalty(20, 10), -1.0);
    assert_eq!(length_penalty(45, 10), -1.0);
    let rows = [row(json!("1"))];
    let mut set =
        RewardSet::start(&[RewardSpec::length(4).with_weight(2.0)], Path::new(".")).unwrap();
    let scores = set
        .score(&inputs(&rows, &[(0, "a", 3), (0, "b", 5)]))
        .unwrap();
    assert_eq!(scores.per_function[0], [0.0, -0.25]);
    assert_eq!(scores.weighted(), [0.0, -0.5]);
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Grpo {
    reward: Vec<RewardSpec>,
}

fn parse(toml_text: &str) -> Result<Vec<RewardSpec>, toml::de::Error> {
    toml::from_str::<Grpo>(toml_text).map(|g| g.reward)
}

#[test]
fn specs_read_from_toml_with_defaults() {
    let specs = parse(
        r#"
        [[reward]]
        kind = "accuracy"

        [[reward]]
        kind = "format"
        pattern = '<answer>\d+</answer>'
        weight = 0.5

        [[reward]]
        kind = "command"
        command = ["python3", "-u", "scripts/reward.py", "--strict"]
        timeout_secs = 5
        "#,
    )
    .unwrap();
    assert_eq!(specs[0].weight, 1.0);
    assert_eq!(specs[0].column(), "answer");
    assert_eq!(specs[1].pattern.as_deref(), Some(r"<answer>\d+</answer>"));
    let names: Vec<String> = specs.iter().map(RewardSpec::name).collect();
    assert_eq!(names, ["accuracy", "format", "reward"]);
    assert_eq!(specs[2].timeout_secs(), 5.0);
    assert_eq!(RewardSpec::command(&["./score"]).name(), "score");
    assert_eq!(
        RewardSpec::command(&["python3.11", "-m", "scorer"]).name(),
        "python3"
    );
    validate(&specs).unwrap();
    let e = parse("[[reward]]\nkind = \"format\"\npatern = 'x'").unwrap_err();
    assert!(e.to_string().contains("patern"), "{e}");
    let e = parse("[[reward]]\nkind = \"speed\"").unwrap_err();
    assert!(e.to_string().contains("speed"), "{e}");
    // Round trip, as the studio saves a config.
    let text = toml::to_string(&Grpo {
        reward: specs.clone(),
    })
    .unwrap();
    assert_eq!(parse(&text).unwrap(), specs);
}

#[test]
fn validation_names_the_reward_and_the_fix() {
    let err = |specs: &[RewardSpec]| validate(specs).unwrap_err().to_string();
    let msg = err(&[RewardSpec::accuracy("a"), RewardSpec::accuracy("b")]);
    assert!(
        msg.contains("`accuracy`") && msg.contains("distinct `name`"),
        "{msg}"
    );
    validate(&[
        RewardSpec::accuracy("a"),
        RewardSpec::accuracy("b").named("acc2"),
    ])
    .unwrap();
    let msg = err(&[RewardSpec::format("(unclosed").named("tags")]);
    assert!(
        msg.contains("rewards/tags") && msg.contains("(unclosed"),
        "{msg}"
    );
    assert!(
        msg.contains("unclosed group") && msg.contains("fix the pattern"),
        "{msg}"
    );
    let msg = err(&[RewardSpec::length(10).with_weight(f64::NAN)]);
    assert!(
        msg.contains("rewards/length") && msg.contains("weight = NaN"),
        "{msg}"
    );
    let msg = err(&[RewardSpec::length(0)]);
    assert!(msg.contains("target_tokens must be ≥ 1"), "{msg}");
    let msg = err(&[RewardSpec::command::<&str>(&[]).named("judge")]);
    assert!(
        msg.contains("rewards/judge") && msg.contains("command is empty"),
        "{msg}"
    );
    let msg = err(&[RewardSpec {
        target_tokens: Some(3),
        ..RewardSpec::format("x")
    }]);
    assert!(
        msg.contains("`target_tokens` is not a key of a format reward"),
        "{msg}"
    );
    let msg = err(&[RewardSpec {
        pattern: None,
        ..RewardSpec::format("x")
    }]);
    assert!(msg.contains("needs `pattern`"), "{msg}");
    let msg = err(&[RewardSpec::accuracy("a").named("a/b")]);
    assert!(msg.contains("without `/`"), "{msg}");
    let msg = err(&[RewardSpec {
        timeout_secs: Some(0.0),
        ..RewardSpec::command(&["x"])
    }]);
    assert!(msg.contains("timeout_secs = 0"), "{msg}");
    // `start` validates too.
    assert!(RewardSet::start(&[RewardSpec::length(0)], Path::new(".")).is_err());
}

#[test]
fn a_reward_set_can_move_to_the_trainer_thread() {
    fn send<T: Send>() {}
    send::<RewardSet>();
}

// ---- command rewards -------------------------------------------------------------------

/// A Python script in a fresh folder; `None` (test skipped) when python3 is not installed.
fn script(source: &str) -> Option<tempfile::TempDir> {
    let ok = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: no python3");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("reward.py"), source).unwrap();
    Some(dir)
}

fn command_spec(timeout_secs: f64) -> RewardSpec {
    RewardSpec {
        timeout_secs: Some(timeout_secs),
        ..RewardSpec::command(&["python3", "reward.py"])
    }
}

/// The built-in accuracy rule (boxed, else last number; numbers compared as numbers), in
/// Python, as a user would write it. `print` without flush: the reward sets PYTHONUNBUFFERED.
const ACCURACY_PY: &str = r#"
import json, re, sys
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
def answer(text):
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1]
    numbers = re.findall(NUMBER, text)
    return numbers[-1] if numbers else None
def number(text):
    try:
        return float(text.strip().rstrip(".").replace(",", ""))
    except ValueError:
        return None
for line in sys.stdin:
    row = json.loads(line)
    got, want = answer(row["completion"]), str(row["answer"])
    a, b = (number(got), number(want)) if got is not None else (None, None)
    ok = got is not None and (a == b if a is not None and b is not None else got.strip() == want.strip())
    print(1.0 if ok else 0.0)
"#;

#[test]
fn a_python_reward_gives_the_builtin_scores() {
    let Some(dir) = script(ACCURACY_PY) else {
        return;
    };
    let rows = fixture_rows();
    let more = [
        (1, r"\boxed{21}", 4),
        (0, "It is 1,2", 4),
        (1, "twenty-one: 21.0", 6),
    ];
    let specs = [RewardSpec::accuracy("answer"), command_spec(20.0)];
    let mut set = RewardSet::start(&specs, dir.path()).unwrap();
    assert_eq!(set.names(), ["accuracy", "reward"]);
    // Two batches through the same process.
    for batch in [&FIXTURE_BATCH[..], &more[..]] {
        let scores = set.score(&inputs(&rows, batch)).unwrap();
        assert_eq!(scores.per_function[1], scores.per_function[0], "{batch:?}");
    }
    let scores = set.score(&inputs(&rows, &FIXTURE_BATCH)).unwrap();
    assert_eq!(scores.per_function[1], [1., 1., 0., 0., 1., 1., 0., 0.]);
    assert!(set.score(&[]).unwrap().is_empty());
}

#[test]
fn the_program_sees_prompt_completion_and_the_row() {
    let Some(dir) = script(
        "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)\n    print(len(r['prompt']) + 10 * len(r['completion']) + 100 * r['answer'])\n",
    ) else {
        return;
    };
    let rows = [row(json!(3))];
    let mut set = RewardSet::start(&[command_spec(20.0)], dir.path()).unwrap();
    let scores = set.score(&inputs(&rows, &[(0, "abcd", 2)])).unwrap();
    assert_eq!(
        scores.per_function[0],
        ["What is it?".len() as f32 + 40.0 + 300.0]
    );
}

fn command_error(source: &str, timeout_secs: f64) -> Option<(RewardError, Duration, RewardSet)> {
    let dir = script(source)?;
    let rows = fixture_rows();
    let mut set =
        RewardSet::start(&[command_spec(timeout_secs).named("judge")], dir.path()).unwrap();
    let started = Instant::now();
    let e = set.score(&inputs(&rows, &FIXTURE_BATCH[..2])).unwrap_err();
    Some((e, started.elapsed(), set))
}

#[test]
fn a_crash_names_the_reward_its_status_and_stderr() {
    let source = "import sys\nsys.stdin.readline()\nprint('KeyError: solution', file=sys.stderr)\nsys.exit(3)\n";
    let Some((e, _, mut set)) = command_error(source, 20.0) else {
        return;
    };
    let msg = e.to_string();
    assert!(matches!(e, RewardError::Exited { .. }), "{msg}");
    assert!(
        msg.contains("rewards/judge") && msg.contains("python3 reward.py"),
        "{msg}"
    );
    assert!(
        msg.contains("exit status: 3") && msg.contains("after 0 of 2 scores"),
        "{msg}"
    );
    assert!(msg.contains("KeyError: solution"), "{msg}");
    assert!(msg.contains("fix the program"), "{msg}");
    let rows = fixture_rows();
    let again = set.score(&inputs(&rows, &FIXTURE_BATCH[..1])).unwrap_err();
    assert!(matches!(again, RewardError::Stopped { .. }), "{again}");
}

#[test]
fn a_line_that_is_no_number_is_shown() {
    let source = "import sys\nfor line in sys.stdin:\n    print('starting', file=sys.stderr)\n    print('abc')\n";
    let Some((e, _, _)) = command_error(source, 20.0) else {
        return;
    };
    let msg = e.to_string();
    assert!(
        matches!(e, RewardError::NotANumber { line_number: 1, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("rewards/judge") && msg.contains("\"abc\""),
        "{msg}"
    );
    assert!(
        msg.contains("score line 1 of 2") && msg.contains("starting"),
        "{msg}"
    );
    assert!(msg.contains("one number per input line"), "{msg}");
}

#[test]
fn too_few_lines_is_a_wrong_count() {
    let source = "import sys\nsys.stdin.readline()\nprint(1)\n";
    let Some((e, _, _)) = command_error(source, 20.0) else {
        return;
    };
    let msg = e.to_string();
    assert!(matches!(e, RewardError::WrongCount { .. }), "{msg}");
    assert!(
        msg.contains("after writing 1 scores") && msg.contains("batch of 2"),
        "{msg}"
    );
}

#[test]
fn too_many_lines_is_a_wrong_count_by_the_next_batch() {
    let source = "import sys\nfor line in sys.stdin:\n    print(1)\n    print(2)\n";
    let Some(dir) = script(source) else { return };
    let rows = fixture_rows();
    let mut set = RewardSet::start(&[command_spec(20.0)], dir.path()).unwrap();
    // The first batch reads the first input's two lines as the two scores; the extra lines
    // fail it when they are already there, else the next batch.
    let e = match set.score(&inputs(&rows, &FIXTURE_BATCH[..2])) {
        Err(e) => e,
        Ok(_) => {
            std::thread::sleep(Duration::from_millis(300));
            set.score(&inputs(&rows, &FIXTURE_BATCH[..2])).unwrap_err()
        }
    };
    let msg = e.to_string();
    assert!(matches!(e, RewardError::WrongCount { .. }), "{msg}");
    assert!(
        msg.contains("rewards/reward") && msg.contains("more lines than it was sent"),
        "{msg}"
    );
}

#[test]
fn a_slow_program_times_out() {
    let source = "import sys, time\nfor line in sys.stdin:\n    time.sleep(30)\n    print(1)\n";
    let Some((e, elapsed, _)) = command_error(source, 1.0) else {
        return;
    };
    let msg = e.to_string();
    assert!(matches!(e, RewardError::Timeout { scored: 0, .. }), "{msg}");
    assert!(
        msg.contains("rewards/judge") && msg.contains("timeout_secs = 1"),
        "{msg}"
    );
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
}

#[test]
fn a_missing_program_cannot_start() {
    let spec = RewardSpec::command(&["tunestudio-no-such-reward-program", "x.py"]);
    let e = RewardSet::start(&[spec], Path::new(".")).err().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, RewardError::Start { .. }), "{msg}");
    assert!(
        msg.contains("rewards/x") && msg.contains("tunestudio-no-such-reward-program"),
        "{msg}"
    );
    assert!(msg.contains("install the program"), "{msg}");
}

#[cfg(target_os = "linux")]
#[test]
fn dropping_the_set_ends_the_program() {
    let source = "import os, sys\nprint(os.getpid(), file=sys.stderr)\nopen('pid', 'w').write(str(os.getpid()))\nfor line in sys.stdin:\n    print(0)\n";
    let Some(dir) = script(source) else { return };
    let set = RewardSet::start(&[command_spec(20.0)], dir.path()).unwrap();
    let pid_file = dir.path().join("pid");
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid = loop {
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            if !pid.is_empty() {
                break pid;
            }
        }
        assert!(Instant::now() < deadline, "the script never started");
        std::thread::sleep(Duration::from_millis(20));
    };
    let proc_dir = Path::new("/proc").join(pid.trim());
    assert!(proc_dir.exists());
    drop(set);
    assert!(
        !proc_dir.exists(),
        "process {pid} still there after the drop"
    );
}
