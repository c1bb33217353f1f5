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

mod source;
mod whole_files;

pub use source::{resolve_source, resolve_source_default, ResolvedSource};
use whole_files::*;

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

#[cfg(test)]
mod tests {
    use super::source::resolve_folder;
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
