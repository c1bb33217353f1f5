//! Chat templates: the model's own Jinja template rendered with minijinja,
//! set up the way transformers sets up jinja2 (`trim_blocks=True`,
//! `lstrip_blocks=True`, `raise_exception`, `strftime_now`, a Python-style
//! `tojson`, loop controls, Python string/dict methods via pycompat) so the
//! output is byte-identical to `tokenizer.apply_chat_template(..., tokenize=False)`.

use crate::data::DataError;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State};
use serde::Serialize;

/// One chat turn as the template sees it: `role`, `content`, and any other
/// fields the row had (e.g. `tool_calls`), passed through.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text (typed content parts are joined into one string).
    pub content: String,
    /// Per-turn loss weight (LLaMA-Factory v1 `loss_weight`); `None` = the
    /// default (assistant trained, others masked). Not given to templates.
    #[serde(skip)]
    pub loss_weight: Option<f32>,
    /// Other fields of the message, passed to the template unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with just a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            loss_weight: None,
            extra: Default::default(),
        }
    }
}

/// The special-token strings templates read as variables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateTokens {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    tokens: TemplateTokens,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

const NAME: &str = "chat_template";

/// A ChatML template used when chat data meets a tokenizer without a
/// template (reported as the `ChatWithoutTemplate` lint).
pub const FALLBACK_CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str, tokens: TemplateTokens) -> Result<Self, DataError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // jinja2's default: a single trailing newline of the source is dropped.
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let source = rewrite_generation_tags(source);
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| DataError::TemplateSyntax {
                message: describe(&e),
            })?;
        Ok(ChatTemplate {
            env,
            tokens,
            source,
        })
    }

    /// The (pre-processed) template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` as `apply_chat_template(messages, tools=None,
    /// add_generation_prompt=..., tokenize=False)` does.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        let tok = |t: &Option<String>| match t {
            Some(s) => Value::from(s.as_str()),
            None => Value::from(()),
        };
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            tools => Value::from(()),
            documents => Value::from(()),
            bos_token => tok(&self.tokens.bos_token),
            eos_token => tok(&self.tokens.eos_token),
            pad_token => tok(&self.tokens.pad_token),
            unk_token => tok(&self.tokens.unk_token),
        };
        tmpl.render(ctx).map_err(|e| describe(&e))
    }
}

/// minijinja's message plus the template line, without the debug dump.
fn describe(e: &Error) -> String {
    let mut s = match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s.push_str(&format!(" (template line {line})"));
        }
    }
    s
}

/// `{% generation %}`/`{% endgeneration %}` (transformers' AssistantTracker
/// extension) become an always-true `if`, keeping whitespace control.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 2..];
        let Some(end) = after.find("%}") else {
            out.push_str(&rest[pos..]);
            return out;
        };
        let inner = &after[..end];
        let trimmed = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let lead: String = inner
            .chars()
            .take_while(|c| *c == '-' || *c == '+')
            .collect();
        let trail: String = {
            let t: Vec<char> = inner
                .chars()
                .rev()
                .take_while(|c| *c == '-' || *c == '+')
                .collect();
            t.into_iter().rev().collect()
        };
        match trimmed {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => {
                out.push_str("{%");
                out.push_str(inner);
                out.push_str("%}");
            }
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints `none`/booleans as Python does (`None`, `True`, `False`).
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(&fmt).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {fmt:?}"),
        ));
    }
    let mut s = String::new();
    use std::fmt::Write;
    write!(
        s,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {fmt:?}"),
        )
    })?;
    Ok(s)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` — Python's spacing (`", "`, `": "`),
/// no HTML escaping.
fn tojson(value: Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs
        .get::<Option<bool>>("ensure_ascii")?
        .or(ensure_ascii)
        .unwrap_or(false);
    let indent_v: Option<Value> = kwargs.get("indent")?;
    let indent = match indent_v {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().map(str::to_string).unwrap_or_default()),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                if v.to_string().contains('.') || v.to_string().contains('e') {
                    out.push_str(&python_float(f64::try_from(v.clone()).unwrap_or(i as f64)));
                } else {
                    out.push_str(&i.to_string());
                }
            } else {
                let f = f64::try_from(v.clone())
                    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: bad number"))?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), o, level, |out, i| {
                write_json(out, &items[i], o, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            let mut pairs = Vec::with_capacity(keys.len());
            for k in keys {
                let val = v.get_item(&k)?;
                pairs.push((k, val));
            }
            write_container(out, '{', '}', pairs.len(), o, level, |out, i| {
                let (k, val) = &pairs[i];
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                write_json_str(out, &key, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, val, o, level + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialise a {}", v.kind()),
            ))
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    n: usize,
    o: &JsonOpts,
    level: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(level));
    }
    out.push(close);
    Ok(())
}

/// Python's `repr(float)` for the common cases.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        let s = format!("{f}");
        if s.contains('e') || f.abs() < 1e16 {
            s
        } else {
            format!("{f:e}").replace('e', "e+")
        }
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: &[ChatMessage], gen: bool) -> Result<String, String> {
        ChatTemplate::new(
            src,
            TemplateTokens {
                bos_token: Some("<s>".into()),
                eos_token: Some("</s>".into()),
                ..Default::default()
            },
        )
        .map_err(|e| e.to_string())?
        .render(msgs, gen)
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n    {% endif %}\n{% endfor %}\n";
        let out = render(src, &[ChatMessage::new("user", " hi ")], false).unwrap();
        assert_eq!(out, "[hi]\n");
    }

    #[test]
    fn raise_exception_and_tokens() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ bos_token }}{{ messages[0].content }}{{ eos_token }}";
        let err = render(src, &[ChatMessage::new("assistant", "x")], false).unwrap_err();
        assert!(err.contains("Conversation roles must alternate"), "{err}");
        let ok = render(src, &[ChatMessage::new("user", "x")], false).unwrap();
        assert_eq!(ok, "<s>x</s>");
    }

    #[test]
    fn python_like_tojson_and_values() {
        let src = "{{ {'a': 1, 'b': [1.5, 'é<'], 'c': none} | tojson }}|{{ tools }}|{{ true }}|{{ x | tojson(indent=2) }}";
        let out = render(src, &[], false).unwrap();
        assert!(
            out.starts_with("{\"a\": 1, \"b\": [1.5, \"é<\"], \"c\": null}|None|True|"),
            "{out}"
        );
        let src2 = "{{ [1, {'k': 'v'}] | tojson(indent=2) }}";
        assert_eq!(
            render(src2, &[], false).unwrap(),
            "[\n  1,\n  {\n    \"k\": \"v\"\n  }\n]"
        );
    }

    #[test]
    fn generation_tags_and_strftime() {
        let src = "{%- for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ strftime_now('%Y') | length }}";
        let out = render(src, &[ChatMessage::new("assistant", "a")], false).unwrap();
        assert_eq!(out, "a4");
        assert!(render("{{ strftime_now('%Q') }}", &[], false).is_err());
    }

    #[test]
    fn loop_controls_and_namespace() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.first %}F{% endif %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}";
        let msgs = [
            ChatMessage::new("user", "a"),
            ChatMessage::new("skip", "b"),
            ChatMessage::new("user", "c"),
        ];
        assert_eq!(render(src, &msgs, false).unwrap(), "F2");
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = ChatTemplate::new("{% for %}", TemplateTokens::default()).unwrap_err();
        assert!(err.to_string().contains("does not compile"));
    }
}
