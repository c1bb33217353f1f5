//! The Ollama `Modelfile` written beside a GGUF file, so `ollama create NAME -f Modelfile`
//! works in one line: `FROM` the file, the stop tokens (a model that never stops is the most
//! common complaint after an export), the chat template in Ollama's Go-template syntax for
//! the families it is known for, and the run's system prompt.

/// What the Modelfile says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelfileSpec {
    /// The GGUF file's name (relative: the Modelfile sits beside it).
    pub gguf_file: String,
    /// End-of-turn token texts.
    pub stop_tokens: Vec<String>,
    /// The model's Jinja chat template, if any.
    pub chat_template: Option<String>,
    /// The system prompt the run trained with, if any.
    pub system_prompt: Option<String>,
}

/// ChatML (`<|im_start|>role … <|im_end|>`: SmolLM, Qwen2) in Ollama's template syntax.
const CHATML: &str = "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n";
/// Llama 3's header-id format.
const LLAMA3: &str = "{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n";
/// Mistral's `[INST]` format.
const MISTRAL: &str = "{{- range $i, $m := .Messages }}{{- if eq $m.Role \"user\" }}[INST] {{ if and $.System (eq $i 0) }}{{ $.System }}\n\n{{ end }}{{ $m.Content }} [/INST]{{- else if eq $m.Role \"assistant\" }} {{ $m.Content }}</s>{{- end }}{{- end }}";

fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The Modelfile's text.
pub fn modelfile_text(spec: &ModelfileSpec) -> String {
    let mut out = String::new();
    out.push_str("# Written by tunestudio. Create the model with:\n");
    out.push_str("#   ollama create my-model -f Modelfile\n");
    out.push_str(&format!("FROM ./{}\n", spec.gguf_file));
    let template = spec.chat_template.as_deref().and_then(|t| {
        if t.contains("<|im_start|>") {
            Some(CHATML)
        } else if t.contains("<|start_header_id|>") {
            Some(LLAMA3)
        } else if t.contains("[INST]") {
            Some(MISTRAL)
        } else {
            None
        }
    });
    match template {
        Some(t) => out.push_str(&format!("TEMPLATE \"\"\"{t}\"\"\"\n")),
        None if spec.chat_template.is_some() => out.push_str(
            "# The chat template is in the GGUF file (tokenizer.chat_template); Ollama reads it from there.\n",
        ),
        None => {}
    }
    if let Some(system) = spec
        .system_prompt
        .as_deref()
        .filter(|s| !s.trim().is_empty())
    {
        out.push_str(&format!(
            "SYSTEM \"\"\"{}\"\"\"\n",
            system.replace("\"\"\"", "\" \" \"")
        ));
    }
    for stop in &spec.stop_tokens {
        out.push_str(&format!("PARAMETER stop {}\n", quoted(stop)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chatml_model_gets_its_template_and_stop_token() {
        let text = modelfile_text(&ModelfileSpec {
            gguf_file: "m-q4_k_m.gguf".into(),
            stop_tokens: vec!["<|im_end|>".into()],
            chat_template: Some("{{ '<|im_start|>' + message['role'] }}".into()),
            system_prompt: Some("Answer in Hebrew.".into()),
        });
        assert!(text.contains("FROM ./m-q4_k_m.gguf\n"), "{text}");
        assert!(text.contains("PARAMETER stop \"<|im_end|>\""), "{text}");
        assert!(
            text.contains("TEMPLATE \"\"\"{{- if .System }}<|im_start|>system"),
            "{text}"
        );
        assert!(
            text.contains("SYSTEM \"\"\"Answer in Hebrew.\"\"\""),
            "{text}"
        );
    }
}
