//! `tunestudio preview` on preference data: the binary shows each pair's prompt, chosen and
//! rejected tokens with their label classes, lengths and truncation, and the pair lints stop
//! it (exit 2) like the SFT lints unless allowed by name.

use crate::data_support::{dataset, tiny_llama, tiny_llama_dir};
use std::path::Path;
use std::process::{Command, Output};
use tunestudio::data::preference::{PairLimits, PreferencePipeline};
use tunestudio::data::{ColumnMapping, Dataset, TxtSplit};

fn preview(data: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["preview", "--no-color", "--model"])
        .arg(tiny_llama_dir())
        .arg("--data")
        .arg(data)
        .args(extra)
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The part of `s` from `start` up to `end` (or its end).
fn section<'a>(s: &'a str, start: &str, end: &str) -> &'a str {
    let from = s
        .find(start)
        .unwrap_or_else(|| panic!("no {start:?} in\n{s}"));
    let rest = &s[from..];
    rest.find(end).map_or(rest, |e| &rest[..e])
}

#[test]
fn demo_pairs_show_prompt_chosen_rejected_tokens_and_truncation() {
    let data = dataset("dpo_en_demo.json");
    let out = preview(
        Path::new(&data),
        &[
            "--rows",
            "1",
            // Stats and lints of the shown pair only: cut to 8 tokens, some other pairs'
            // answers are identical (an error, checked below).
            "--quick",
            "--max-prompt-length",
            "10",
            "--max-completion-length",
            "8",
        ],
    );
    let (stdout, stderr) = text(&out);
    // Only warnings (truncation): exit 0.
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("format: sharegpt_ranking (preference pairs)  pairs: 300"),
        "{stdout}"
    );
    assert!(
        stdout.contains("max_prompt_length 10") && stdout.contains("max_completion_length 8"),
        "{stdout}"
    );

    // The library's pair for row 0 with the same limits: the lengths shown are its lengths.
    let tok = tiny_llama();
    let ds = Dataset::open(&data, TxtSplit::Auto).unwrap();
    let limits = PairLimits {
        max_prompt_length: Some(10),
        max_completion_length: Some(8),
    };
    let pipe =
        PreferencePipeline::for_dataset(&tok, &ds, None, ColumnMapping::default(), limits).unwrap();
    let pair = pipe
        .pair(0, &ds.row(0).unwrap(), &|| ds.location(0))
        .unwrap();
    assert!(pair.prompt_cut() > 0 && pair.chosen.cut() > 0 && pair.rejected.cut() > 0);
    assert!(
        stdout.contains("── pair 0 · ")
            && stdout.contains("prompt 10 · chosen 8 · rejected 8 tokens"),
        "{stdout}"
    );

    // Prompt: masked, cut from its start.
    let prompt = section(&stdout, "prompt · ", "\nchosen · ");
    assert!(
        prompt.starts_with(&format!(
            "prompt · 10 tokens, masked · truncation cut {} from the start (of {})",
            pair.prompt_cut(),
            pair.prompt_full_len
        )),
        "{prompt}"
    );
    assert!(
        prompt.contains("(-100, ") && !prompt.contains("(198, 198)"),
        "{prompt}"
    );
    // Chosen: trained (label = id), cut from its end.
    let chosen = section(&stdout, "\nchosen · ", "\nrejected · ");
    assert!(
        chosen.contains(&format!(
            "chosen · 8 tokens, 8 trained · truncation cut {} from the end (of {})",
            pair.chosen.cut(),
            pair.chosen.full_len
        )),
        "{chosen}"
    );
    assert!(
        chosen.contains("That(5195, 5195)") && chosen.contains(" sounds(4598, 4598)"),
        "{chosen}"
    );
    assert!(!chosen.contains("(-100, "), "{chosen}");
    // Rejected: its own tokens, trained, cut from its end.
    let rejected = section(&stdout, "\nrejected · ", "\n── stats");
    assert!(
        rejected.contains(&format!(
            "rejected · 8 tokens, 8 trained · truncation cut {} from the end (of {})",
            pair.rejected.cut(),
            pair.rejected.full_len
        )),
        "{rejected}"
    );
    assert!(rejected.contains("Hello(19556, 19556)"), "{rejected}");
    assert!(!rejected.contains("That(5195"), "{rejected}");

    // Stats and the truncation warnings of the shown pair.
    assert!(
        stdout.contains("(shown pairs only (--quick))")
            && stdout.contains("pairs 1  prompt mean 10.0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("WARN  PairCompletionTruncated")
            && stdout.contains("WARN  PairPromptTruncated"),
        "{stdout}"
    );

    // Over all 300 pairs, cut to 8 tokens, some pairs' answers start alike: an error.
    let out = preview(
        Path::new(&data),
        &["--rows", "0", "--max-completion-length", "8"],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stdout.contains("ERROR PairIdentical"), "{stdout}");

    // --json at the default lengths (512 + 512): the same pair as data, no error.
    let out = preview(Path::new(&data), &["--rows", "1", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &v["pairs"][0];
    assert_eq!(p["chosen"]["tokens"][0]["id"], 5195);
    assert_eq!(p["chosen"]["tokens"][0]["class"], "trained");
    assert_eq!(p["prompt"]["tokens"][0]["class"], "masked");
    assert_eq!(p["rejected"]["tokens"][0]["id"], 19556);
    assert_eq!(v["format"], "sharegpt_ranking");
}

#[test]
fn identical_pair_exits_2_unless_allowed_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.jsonl");
    let rows = [
        serde_json::json!({"prompt": [{"role": "user", "content": "Is the sky blue?"}],
            "chosen": [{"role": "assistant", "content": "Yes, on a clear day."}],
            "rejected": [{"role": "assistant", "content": "No, it is green."}]}),
        serde_json::json!({"prompt": [{"role": "user", "content": "שלום, מה שלומך?"}],
            "chosen": [{"role": "assistant", "content": "טוב, תודה."}],
            "rejected": [{"role": "assistant", "content": "טוב, תודה."}]}),
    ];
    let text_rows: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&path, text_rows.join("\n") + "\n").unwrap();

    let out = preview(&path, &["--rows", "2"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("format: trl (preference pairs)"),
        "{stdout}"
    );
    assert!(stdout.contains("ERROR PairIdentical"), "{stdout}");
    assert!(stdout.contains("(rows 1)"), "{stdout}");
    // Both pairs are shown; the identical one with the same tokens on both sides.
    let second = section(&stdout, "── pair 1 · ", "── stats");
    let chosen = section(second, "chosen · ", "\nrejected · ");
    let rejected = section(second, "rejected · ", "\n\n");
    let tokens = |s: &str| s.lines().nth(1).unwrap_or_default().to_string();
    assert!(!tokens(chosen).is_empty(), "{second}");
    assert_eq!(tokens(chosen), tokens(rejected), "{second}");

    let out = preview(&path, &["--allow-lint", "pair-identical"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("ERROR PairIdentical") && stdout.contains("(allowed: pair-identical)"),
        "{stdout}"
    );

    // Allowing another lint does not help; a name that is no lint is a usage error.
    let out = preview(&path, &["--allow-lint", "labels-mismatch"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).0);
    let out = preview(&path, &["--allow-lint", "pair-identicall"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("pair-identicall"), "{stderr}");
}
