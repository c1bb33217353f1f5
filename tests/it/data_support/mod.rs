//! Shared helpers for the data tests: fixture paths and a tiny Parquet writer.
#![allow(dead_code)]

use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tunestudio::data::TokenizerBundle;
use tunestudio::paths::shared_dir;

/// The tiny-llama model folder (SmolLM2 tokenizer, ChatML template).
pub fn tiny_llama_dir() -> PathBuf {
    shared_dir().join("fixtures").join("tiny-llama")
}

/// Its tokenizer bundle.
pub fn tiny_llama() -> TokenizerBundle {
    TokenizerBundle::load(&tiny_llama_dir()).expect("tiny-llama tokenizer")
}

/// A file of /work/shared/datasets.
pub fn dataset(name: &str) -> String {
    shared_dir()
        .join("datasets")
        .join(name)
        .display()
        .to_string()
}

/// A column for [`write_parquet`].
pub enum Col<'a> {
    /// `list<int64>` (the 3-level LIST layout pyarrow writes).
    IntLists(&'a str, Vec<Vec<i64>>),
    /// UTF-8 strings.
    Strings(&'a str, Vec<String>),
}

/// Writes one row group with the given columns.
pub fn write_parquet(path: &Path, cols: &[Col<'_>]) {
    let mut fields = String::new();
    for c in cols {
        match c {
            Col::IntLists(name, _) => fields.push_str(&format!(
                "REQUIRED group {name} (LIST) {{ REPEATED group list {{ REQUIRED INT64 element; }} }}\n"
            )),
            Col::Strings(name, _) => {
                fields.push_str(&format!("REQUIRED BYTE_ARRAY {name} (UTF8);\n"))
            }
        }
    }
    let schema = Arc::new(parse_message_type(&format!("message schema {{ {fields} }}")).unwrap());
    let file = std::fs::File::create(path).unwrap();
    let props = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut rg = writer.next_row_group().unwrap();
    let mut i = 0;
    while let Some(mut col) = rg.next_column().unwrap() {
        match &cols[i] {
            Col::IntLists(_, rows) => {
                let mut values = Vec::new();
                let mut def = Vec::new();
                let mut rep = Vec::new();
                for r in rows {
                    if r.is_empty() {
                        def.push(0);
                        rep.push(0);
                    }
                    for (j, &v) in r.iter().enumerate() {
                        values.push(v);
                        def.push(1);
                        rep.push(if j == 0 { 0 } else { 1 });
                    }
                }
                col.typed::<Int64Type>()
                    .write_batch(&values, Some(&def), Some(&rep))
                    .unwrap();
            }
            Col::Strings(_, rows) => {
                let values: Vec<ByteArray> =
                    rows.iter().map(|s| ByteArray::from(s.as_str())).collect();
                col.typed::<ByteArrayType>()
                    .write_batch(&values, None, None)
                    .unwrap();
            }
        }
        col.close().unwrap();
        i += 1;
    }
    rg.close().unwrap();
    writer.close().unwrap();
}
