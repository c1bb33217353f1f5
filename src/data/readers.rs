//! Dataset readers: JSON arrays, JSONL, CSV, Parquet and plain text; single
//! files, folders, and hub datasets (through the HF cache).
//!
//! Rows are `serde_json::Value` objects. JSONL files are *indexed*, not
//! loaded: opening scans the file once with a buffered reader, keeping each
//! non-blank line's byte offset and line number (and checking UTF-8), and
//! [`Dataset::row`] reads just that line. JSON arrays, CSV, Parquet and text
//! files are parsed whole when opened (their rows are kept in memory): these
//! formats do not allow cheap random access without a full parse.

use crate::data::config::TxtSplit;
use crate::data::hub::{self, RepoKind};
use crate::data::DataError;
use rayon::prelude::*;
use serde_json::{Map, Value};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The file types the readers understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// `.json`: an array of objects (or JSON lines saved as `.json`).
    Json,
    /// `.jsonl` / `.ndjson`: one object per line.
    Jsonl,
    /// `.csv` / `.tsv` with a header row.
    Csv,
    /// `.parquet`.
    Parquet,
    /// `.txt`: plain text documents.
    Txt,
}

impl FileKind {
    /// The kind for a path's extension, if supported.
    pub fn of(path: &Path) -> Option<FileKind> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        Some(match ext.as_str() {
            "json" => FileKind::Json,
            "jsonl" | "ndjson" => FileKind::Jsonl,
            "csv" | "tsv" => FileKind::Csv,
            "parquet" => FileKind::Parquet,
            "txt" => FileKind::Txt,
            _ => return None,
        })
    }
}

/// A byte range of one JSONL row.
#[derive(Debug, Clone, Copy)]
struct LineSpan {
    start: u64,
    len: u64,
    /// 1-based line number.
    line: u64,
}

#[derive(Debug)]
enum PartData {
    Loaded(Vec<Value>),
    Jsonl(Vec<LineSpan>),
}

#[derive(Debug)]
struct Part {
    path: PathBuf,
    kind: FileKind,
    data: PartData,
}

impl Part {
    fn len(&self) -> usize {
        match &self.data {
            PartData::Loaded(v) => v.len(),
            PartData::Jsonl(v) => v.len(),
        }
    }
}

/// Rows from one or more data files.
#[derive(Debug)]
pub struct Dataset {
    parts: Vec<Part>,
    /// `starts[i]` = global index of part i's first row.
    starts: Vec<usize>,
    len: usize,
}

/// The data files a source resolves to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedSource {
    /// Training files (all data files when none is named for a split).
    pub train: Vec<PathBuf>,
    /// Files named `validation`/`valid`/`val`/`dev`/`eval` next to files
    /// named `train` (HF dataset repos' split naming).
    pub validation: Vec<PathBuf>,
    /// Files named `test` (not used for training).
    pub test: Vec<PathBuf>,
    /// `.txt` split mode resolved from `TxtSplit::Auto`.
    pub txt_per_file: bool,
}

/// Resolves a `data.path`: a local file, a folder (every data file in it,
/// recursively, sorted), or a hub dataset id through the HF cache at
/// `cache_dir` (downloading unless `offline`).
pub fn resolve_source(
    spec: &str,
    cache_dir: &Path,
    offline: bool,
) -> Result<ResolvedSource, DataError> {
    let p = Path::new(spec);
    if p.is_file() {
        if FileKind::of(p).is_none() {
            return Err(DataError::UnsupportedFile {
                path: p.to_path_buf(),
            });
        }
        return Ok(ResolvedSource {
            train: vec![p.to_path_buf()],
            ..Default::default()
        });
    }
    if p.is_dir() {
        return resolve_folder(p);
    }
    if hub::looks_like_hub_id(spec) {
        let wanted = |f: &str| FileKind::of(Path::new(f)).is_some() && !is_ignored_name(f);
        let snap = hub::resolve_repo(spec, RepoKind::Dataset, cache_dir, offline, &wanted)?;
        return resolve_folder(&snap);
    }
    Err(DataError::NotFound {
        path: spec.to_string(),
        hint: "no such file or folder, and not a hub dataset id (`org/name`); check `data.path`"
            .into(),
    })
}

/// Resolves with the default HF cache and `HF_HUB_OFFLINE`.
pub fn resolve_source_default(spec: &str) -> Result<ResolvedSource, DataError> {
    resolve_source(spec, &hub::hub_cache_dir(), hub::hub_offline())
}

fn is_ignored_name(rel: &str) -> bool {
    let name = Path::new(rel)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(rel);
    name.starts_with('.')
        || Path::new(rel)
            .components()
            .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        || name.eq_ignore_ascii_case("dataset_info.json")
        || name.eq_ignore_ascii_case("dataset_infos.json")
        || name.eq_ignore_ascii_case("state.json")
}

fn resolve_folder(dir: &Path) -> Result<ResolvedSource, DataError> {
    let mut files = Vec::new();
    walk(dir, dir, &mut files)?;
    files.sort();
    if files.is_empty() {
        return Err(DataError::NoDataFiles {
            path: dir.to_path_buf(),
        });
    }
    let mut out = ResolvedSource::default();
    let mut untagged = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(dir)
            .unwrap_or(&f)
            .to_string_lossy()
            .to_lowercase();
        let words: Vec<&str> = rel
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        let has = |names: &[&str]| words.iter().any(|w| names.contains(w));
        if has(&["train"]) {
            out.train.push(f);
        } else if has(&["validation", "valid", "val", "dev", "eval"]) {
            out.validation.push(f);
        } else if has(&["test"]) {
            out.test.push(f);
        } else {
            untagged.push(f);
        }
    }
    if out.train.is_empty() {
        // No split naming: every file is training data.
        out.train = untagged;
        out.train.append(&mut out.validation);
        out.train.append(&mut out.test);
        out.train.sort();
    } else {
        out.train.append(&mut untagged);
    }
    out.txt_per_file = true;
    Ok(out)
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let entries = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .to_string();
        if is_ignored_name(&rel) {
            continue;
        }
        if path.is_dir() {
            walk(root, &path, out)?;
        } else if FileKind::of(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

impl Dataset {
    /// Opens files (JSONL indexed, others parsed). `txt_per_file` makes
    /// each `.txt` file one document instead of one per blank-line block.
    pub fn open_files(files: &[PathBuf], txt_per_file: bool) -> Result<Self, DataError> {
        let parts: Vec<Part> = files
            .par_iter()
            .map(|f| open_part(f, txt_per_file))
            .collect::<Result<_, _>>()?;
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for p in &parts {
            starts.push(len);
            len += p.len();
        }
        Ok(Dataset { parts, starts, len })
    }

    /// Opens the training files of `spec` (file, folder or hub id) with
    /// the `.txt` split mode `txt_split`.
    pub fn open(spec: &str, txt_split: TxtSplit) -> Result<Self, DataError> {
        let src = resolve_source_default(spec)?;
        Self::open_files(&src.train, txt_per_file(txt_split, &src))
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The files, in row order.
    pub fn files(&self) -> Vec<&Path> {
        self.parts.iter().map(|p| p.path.as_path()).collect()
    }

    fn locate(&self, i: usize) -> Option<(usize, usize)> {
        if i >= self.len {
            return None;
        }
        let part = self.starts.partition_point(|&s| s <= i).saturating_sub(1);
        Some((part, i - self.starts[part]))
    }

    /// "file line N" (JSONL, 1-based line) or "file row N" (0-based row).
    pub fn location(&self, i: usize) -> String {
        match self.locate(i) {
            None => format!("row {i} (out of range)"),
            Some((p, local)) => {
                let part = &self.parts[p];
                match &part.data {
                    PartData::Jsonl(spans) => {
                        format!("{} line {}", part.path.display(), spans[local].line)
                    }
                    PartData::Loaded(_) => {
                        let unit = if part.kind == FileKind::Txt {
                            "document"
                        } else {
                            "row"
                        };
                        format!("{} {unit} {local}", part.path.display())
                    }
                }
            }
        }
    }

    /// Reads row `i` (JSONL: reads only that line).
    pub fn row(&self, i: usize) -> Result<Value, DataError> {
        let (p, local) = self.locate(i).ok_or_else(|| DataError::Config {
            setting: "row".into(),
            message: format!("row {i} is out of range: the dataset has {} rows", self.len),
        })?;
        let part = &self.parts[p];
        match &part.data {
            PartData::Loaded(rows) => Ok(rows[local].clone()),
            PartData::Jsonl(spans) => {
                let span = spans[local];
                let mut f =
                    std::fs::File::open(&part.path).map_err(|e| DataError::io(&part.path, e))?;
                f.seek(SeekFrom::Start(span.start))
                    .map_err(|e| DataError::io(&part.path, e))?;
                let mut buf = vec![0u8; span.len as usize];
                f.read_exact(&mut buf)
                    .map_err(|e| DataError::io(&part.path, e))?;
                parse_jsonl_line(&part.path, &buf, span)
            }
        }
    }

    /// Reads every row, in order (JSONL lines parsed in parallel).
    pub fn all_rows(&self) -> Result<Vec<Value>, DataError> {
        let mut out = Vec::with_capacity(self.len);
        for part in &self.parts {
            match &part.data {
                PartData::Loaded(rows) => out.extend(rows.iter().cloned()),
                PartData::Jsonl(spans) => {
                    let bytes =
                        std::fs::read(&part.path).map_err(|e| DataError::io(&part.path, e))?;
                    let rows: Vec<Value> = spans
                        .par_iter()
                        .map(|s| {
                            let end = (s.start + s.len) as usize;
                            let line = bytes.get(s.start as usize..end).ok_or_else(|| {
                                DataError::BadRow {
                                    location: format!("{} line {}", part.path.display(), s.line),
                                    message: "the file changed while reading; re-run".into(),
                                }
                            })?;
                            parse_jsonl_line(&part.path, line, *s)
                        })
                        .collect::<Result<_, _>>()?;
                    out.extend(rows);
                }
            }
        }
        Ok(out)
    }

    /// Reads the rows at `indices` (in that order).
    pub fn rows_at(&self, indices: &[usize]) -> Result<Vec<Value>, DataError> {
        indices.iter().map(|&i| self.row(i)).collect()
    }
}

/// Resolves `TxtSplit::Auto` for a source.
pub fn txt_per_file(split: TxtSplit, src: &ResolvedSource) -> bool {
    match split {
        TxtSplit::PerFile => true,
        TxtSplit::BlankLine => false,
        TxtSplit::Auto => src.txt_per_file,
    }
}

fn parse_jsonl_line(path: &Path, bytes: &[u8], span: LineSpan) -> Result<Value, DataError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| DataError::Json {
        path: path.to_path_buf(),
        line: Some(span.line as usize),
        message: format!("{e} (column {})", e.column()),
    })?;
    if !v.is_object() {
        return Err(DataError::BadRow {
            location: format!("{} line {}", path.display(), span.line),
            message: format!(
                "each line must be a JSON object like {{\"text\": ...}}, found {}",
                short(&v)
            ),
        });
    }
    Ok(v)
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(60).collect::<String>())
    } else {
        s
    }
}

fn open_part(path: &Path, txt_per_file: bool) -> Result<Part, DataError> {
    let kind = FileKind::of(path).ok_or_else(|| DataError::UnsupportedFile {
        path: path.to_path_buf(),
    })?;
    let data = match kind {
        FileKind::Jsonl => PartData::Jsonl(index_jsonl(path)?),
        FileKind::Json => read_json(path)?,
        FileKind::Csv => PartData::Loaded(read_csv(path)?),
        FileKind::Parquet => PartData::Loaded(read_parquet(path)?),
        FileKind::Txt => PartData::Loaded(read_txt(path, txt_per_file)?),
    };
    Ok(Part {
        path: path.to_path_buf(),
        kind,
        data,
    })
}

/// Scans a JSONL file once: offsets of non-blank lines, UTF-8 checked.
fn index_jsonl(path: &Path) -> Result<Vec<LineSpan>, DataError> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut spans = Vec::new();
    let mut buf = Vec::new();
    let mut offset = 0u64;
    let mut line = 0u64;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| DataError::io(path, e))?;
        if n == 0 {
            break;
        }
        line += 1;
        if let Err(e) = std::str::from_utf8(&buf) {
            return Err(DataError::InvalidUtf8 {
                path: path.to_path_buf(),
                line: line as usize,
                byte_offset: offset + e.valid_up_to() as u64,
            });
        }
        let content = trim_ascii(&buf);
        if !content.is_empty() {
            let lead = buf.len() - trim_ascii_start(&buf).len();
            spans.push(LineSpan {
                start: offset + lead as u64,
                len: content.len() as u64,
                line,
            });
        }
        offset += n as u64;
    }
    if spans.is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    Ok(spans)
}

fn trim_ascii_start(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    &b[start..]
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    let b = trim_ascii_start(b);
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(0, |e| e + 1);
    &b[..end]
}

/// Reads a file as UTF-8, naming the line of the first invalid byte.
fn read_utf8(path: &Path) -> Result<String, DataError> {
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

fn read_json(path: &Path) -> Result<PartData, DataError> {
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

fn read_csv(path: &Path) -> Result<Vec<Value>, DataError> {
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

fn read_parquet(path: &Path) -> Result<Vec<Value>, DataError> {
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

fn row_to_json(row: &parquet::record::Row) -> Value {
    Value::Object(
        row.get_column_iter()
            .map(|(k, f)| (k.clone(), field_to_json(f)))
            .collect(),
    )
}

/// Parquet values as JSON (the record API's `to_json_value` needs the
/// `json` feature, which would pull in arrow).
fn field_to_json(f: &parquet::record::Field) -> Value {
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

fn read_txt(path: &Path, per_file: bool) -> Result<Vec<Value>, DataError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_index_and_rows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        std::fs::write(
            &p,
            "{\"text\":\"a\"}\n\n  {\"text\":\"b\"}\r\n{\"text\":\"c\"}",
        )
        .unwrap();
        let ds = Dataset::open_files(std::slice::from_ref(&p), false).unwrap();
        assert_eq!(ds.len(), 3);
        assert_eq!(ds.row(1).unwrap()["text"], "b");
        assert_eq!(ds.row(2).unwrap()["text"], "c");
        assert!(ds.location(1).ends_with("line 3"));
        assert_eq!(ds.all_rows().unwrap().len(), 3);
        assert!(ds.row(3).is_err());
    }

    #[test]
    fn txt_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, "one\ntwo\n\n\nthree\n").unwrap();
        let ds = Dataset::open_files(std::slice::from_ref(&p), false).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.row(0).unwrap()["text"], "one\ntwo");
        let ds = Dataset::open_files(&[p], true).unwrap();
        assert_eq!(ds.len(), 1);
    }

    #[test]
    fn folder_splits() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("data");
        std::fs::create_dir_all(&d).unwrap();
        for n in [
            "train-00000-of-00001.jsonl",
            "validation-0.jsonl",
            "test.jsonl",
        ] {
            std::fs::write(d.join(n), "{\"text\":\"x\"}\n").unwrap();
        }
        std::fs::write(dir.path().join("README.md"), "# hi").unwrap();
        std::fs::write(dir.path().join(".hidden.json"), "[]").unwrap();
        let src = resolve_folder(dir.path()).unwrap();
        assert_eq!(src.train.len(), 1);
        assert_eq!(src.validation.len(), 1);
        assert_eq!(src.test.len(), 1);
    }
}
