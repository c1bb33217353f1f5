//! Model text shown as it reads: the bytes behind byte-level BPE tokens, tokens grouped into
//! the characters they form, and `tunestudio preview` printing those characters instead of
//! bare ids.
use crate::support::fixture;

use std::path::{Path, PathBuf};
use std::process::Command;
use tunestudio::data::TokenizerBundle;
use tunestudio::text::group_tokens;

/// SmolLM2's tokenizer, bundled with the demo.
fn demo_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo-model")
}

const MIXED: &str = "שלום עולם! 你好，世界。 مرحبا Hello 👋 (42)";

#[test]
fn token_bytes_add_up_to_the_text_and_groups_to_its_characters() {
    for dir in [demo_model(), fixture("tiny-qwen2")] {
        let tok = TokenizerBundle::load(&dir).unwrap();
        let ids = tok.encode(MIXED, false).unwrap();
        let bytes = tok.token_bytes(&ids);
        assert_eq!(bytes.concat(), MIXED.as_bytes(), "{}", dir.display());
        let groups = group_tokens(&bytes);
        let text: String = groups.iter().map(|g| g.text.as_str()).collect();
        assert_eq!(text, MIXED);
        assert!(
            groups.iter().any(|g| g.is_split()),
            "no character split between tokens: the test proves nothing"
        );
        // Every group is whole characters: none shows an escaped byte.
        assert!(groups.iter().all(|g| !g.text.contains("\\x")), "{groups:?}");
    }
}

#[test]
fn special_tokens_are_their_text() {
    let tok = TokenizerBundle::load(&demo_model()).unwrap();
    let id = tok.token_to_id("<|im_end|>").expect("ChatML end token");
    assert_eq!(tok.token_bytes(&[id]), vec![b"<|im_end|>".to_vec()]);
}

/// A token printed with no text before its `(label, id)`: ` (` or a line start followed by
/// the label, on a line of tokens (the line after a `── row` header).
fn has_bare_id(out: &str) -> bool {
    let lines: Vec<&str> = out.lines().collect();
    let token_lines = lines
        .windows(2)
        .filter(|w| w[0].starts_with("── row"))
        .map(|w| w[1]);
    token_lines.into_iter().any(|l| {
        l.match_indices('(').any(|(i, _)| {
            let before = l[..i].chars().next_back();
            let after = l[i + 1..].chars().next();
            before.is_none_or(|c| c == ' ') && after.is_some_and(|c| c == '-' || c.is_ascii_digit())
        })
    })
}

#[test]
fn cli_preview_prints_characters_not_ids() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alpaca_he.json");
    let zh = tunestudio::paths::shared_dir().join("datasets/alpaca_zh_demo.json");
    for (path, word) in [(data, "ש"), (zh, "识")] {
        let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["preview", "--no-color", "--quick", "--rows", "1", "--model"])
            .arg(demo_model())
            .arg("--data")
            .arg(&path)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !has_bare_id(&stdout),
            "a token shown as a bare id:\n{stdout}"
        );
        // A split character is printed once, with each of its tokens: `כ(-100, 162 · -100, 245)`.
        assert!(stdout.contains(" · "), "no split character:\n{stdout}");
        assert!(stdout.contains(word), "{stdout}");
    }
    assert!(has_bare_id("── row 0\na(1, 2) (-100, 7)"));
    assert!(!has_bare_id(
        "── row 0\na(1, 2) ((-100, 7)\ntrained 34 (38.6%)"
    ));
}
