//! A GRPO user's prompt sets, read with the tiny-llama fixture's tokenizer: TRL's prompts are
//! the ids TRL's own `GRPOTrainer` sampled from (`fixtures/tiny-llama-grpo`).

use super::*;
use crate::data::lints::{LintKind, Severity};
use serde_json::json;

fn fixture(name: &str) -> std::path::PathBuf {
    let dir = crate::paths::shared_dir().join("fixtures").join(name);
    assert!(
        dir.is_dir(),
        "{} is missing: set TUNESTUDIO_SHARED to the shared fixtures folder",
        dir.display()
    );
    dir
}

fn tok() -> TokenizerBundle {
    TokenizerBundle::load(&fixture("tiny-llama")).unwrap()
}

/// `prompts` of `tiny-llama-grpo/reference.json`: messages, answer, rendered text, ids.
fn reference_prompts() -> Vec<Value> {
    let path = fixture("tiny-llama-grpo").join("reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["prompts"].as_array().unwrap().clone()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

fn settings(max_prompt_length: Option<usize>) -> PromptSettings {
    PromptSettings {
        max_prompt_length,
        columns: ColumnMapping::default(),
    }
}

fn read(rows: &[Value], max_prompt_length: Option<usize>) -> PromptSet {
    prompt_rows_from_values(rows, &tok(), &settings(max_prompt_length)).unwrap()
}

fn read_err(rows: &[Value]) -> String {
    prompt_rows_from_values(rows, &tok(), &settings(None))
        .unwrap_err()
        .to_string()
}

fn lint_of(set: &PromptSet, kind: LintKind) -> Option<&Lint> {
    set.lints.iter().find(|l| l.kind == kind)
}

/// The fixture template's default system turn, which it adds before a first user turn.
const DEFAULT_SYSTEM: &str =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn chat_prompt(user: &str) -> String {
    format!("{DEFAULT_SYSTEM}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

#[test]
fn trl_conversational_prompts_are_the_ids_trl_sampled_from() {
    let reference = reference_prompts();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = reference
        .iter()
        .map(|p| json!({"prompt": p["messages"], "answer": p["answer"]}).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let set = read_prompts(path.to_str().unwrap(), &tok(), &settings(Some(512))).unwrap();
    assert_eq!(set.format, PromptFormat::PromptMessages);
    assert!(!set.template_is_fallback);
    assert_eq!(set.lints, Vec::new());
    assert_eq!(set.rows.len(), 2);
    for (row, want) in set.rows.iter().zip(&reference) {
        assert_eq!(
            row.prompt_ids,
            ids(&want["prompt_ids"]),
            "row {}",
            row.index
        );
        assert_eq!(row.prompt_text, want["rendered"].as_str().unwrap());
        assert_eq!(row.columns["answer"], want["answer"]);
        assert!(row.is_chat);
        assert_eq!(row.cut_tokens, 0);
    }
    assert_eq!(set.rows[0].len(), 38);
    assert_eq!(set.rows[1].index, 1);
    // A CSV cell holds the messages as JSON text: the same prompt.
    let cell = reference[0]["messages"].to_string();
    let set = read(&[json!({"prompt": cell, "answer": "12"})], None);
    assert_eq!(set.rows[0].prompt_ids, ids(&reference[0]["prompt_ids"]));
}

#[test]
fn trl_text_prompts_are_tokenised_as_they_are() {
    let tok = tok();
    let set = read(
        &[json!({"prompt": "Q: What is 7 + 5?\nA:", "answer": "12"})],
        None,
    );
    assert_eq!(set.format, PromptFormat::PromptText);
    let row = &set.rows[0];
    assert!(!row.is_chat);
    assert_eq!(row.prompt_text, "Q: What is 7 + 5?\nA:");
    assert_eq!(
        row.prompt_ids,
        tok.encode("Q: What is 7 + 5?\nA:", true).unwrap()
    );
    assert!(!row.prompt_text.contains("<|im_start|>"));
    // Text that merely looks like JSON stays text.
    let set = read(&[json!({"prompt": "[1, 2, 3]", "answer": "6"})], None);
    assert_eq!(set.format, PromptFormat::PromptText);
    assert_eq!(set.rows[0].prompt_text, "[1, 2, 3]");
}

#[test]
fn llamafactory_instruction_and_input_are_one_user_turn() {
    let set = read(
        &[
            json!({"instruction": "Add the numbers.", "input": "7 + 5", "output": "12"}),
            json!({"instruction": "What is 12 + 9?", "input": "", "output": "21"}),
            json!({"instruction": "What is 2 + 2?", "system": "Answer with a number.", "output": "4"}),
        ],
        None,
    );
    let tok = tok();
    assert_eq!(set.format, PromptFormat::Instruction);
    let want = chat_prompt("Add the numbers.\n7 + 5");
    assert_eq!(set.rows[0].prompt_text, want);
    assert_eq!(set.rows[0].prompt_ids, tok.encode(&want, false).unwrap());
    assert_eq!(set.rows[1].prompt_text, chat_prompt("What is 12 + 9?"));
    // The system column replaces the template's default system turn.
    assert_eq!(
        set.rows[2].prompt_text,
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(set.rows[0].columns["output"], "12");
}

#[test]
fn gsm8k_questions_are_user_turns_and_keep_their_answers() {
    let reference = reference_prompts();
    let set = read(
        &[
            json!({"question": "What is 7 + 5?", "answer": "7 + 5 = 12\n#### 12"}),
            json!({"problem": "What is 12 + 9?", "solution": "\\boxed{21}"}),
        ],
        None,
    );
    assert_eq!(set.format, PromptFormat::Question);
    for (row, want) in set.rows.iter().zip(&reference) {
        assert_eq!(row.prompt_ids, ids(&want["prompt_ids"]));
    }
    assert_eq!(set.rows[0].columns["answer"], "7 + 5 = 12\n#### 12");
    assert_eq!(set.rows[1].columns["solution"], "\\boxed{21}");
}

#[test]
fn messages_drop_the_trailing_reference_answer() {
    let reference = reference_prompts();
    let set = read(
        &[
            json!({"messages": [
                {"role": "user", "content": "What is 7 + 5?"},
                {"role": "assistant", "content": "The answer is 12."}
            ]}),
            json!({"conversations": [{"from": "human", "value": "What is 12 + 9?"}]}),
        ],
        None,
    );
    assert_eq!(set.format, PromptFormat::Messages);
    assert_eq!(set.rows[0].prompt_ids, ids(&reference[0]["prompt_ids"]));
    assert!(!set.rows[0].prompt_text.contains("The answer is"));
    assert_eq!(set.rows[1].prompt_ids, ids(&reference[1]["prompt_ids"]));
    let err = read_err(&[json!({"messages": [{"role": "assistant", "content": "12"}]})]);
    assert!(
        err.contains("row 0") && err.contains("no turn before the answer"),
        "{err}"
    );
}

#[test]
fn truncation_keeps_the_end_and_counts_the_cut() {
    let reference = reference_prompts();
    let rows: Vec<Value> = reference
        .iter()
        .map(|p| json!({"prompt": p["messages"], "answer": p["answer"]}))
        .collect();
    // 38 and 39 tokens: at 38 only the second is cut, by one token from its start.
    let set = read(&rows, Some(38));
    assert_eq!(set.rows[0].cut_tokens, 0);
    assert_eq!(
        set.rows[0].prompt_text,
        reference[0]["rendered"].as_str().unwrap()
    );
    let full = ids(&reference[1]["prompt_ids"]);
    assert_eq!(set.rows[1].prompt_ids, full[1..]);
    assert_eq!((set.rows[1].len(), set.rows[1].cut_tokens), (38, 1));
    let lint = lint_of(&set, LintKind::GrpoPromptTruncated).unwrap();
    assert_eq!(
        (lint.severity, lint.count, lint.examples.clone()),
        (Severity::Warning, 1, vec![1])
    );
    assert!(
        lint.message.contains("row 1")
            && lint.message.contains("longest has 39 tokens")
            && lint.message.contains("Raise `grpo.max_prompt_length`"),
        "{}",
        lint.message
    );
    // At 10 the end is kept: the question and the assistant header.
    let set = read(&rows, Some(10));
    let tok = tok();
    for (row, want) in set.rows.iter().zip(&reference) {
        let full = ids(&want["prompt_ids"]);
        assert_eq!(row.prompt_ids, full[full.len() - 10..]);
        assert_eq!(row.cut_tokens, full.len() - 10);
        assert_eq!(row.prompt_text, tok.decode(&row.prompt_ids));
        assert!(row.prompt_text.ends_with("<|im_start|>assistant\n"));
    }
    assert_eq!(
        lint_of(&set, LintKind::GrpoPromptTruncated).unwrap().count,
        2
    );
    assert!(lint_of(&read(&rows, None), LintKind::GrpoPromptTruncated).is_none());
}

#[test]
fn duplicate_prompts_are_named_by_row_pairs() {
    let q = |s: &str| json!({"question": s, "answer": "1"});
    let set = read(
        &[q("a?"), q("b?"), q("a?"), q("b?"), q("a?"), q("c?")],
        None,
    );
    let lint = lint_of(&set, LintKind::GrpoDuplicatePrompt).unwrap();
    assert_eq!(
        (lint.severity, lint.count, lint.examples.clone()),
        (Severity::Warning, 3, vec![2, 3, 4])
    );
    assert!(
        lint.message
            .contains("row 2 repeats row 0, row 3 repeats row 1, row 4 repeats row 0"),
        "{}",
        lint.message
    );
    // The same question with another system prompt is another prompt.
    let other = json!({"question": "a?", "system": "Be brief.", "answer": "1"});
    let set = read(&[q("a?"), q("b?"), other], None);
    assert!(lint_of(&set, LintKind::GrpoDuplicatePrompt).is_none());
}

#[test]
fn empty_prompts_are_errors() {
    let set = read(
        &[
            json!({"prompt": "", "answer": "1"}),
            json!({"prompt": "  \n", "answer": "1"}),
            json!({"prompt": "What is 1 + 1?", "answer": "2"}),
        ],
        None,
    );
    assert!(set.rows[0].is_empty());
    let lint = lint_of(&set, LintKind::GrpoEmptyPrompt).unwrap();
    assert_eq!(
        (lint.severity, lint.count, lint.examples.clone()),
        (Severity::Error, 2, vec![0, 1])
    );
    assert!(lint.message.contains("row 0, row 1"), "{}", lint.message);
    assert_eq!(set.lints[0].kind, LintKind::GrpoEmptyPrompt, "errors first");
    // A chat prompt renders to tokens even when the question is blank: still empty.
    let set = read(&[json!({"question": " ", "answer": "1"})], None);
    assert!(!set.rows[0].is_empty());
    assert_eq!(lint_of(&set, LintKind::GrpoEmptyPrompt).unwrap().count, 1);
    let set = read(
        &[json!({"question": "What is 1 + 1?", "answer": "2"})],
        None,
    );
    assert!(lint_of(&set, LintKind::GrpoEmptyPrompt).is_none());
}

#[test]
fn an_accuracy_reward_without_its_column_is_an_error_with_the_fix() {
    let set = read(
        &[
            json!({"question": "What is 7 + 5?", "solution": "12"}),
            json!({"question": "What is 12 + 9?", "solution": "21"}),
        ],
        None,
    );
    let lint = answer_column_lint(&set.rows, "answer", "accuracy").unwrap();
    assert_eq!(lint.kind, LintKind::GrpoMissingAnswerColumn);
    assert_eq!(lint.kind.id(), "grpo-missing-answer-column");
    assert_eq!(
        (lint.severity, lint.count, lint.examples.clone()),
        (Severity::Error, 2, vec![0, 1])
    );
    for part in [
        "accuracy reward `accuracy`",
        "column `answer`",
        "row 0",
        "question, solution",
        "set column = \"solution\" in the reward's [[grpo.reward]] entry",
    ] {
        assert!(lint.message.contains(part), "{part:?} in {}", lint.message);
    }
    assert!(answer_column_lint(&set.rows, "solution", "accuracy").is_none());
    // One row without it (null counts as missing): that row is named.
    let set = read(
        &[
            json!({"question": "a?", "answer": "1"}),
            json!({"question": "b?", "answer": null}),
        ],
        None,
    );
    let lint = answer_column_lint(&set.rows, "answer", "math").unwrap();
    assert_eq!((lint.count, lint.examples.clone()), (1, vec![1]));
    assert!(lint.message.contains("1 of 2 rows") && lint.message.contains("row 1"));
    assert!(
        lint.message.contains("column = \"...\""),
        "{}",
        lint.message
    );
}

#[test]
fn an_unknown_format_names_the_row_its_columns_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sft.jsonl");
    std::fs::write(&path, "\n{\"text\": \"hello\", \"label\": 1}\n").unwrap();
    let err = read_prompts(path.to_str().unwrap(), &tok(), &settings(None))
        .unwrap_err()
        .to_string();
    for part in [
        "sft.jsonl line 2",
        "[label, text]",
        "`prompt` column (text or messages), `messages`, `instruction` or `question`",
    ] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    // A mapped column that is not there is named with its setting.
    let mapped = PromptSettings {
        max_prompt_length: None,
        columns: ColumnMapping {
            prompt: Some("query".into()),
            ..ColumnMapping::default()
        },
    };
    let err = prompt_rows_from_values(&[json!({"prompt": "x"})], &tok(), &mapped)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"query\"") && err.contains("data.columns.prompt"),
        "{err}"
    );
    let set =
        prompt_rows_from_values(&[json!({"query": "x", "answer": "1"})], &tok(), &mapped).unwrap();
    assert_eq!(set.format, PromptFormat::PromptText);
}

#[test]
fn a_row_unlike_the_first_is_named() {
    let err = read_err(&[
        json!({"prompt": [{"role": "user", "content": "a?"}]}),
        json!({"prompt": "b?"}),
    ]);
    assert!(
        err.starts_with("row 1:") && err.contains("list of messages"),
        "{err}"
    );
    let err = read_err(&[json!({"question": "a?"}), json!({"query": "b?"})]);
    assert!(err.starts_with("row 1:") && err.contains("query"), "{err}");
}

#[test]
fn a_tokenizer_without_a_template_renders_chat_prompts_with_chatml() {
    let mut tok = tok();
    tok.chat_template = None;
    let rows = [json!({"question": "What is 7 + 5?", "answer": "12"})];
    let set = prompt_rows_from_values(&rows, &tok, &settings(None)).unwrap();
    assert!(set.template_is_fallback);
    assert_eq!(
        set.rows[0].prompt_text,
        "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(lint_of(&set, LintKind::ChatWithoutTemplate).is_some());
    let text = [json!({"prompt": "What is 7 + 5?", "answer": "12"})];
    let set = prompt_rows_from_values(&text, &tok, &settings(None)).unwrap();
    assert!(set.lints.is_empty());
}

#[test]
fn lint_ids_are_the_names_users_allow() {
    for (kind, id) in [
        (LintKind::GrpoPromptTruncated, "grpo-prompt-truncated"),
        (LintKind::GrpoDuplicatePrompt, "grpo-duplicate-prompt"),
        (
            LintKind::GrpoMissingAnswerColumn,
            "grpo-missing-answer-column",
        ),
        (LintKind::GrpoEmptyPrompt, "grpo-empty-prompt"),
    ] {
        assert_eq!(kind.id(), id);
        assert_eq!(LintKind::from_id(id), Some(kind));
    }
}
