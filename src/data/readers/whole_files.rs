//! Whole-file parsers: JSON arrays (or JSONL written as `.json`), CSV, Parquet and plain text,
//! each read into memory when the dataset opens.

use super::*;

/// Reads a file as UTF-8, naming the line of the first invalid byte.
pub(super) fn read_utf8(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    match String::from_utf8(bytes) {
        Ok(s) => {
            // A UTF-8 byte-order mark is not data.
            Ok(s.strip_prefix('\u{feff}').map(str::to_string).unwrap_or(s))
        }
        Err(e) => {
            let valid = e.utf8_error().valid_up_to();
            let line = e.as_bytes()[..valid]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1;
            Err(DataError::InvalidUtf8 {
                path: path.to_path_buf(),
                line,
                byte_offset: valid as u64,
            })
        }
    }
}

pub(super) fn read_json(path: &Path) -> Result<PartData, DataError> {
    let text = read_utf8(path)?;
    if text.trim().is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let value: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            // JSON lines saved as .json (common on the hub): index as JSONL.
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
            let first_ok = serde_json::from_str::<Value>(first).is_ok_and(|v| v.is_object());
            if first_ok && e.line() > 1 {
                return Ok(PartData::Jsonl(index_jsonl(path)?));
            }
            return Err(DataError::Json {
                path: path.to_path_buf(),
                line: Some(e.line()),
                message: e.to_string(),
            });
        }
    };
    let rows = match value {
        Value::Array(rows) => rows,
        Value::Object(ref o) if o.is_empty() => Vec::new(),
        Value::Object(mut o) => {
            // `{"data": [...]}` / `{"train": [...]}`: one list of objects.
            let lists: Vec<String> = o
                .iter()
                .filter(|(_, v)| v.is_array())
                .map(|(k, _)| k.clone())
                .collect();
            if lists.len() == 1 && o.len() == 1 {
                match o.remove(&lists[0]) {
                    Some(Value::Array(rows)) => rows,
                    _ => Vec::new(),
                }
            } else {
                // A single object is one row.
                vec![Value::Object(o)]
            }
        }
        other => {
            return Err(DataError::BadRow {
                location: path.display().to_string(),
                message: format!(
                    "expected a JSON array of objects (or JSON lines), found {}",
                    short(&other)
                ),
            })
        }
    };
    if rows.is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    if let Some((i, bad)) = rows.iter().enumerate().find(|(_, r)| !r.is_object()) {
        return Err(DataError::BadRow {
            location: format!("{} row {i}", path.display()),
            message: format!("each element must be a JSON object, found {}", short(bad)),
        });
    }
    Ok(PartData::Loaded(rows))
}

pub(super) fn read_csv(path: &Path) -> Result<Vec<Value>, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&bytes);
    let is_tsv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("tsv"));
    let mut rdr = csv::ReaderBuilder::new()
        .delimiter(if is_tsv { b'\t' } else { b',' })
        .flexible(false)
        .from_reader(bytes);
    let csv_err = |e: csv::Error| DataError::Csv {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let utf8 = |line: u64, field: &[u8], byte: u64| match std::str::from_utf8(field) {
        Ok(s) => Ok(s.to_string()),
        Err(e) => Err(DataError::InvalidUtf8 {
            path: path.to_path_buf(),
            line: line as usize,
            byte_offset: byte + e.valid_up_to() as u64,
        }),
    };
    let headers: Vec<String> = {
        let h = rdr.byte_headers().map_err(csv_err)?.clone();
        h.iter().map(|f| utf8(1, f, 0)).collect::<Result<_, _>>()?
    };
    let mut rows = Vec::new();
    let mut rec = csv::ByteRecord::new();
    while rdr.read_byte_record(&mut rec).map_err(csv_err)? {
        let (line, byte) = rec
            .position()
            .map(|p| (p.line(), p.byte()))
            .unwrap_or((0, 0));
        let mut obj = Map::new();
        for (h, f) in headers.iter().zip(rec.iter()) {
            obj.insert(h.clone(), Value::String(utf8(line, f, byte)?));
        }
        rows.push(Value::Object(obj));
    }
    if rows.is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    Ok(rows)
}

pub(super) fn read_parquet(path: &Path) -> Result<Vec<Value>, DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    if meta.len() == 0 {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let pq_err = |message: String| DataError::Parquet {
        path: path.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    // The record reader may panic on corrupt files; a corrupt file must be
    // an error, not a crash.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let reader = SerializedFileReader::new(file).map_err(|e| e.to_string())?;
        let n = reader.metadata().file_metadata().num_rows().max(0) as usize;
        let mut rows = Vec::with_capacity(n.min(1 << 24));
        let iter = reader.get_row_iter(None).map_err(|e| e.to_string())?;
        for row in iter {
            let row = row.map_err(|e| e.to_string())?;
            rows.push(row_to_json(&row));
        }
        Ok::<_, String>(rows)
    }));
    let rows = match result {
        Ok(r) => r.map_err(pq_err)?,
        Err(_) => return Err(pq_err("the file is corrupt (the reader failed)".into())),
    };
    if rows.is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    Ok(rows)
}

pub(super) fn row_to_json(row: &parquet::record::Row) -> Value {
    Value::Object(
        row.get_column_iter()
            .map(|(k, f)| (k.clone(), field_to_json(f)))
            .collect(),
    )
}

/// Parquet values as JSON (the record API's `to_json_value` needs the
/// `json` feature, which would pull in arrow).
pub(super) fn field_to_json(f: &parquet::record::Field) -> Value {
    use parquet::record::Field as F;
    let num = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    match f {
        F::Null => Value::Null,
        F::Bool(b) => Value::Bool(*b),
        F::Byte(x) => Value::from(*x),
        F::Short(x) => Value::from(*x),
        F::Int(x) => Value::from(*x),
        F::Long(x) => Value::from(*x),
        F::UByte(x) => Value::from(*x),
        F::UShort(x) => Value::from(*x),
        F::UInt(x) => Value::from(*x),
        F::ULong(x) => Value::from(*x),
        F::Float16(x) => num(f64::from(f32::from(*x))),
        F::Float(x) => num(f64::from(*x)),
        F::Double(x) => num(*x),
        F::Str(s) => Value::String(s.clone()),
        F::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => Value::Array(b.data().iter().map(|&x| Value::from(x)).collect()),
        },
        F::Date(d) => Value::from(*d),
        F::TimestampMillis(t) | F::TimestampMicros(t) => Value::from(*t),
        F::Decimal(_) => Value::String(f.to_string()),
        F::Group(row) => row_to_json(row),
        F::ListInternal(list) => Value::Array(list.elements().iter().map(field_to_json).collect()),
        F::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        F::Str(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (key, field_to_json(v))
                })
                .collect(),
        ),
    }
}

pub(super) fn read_txt(path: &Path, per_file: bool) -> Result<Vec<Value>, DataError> {
    let text = read_utf8(path)?;
    if text.trim().is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let doc = |s: String| {
        let mut o = Map::new();
        o.insert("text".into(), Value::String(s));
        Value::Object(o)
    };
    if per_file {
        return Ok(vec![doc(text.trim_end_matches(['\n', '\r']).to_string())]);
    }
    let mut docs = Vec::new();
    let mut cur: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                docs.push(doc(cur.join("\n")));
                cur.clear();
            }
        } else {
            cur.push(line);
        }
    }
    if !cur.is_empty() {
        docs.push(doc(cur.join("\n")));
    }
    Ok(docs)
}
