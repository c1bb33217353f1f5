//! The rendezvous's messages on the wire: a joining rank's hello, and the frames both sides
//! send afterwards (rank 0's welcome with the id and the hosts, an abort with its reason, a
//! rank's "done"). Fixed-width big-endian fields with length-prefixed strings, so a stray
//! connection or another program's bytes fail on the magic rather than being misread.

use std::io::{self, Read, Write};

/// The first bytes of a hello: "tunestudio rendezvous".
pub const MAGIC: [u8; 4] = *b"TSRV";
/// Bumped when a message changes; ranks of different builds refuse each other by it.
pub const VERSION: u16 = 2;
/// Bytes of the id every rank receives (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;
/// The longest host name or message read from a peer: bounds what a broken peer can make
/// this side allocate.
const MAX_TEXT_BYTES: usize = 64 * 1024;

/// What a joining rank says first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Its protocol version.
    pub version: u16,
    /// Its global rank.
    pub rank: usize,
    /// The world size it was started with.
    pub world_size: usize,
    /// Its rank on its machine.
    pub local_rank: usize,
    /// Its host name.
    pub host: String,
}

/// A frame after the hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Rank 0 to each rank once all joined: the id, every rank's host, in rank order, and
    /// the port of rank 0's process-group listener (version 2).
    Welcome {
        /// The id blob.
        id: [u8; ID_BYTES],
        /// Host of rank 0, 1, ….
        hosts: Vec<String>,
        /// The port at `MASTER_ADDR` where the ranks open their process-group connections.
        data_port: u16,
    },
    /// Stop: a rank failed, or the rendezvous did; the text says which and why.
    Abort(String),
    /// The sender finished normally: its connection closing next is not a failure.
    Done,
}

const TAG_WELCOME: u8 = 1;
const TAG_ABORT: u8 = 2;
const TAG_DONE: u8 = 3;

/// Whether a read failed on the magic (another program's bytes, not a rank).
pub fn is_not_a_rank(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData && e.to_string().starts_with("not a tunestudio")
}

fn write_text(out: &mut Vec<u8>, text: &str) {
    let bytes = &text.as_bytes()[..text.len().min(MAX_TEXT_BYTES)];
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_text(r: &mut impl Read) -> io::Result<String> {
    let len = read_u32(r)? as usize;
    if len > MAX_TEXT_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a rendezvous text of {len} bytes is longer than {MAX_TEXT_BYTES}"),
        ));
    }
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Writes a hello (one write, so a peer never sees half of it from a live rank).
pub fn write_hello(w: &mut impl Write, hello: &Hello) -> io::Result<()> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&hello.version.to_be_bytes());
    for n in [hello.rank, hello.world_size, hello.local_rank] {
        let n = u32::try_from(n).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a rank above 2^32 cannot be sent",
            )
        })?;
        out.extend_from_slice(&n.to_be_bytes());
    }
    write_text(&mut out, &hello.host);
    w.write_all(&out)?;
    w.flush()
}

/// Reads a hello; an error for which [`is_not_a_rank`] holds when the magic is wrong.
pub fn read_hello(r: &mut impl Read) -> io::Result<Hello> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a tunestudio rendezvous hello",
        ));
    }
    let mut version = [0u8; 2];
    r.read_exact(&mut version)?;
    let rank = read_u32(r)? as usize;
    let world_size = read_u32(r)? as usize;
    let local_rank = read_u32(r)? as usize;
    let host = read_text(r)?;
    Ok(Hello {
        version: u16::from_be_bytes(version),
        rank,
        world_size,
        local_rank,
        host,
    })
}

/// Writes one frame (one write).
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> io::Result<()> {
    let mut out = Vec::new();
    match frame {
        Frame::Welcome {
            id,
            hosts,
            data_port,
        } => {
            out.push(TAG_WELCOME);
            out.extend_from_slice(id);
            out.extend_from_slice(&data_port.to_be_bytes());
            out.extend_from_slice(&(hosts.len() as u32).to_be_bytes());
            for h in hosts {
                write_text(&mut out, h);
            }
        }
        Frame::Abort(reason) => {
            out.push(TAG_ABORT);
            write_text(&mut out, reason);
        }
        Frame::Done => out.push(TAG_DONE),
    }
    w.write_all(&out)?;
    w.flush()
}

/// Reads one frame.
pub fn read_frame(r: &mut impl Read) -> io::Result<Frame> {
    let mut tag = [0u8; 1];
    r.read_exact(&mut tag)?;
    match tag[0] {
        TAG_WELCOME => {
            let mut id = [0u8; ID_BYTES];
            r.read_exact(&mut id)?;
            let mut port = [0u8; 2];
            r.read_exact(&mut port)?;
            let data_port = u16::from_be_bytes(port);
            let count = read_u32(r)? as usize;
            // A world is at most a few thousand ranks; the bound keeps a broken peer from
            // making this side allocate without limit.
            if count > 1 << 20 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a welcome listing {count} hosts"),
                ));
            }
            let hosts = (0..count)
                .map(|_| read_text(r))
                .collect::<io::Result<Vec<_>>>()?;
            Ok(Frame::Welcome {
                id,
                hosts,
                data_port,
            })
        }
        TAG_ABORT => Ok(Frame::Abort(read_text(r)?)),
        TAG_DONE => Ok(Frame::Done),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown rendezvous frame {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message reads back as written; other bytes fail on the magic.
    #[test]
    fn messages_round_trip() {
        let hello = Hello {
            version: VERSION,
            rank: 3,
            world_size: 16,
            local_rank: 1,
            host: "gpu07".into(),
        };
        let mut buf = Vec::new();
        write_hello(&mut buf, &hello).unwrap();
        assert_eq!(read_hello(&mut buf.as_slice()).unwrap(), hello);
        let frames = [
            Frame::Welcome {
                id: [7; ID_BYTES],
                hosts: vec!["a".into(), "b".into()],
                data_port: 29501,
            },
            Frame::Abort("rank 2 failed".into()),
            Frame::Done,
        ];
        for frame in frames {
            let mut buf = Vec::new();
            write_frame(&mut buf, &frame).unwrap();
            assert_eq!(read_frame(&mut buf.as_slice()).unwrap(), frame);
        }
        let err = read_hello(&mut b"GET / HTTP/1.1\r\n".as_slice()).unwrap_err();
        assert!(is_not_a_rank(&err), "{err}");
    }
}
