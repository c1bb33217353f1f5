use super::*;
use serde_json::json;

fn det(v: Value) -> Option<Format> {
    detect_format(&v, &ColumnMapping::default())
}

#[test]
fn detection() {
    assert_eq!(det(json!({"text": "a"})), Some(Format::Text));
    assert_eq!(det(json!({"Prompt": "a", "n": 3})), Some(Format::Text));
    assert_eq!(
        det(json!({"instruction": "a", "input": "", "output": "b"})),
        Some(Format::Alpaca)
    );
    assert_eq!(
        det(json!({"prompt": "a", "completion": "b"})),
        Some(Format::PromptCompletion)
    );
    assert_eq!(
        det(json!({"messages": [{"role": "user", "content": "x"}]})),
        Some(Format::Chat)
    );
    assert_eq!(
        det(json!({"conversations": [{"from": "human", "value": "x"}]})),
        Some(Format::ShareGpt)
    );
    assert_eq!(
        det(
            json!({"messages": [{"role": "user", "content": [{"type": "text", "value": "x"}], "loss_weight": 0.0}]})
        ),
        Some(Format::LlamaFactoryV1)
    );
    assert_eq!(
        det(json!({"input_ids": [1, 2]})),
        Some(Format::Pretokenized)
    );
    assert_eq!(det(json!({"a": 1, "b": 2})), None);
    let cols = ColumnMapping {
        prompt: Some("q".into()),
        completion: Some("a".into()),
        ..Default::default()
    };
    assert_eq!(
        detect_format(&json!({"q": "x", "a": "y"}), &cols),
        Some(Format::PromptCompletion)
    );
}

#[test]
fn alpaca_to_chat() {
    let row = json!({"instruction": "Do", "input": "this", "output": "ok", "system": "S", "history": [["h1", "a1"]]});
    let ex = to_example(&row, Format::Alpaca, &ColumnMapping::default(), &|| {
        "r".into()
    })
    .unwrap();
    let Example::Chat { messages } = ex else {
        panic!()
    };
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
    assert_eq!(messages[3].content, "Do\nthis");
}

#[test]
fn missing_column_lists_columns() {
    let cols = ColumnMapping {
        prompt: Some("question".into()),
        completion: Some("answer".into()),
        ..Default::default()
    };
    let row = json!({"q": "x", "a": "y"});
    let err = to_example(&row, Format::PromptCompletion, &cols, &|| {
        "f.csv row 0".into()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("\"question\"") && err.contains("q, a") || err.contains("a, q"),
        "{err}"
    );
}
