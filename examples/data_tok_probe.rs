//! Scratch probe: where tokenisation time goes (temporary).
use std::time::Instant;
use tunestudio::data::*;
use tunestudio::paths::shared_dir;
fn cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}
fn main() -> anyhow::Result<()> {
    let tok = TokenizerBundle::load(&shared_dir().join("fixtures/tiny-llama"))?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(shared_dir().join("datasets/alpaca_en_demo.json"))?)?;
    let tmpl = ChatTemplate::new(tok.chat_template.as_deref().unwrap(), TemplateTokens::default())?;
    let exs: Vec<Example> = rows.iter().map(|r| to_example(r, Format::Alpaca, &ColumnMapping::default(), &|| String::new()).unwrap()).collect();
    for _ in 0..3 {
        let (t, c) = (Instant::now(), cpu());
        let mut texts = Vec::new();
        for e in &exs { if let Example::Chat { messages } = e { texts.push(tmpl.render(messages, false).unwrap()); tmpl.render(&messages[..1], true).unwrap(); } }
        println!("render x2: {:.3}s wall {:.3}s cpu", t.elapsed().as_secs_f64(), cpu() - c);
        let (t, c) = (Instant::now(), cpu());
        let n: usize = texts.iter().map(|t| tok.encode(t, false).unwrap().len()).sum();
        println!("encode full serial: {:.3}s wall {:.3}s cpu {n} tokens", t.elapsed().as_secs_f64(), cpu() - c);
        let ctx = LabelContext { tok: &tok, template: Some(&tmpl), completions_only: true, max_length: 4096, keep_text: false };
        let (t, c) = (Instant::now(), cpu());
        for (i, e) in exs.iter().enumerate() { label_example(i, e, &ctx, &|| String::new()).unwrap(); }
        println!("label serial: {:.3}s wall {:.3}s cpu", t.elapsed().as_secs_f64(), cpu() - c);
    }
    Ok(())
}
