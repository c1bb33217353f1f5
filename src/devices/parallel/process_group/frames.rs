//! The process group's messages on the wire: a rank's contribution to one collective (rank →
//! rank 0) and the sum (rank 0 → every rank), both the same layout:
//!
//! ```text
//! magic "TSAR" | collective number u64 | element bytes u8 (4: f32, 8: f64) | count u32
//! then per tensor: name (u32 length + UTF-8) | dims (u32 count + u64 each) | values
//! ```
//!
//! Integers are big-endian like the rendezvous's; the values are raw little-endian (the
//! byte order of every machine tunestudio runs on, so encoding is a copy). The receiver
//! checks every name and shape against its own, so ranks that built different models or
//! ran different steps fail with both sides named instead of summing garbage.

use std::io::{self, Read, Write};

/// The first bytes of every collective message: "tunestudio all-reduce".
const MAGIC: [u8; 4] = *b"TSAR";
/// The longest tensor name read from a peer (bounds what a broken peer makes this side
/// allocate; real names are under 100 bytes).
const MAX_NAME_BYTES: usize = 4096;
/// Values are moved through a buffer of this many bytes at a time, so a large gradient is
/// never copied whole into a second buffer.
const CHUNK_BYTES: usize = 1 << 20;

/// An element type a collective sums: f32 gradients and f64 scalars.
pub trait Element: Copy + Default + std::ops::AddAssign + Send + Sync {
    /// Bytes per value on the wire.
    const BYTES: usize;
    /// Appends the value's little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one value from `BYTES` little-endian bytes.
    fn take(bytes: &[u8]) -> Self;
}

impl Element for f32 {
    const BYTES: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn take(bytes: &[u8]) -> Self {
        let mut b = [0u8; 4];
        b.copy_from_slice(&bytes[..4]);
        f32::from_le_bytes(b)
    }
}

impl Element for f64 {
    const BYTES: usize = 8;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn take(bytes: &[u8]) -> Self {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[..8]);
        f64::from_le_bytes(b)
    }
}

/// One named tensor of a collective, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedValues<T> {
    /// The tensor's name (a parameter's, for a gradient).
    pub name: String,
    /// Its shape.
    pub dims: Vec<usize>,
    /// Its values, row-major.
    pub values: Vec<T>,
}

/// Writes one message: the header, then each tensor.
pub(crate) fn write_message<T: Element>(
    w: &mut impl Write,
    collective: u64,
    tensors: &[NamedValues<T>],
) -> io::Result<()> {
    let mut out = Vec::with_capacity(CHUNK_BYTES.min(1 << 16));
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&collective.to_be_bytes());
    out.push(T::BYTES as u8);
    out.extend_from_slice(&count_u32(tensors.len())?.to_be_bytes());
    for t in tensors {
        out.extend_from_slice(&count_u32(t.name.len())?.to_be_bytes());
        out.extend_from_slice(t.name.as_bytes());
        out.extend_from_slice(&count_u32(t.dims.len())?.to_be_bytes());
        for d in &t.dims {
            out.extend_from_slice(&(*d as u64).to_be_bytes());
        }
        for chunk in t.values.chunks(CHUNK_BYTES / T::BYTES) {
            for v in chunk {
                v.put(&mut out);
            }
            w.write_all(&out)?;
            out.clear();
        }
    }
    w.write_all(&out)?;
    w.flush()
}

fn count_u32(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "over 2^32 entries"))
}

/// Why a received message does not fit this rank's own tensors.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection failed (closed, timed out, reset).
    Io(io::Error),
    /// The message is readable but is not this collective over the same tensors.
    Mismatch(String),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// A tensor's name and shape without its values: what a received tensor must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub name: String,
    pub dims: Vec<usize>,
    pub len: usize,
}

/// The layouts of `tensors`, in order.
pub(crate) fn layouts<T>(tensors: &[NamedValues<T>]) -> Vec<Layout> {
    tensors
        .iter()
        .map(|t| Layout {
            name: t.name.clone(),
            dims: t.dims.clone(),
            len: t.values.len(),
        })
        .collect()
}

/// Reads one message whose tensors must be named and shaped as `mine`, in the same order,
/// for collective number `collective`; `each` receives every tensor's index and values, a
/// chunk at a time, with the offset of the chunk's first value.
pub(crate) fn read_message<T: Element>(
    r: &mut impl Read,
    collective: u64,
    mine: &[Layout],
    mut each: impl FnMut(usize, usize, &[T]),
) -> Result<(), ReadError> {
    let mismatch = |m: String| Err(ReadError::Mismatch(m));
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if magic != MAGIC {
        return mismatch("it sent bytes that are not a tunestudio collective".into());
    }
    let theirs = read_u64(r)?;
    if theirs != collective {
        return mismatch(format!(
            "it is at collective {theirs} and this rank at {collective}: the ranks ran \
             different steps (started with different run configs?)"
        ));
    }
    let mut width = [0u8; 1];
    r.read_exact(&mut width)?;
    if usize::from(width[0]) != T::BYTES {
        return mismatch(format!(
            "it sent {}-byte values where this rank sums {}-byte ones",
            width[0],
            T::BYTES
        ));
    }
    let count = read_u32(r)? as usize;
    if count != mine.len() {
        return mismatch(format!(
            "it sent {count} tensors where this rank has {}: the ranks train different \
             parameters (another model or LoRA setup?)",
            mine.len()
        ));
    }
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut values = Vec::with_capacity(CHUNK_BYTES / T::BYTES);
    for (index, own) in mine.iter().enumerate() {
        let (name, dims) = read_header(r)?;
        if name != own.name || dims != own.dims {
            return mismatch(format!(
                "it sent `{name}` with shape {dims:?} where this rank has `{}` with shape {:?}: \
                 the ranks train different parameters (another model or LoRA setup?)",
                own.name, own.dims
            ));
        }
        let mut offset = 0;
        while offset < own.len {
            let n = (own.len - offset).min(CHUNK_BYTES / T::BYTES);
            let bytes = &mut buf[..n * T::BYTES];
            r.read_exact(bytes)?;
            values.clear();
            values.extend(bytes.chunks_exact(T::BYTES).map(T::take));
            each(index, offset, &values);
            offset += n;
        }
    }
    Ok(())
}

fn read_header(r: &mut impl Read) -> Result<(String, Vec<usize>), ReadError> {
    let len = read_u32(r)? as usize;
    if len > MAX_NAME_BYTES {
        return Err(ReadError::Mismatch(format!(
            "it sent a tensor name of {len} bytes"
        )));
    }
    let mut name = vec![0u8; len];
    r.read_exact(&mut name)?;
    let ndims = read_u32(r)? as usize;
    if ndims > 16 {
        return Err(ReadError::Mismatch(format!(
            "it sent a tensor of {ndims} dimensions"
        )));
    }
    let dims = (0..ndims)
        .map(|_| read_u64(r).map(|d| d as usize))
        .collect::<io::Result<Vec<_>>>()?;
    Ok((String::from_utf8_lossy(&name).into_owned(), dims))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dims: &[usize], values: Vec<f32>) -> NamedValues<f32> {
        NamedValues {
            name: name.into(),
            dims: dims.to_vec(),
            values,
        }
    }

    /// A message reads back value for value (one tensor longer than a chunk); another name,
    /// shape or collective number is a mismatch that names both sides.
    #[test]
    fn messages_round_trip_and_mismatches_are_named() {
        let big: Vec<f32> = (0..(CHUNK_BYTES / 4 + 3)).map(|i| i as f32 * 0.5).collect();
        let mine = vec![
            tensor("a.weight", &[2, 2], vec![1.0, -2.5, f32::MIN_POSITIVE, 3.0]),
            tensor("b.weight", &[big.len()], big),
        ];
        let mut wire = Vec::new();
        write_message(&mut wire, 7, &mine).unwrap();
        let mut back: Vec<Vec<f32>> = mine.iter().map(|t| vec![0.0; t.values.len()]).collect();
        read_message(&mut wire.as_slice(), 7, &layouts(&mine), |i, at, v| {
            back[i][at..at + v.len()].copy_from_slice(v)
        })
        .unwrap();
        for (t, b) in mine.iter().zip(&back) {
            assert_eq!(&t.values, b);
        }
        let err = |r: Result<(), ReadError>| match r {
            Err(ReadError::Mismatch(m)) => m,
            other => panic!("{other:?}"),
        };
        let m = err(read_message::<f32>(
            &mut wire.as_slice(),
            8,
            &layouts(&mine),
            |_, _, _| {},
        ));
        assert!(m.contains("collective 7") && m.contains("at 8"), "{m}");
        let other = vec![tensor("a.weight", &[4], vec![0.0; 4]), mine[1].clone()];
        let m = err(read_message::<f32>(
            &mut wire.as_slice(),
            7,
            &layouts(&other),
            |_, _, _| {},
        ));
        assert!(m.contains("[2, 2]") && m.contains("[4]"), "{m}");
    }
}
