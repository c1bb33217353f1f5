//! Memory accounting: a counting global allocator that test and bench builds
//! install to measure the peak bytes of a training step on CPU, the
//! process's resident set size read from `/proc/self/status`, and the large-block
//! pool the binary installs over mimalloc ([`LargeBlockPool`]) with its page policy
//! ([`disable_transparent_huge_pages`]).
//!
//! candle's CPU tensors are plain `Vec` allocations, so every tensor a training
//! step creates goes through the global allocator and is seen here. Memory
//! mapped safetensors files are not heap and are not counted (they show up in
//! the RSS instead).
//!
//! The library never installs the allocator itself (a library must not choose
//! the global allocator of the programs linking it). A test or bench binary
//! opts in with:
//!
//! ```
//! #[global_allocator]
//! static A: tunestudio::mem::CountingAllocator = tunestudio::mem::CountingAllocator::new();
//! # fn main() {}
//! ```
//!
//! The counters are process-wide statics rather than fields of the allocator
//! value, so library code ([`crate::devices::dry_run`], through [`Meter`]) can read them without
//! knowing the name of the static the binary declared.

pub mod alloc_failure;
mod large_blocks;
mod meter;
mod page_policy;
pub mod ranks;

pub use large_blocks::{free_block_bytes, release_free_blocks, LargeBlockPool, LARGE_BLOCK_BYTES};
pub use meter::{MeasureMethod, Meter};
pub use page_policy::disable_transparent_huge_pages;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes currently allocated through the counting allocator.
static CURRENT_BYTES: AtomicU64 = AtomicU64::new(0);
/// Highest value `CURRENT_BYTES` reached since the last [`reset_peak`].
static PEAK_BYTES: AtomicU64 = AtomicU64::new(0);
/// Number of allocations made (including reallocations) since start.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Set on the first allocation served by a [`CountingAllocator`].
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A global allocator that forwards to [`System`] and counts the bytes in use
/// and their peak.
///
/// Counting costs two relaxed atomic operations per allocation; it is meant for
/// tests, benches and measurement harnesses, not for release builds of the app.
#[derive(Debug, Default)]
pub struct CountingAllocator {
    _private: (),
}

impl CountingAllocator {
    /// A counting allocator (usable in a `static`).
    pub const fn new() -> Self {
        Self { _private: () }
    }

    /// See [`current_bytes`].
    pub fn current_bytes(&self) -> u64 {
        current_bytes()
    }

    /// See [`peak_bytes`].
    pub fn peak_bytes(&self) -> u64 {
        peak_bytes()
    }

    /// See [`reset_peak`].
    pub fn reset_peak(&self) -> u64 {
        reset_peak()
    }

    #[inline]
    fn added(size: usize) {
        let size = size as u64;
        let now = CURRENT_BYTES.fetch_add(size, Ordering::Relaxed) + size;
        PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // A load first so the common case does not write a shared cache line.
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
    }

    #[inline]
    fn removed(size: usize) {
        CURRENT_BYTES.fetch_sub(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; the counters are only bookkeeping and never affect the pointers.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded verbatim; the caller upholds `GlobalAlloc::alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            Self::added(layout.size());
            ranks::allocated(ptr, layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded verbatim (calloc keeps zeroed pages lazy, as without counting).
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            Self::added(layout.size());
            ranks::allocated(ptr, layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Out of the rank table before the block can be handed out again.
        ranks::released(ptr, layout.size());
        // SAFETY: forwarded verbatim; `ptr` was allocated by `System` through us.
        unsafe { System.dealloc(ptr, layout) };
        Self::removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let rank = ranks::released(ptr, layout.size());
        // SAFETY: forwarded verbatim; `ptr` was allocated by `System` through us.
        let new_ptr = unsafe { System.realloc(ptr, layout, new_size) };
        if new_ptr.is_null() {
            // The old block stays; back to the rank it was charged to, if any.
            if rank.is_some() {
                ranks::recharged(ptr, layout.size(), rank);
            }
        } else {
            ranks::recharged(new_ptr, new_size, rank);
            // Count the new block before releasing the old one: a moving realloc
            // holds both for a moment, and a grow-in-place is counted the same
            // way so the peak never under-reports.
            Self::added(new_size);
            Self::removed(layout.size());
        }
        new_ptr
    }
}

/// Whether a [`CountingAllocator`] is the global allocator of this process
/// (true once it has served an allocation, which happens before `main`).
pub fn is_installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Bytes currently allocated on the heap (0 when the allocator is not installed).
pub fn current_bytes() -> u64 {
    CURRENT_BYTES.load(Ordering::Relaxed)
}

/// Peak heap bytes since the last [`reset_peak`] (0 when not installed).
pub fn peak_bytes() -> u64 {
    PEAK_BYTES.load(Ordering::Relaxed)
}

/// Number of allocations served since the process started.
pub fn allocation_count() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Restarts peak tracking from the bytes allocated now; returns the previous peak.
pub fn reset_peak() -> u64 {
    let now = CURRENT_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.swap(now, Ordering::Relaxed)
}

/// The process's resident set size (`VmRSS`), `None` off Linux or when
/// `/proc/self/status` cannot be read.
pub fn process_rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// The process's peak resident set size (`VmHWM`), `None` off Linux or when
/// `/proc/self/status` cannot be read.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|kib| kib * 1024)
}

#[cfg(target_os = "linux")]
fn proc_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status_kib(&status, key)
}

#[cfg(not(target_os = "linux"))]
fn proc_status_kib(_key: &str) -> Option<u64> {
    None
}

/// Finds `key` (e.g. `"VmRSS:"`) in a `/proc/<pid>/status` text and returns its value in KiB.
fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?;
        let mut parts = rest.split_whitespace();
        let value: u64 = parts.next()?.parse().ok()?;
        match parts.next() {
            Some("kB") | None => Some(value),
            _ => None,
        }
    })
}

/// Whether an error message says a device ran out of memory (CUDA, candle, or the OS). The
/// one word list for it: the trainer's step errors ([`crate::train::oom::is_out_of_memory`])
/// and the planner's dry run both ask here.
pub fn is_out_of_memory_message(message: &str) -> bool {
    let m = message.to_lowercase();
    [
        "out of memory",
        "out_of_memory",
        "cannot allocate",
        "allocation failed",
        "failed to allocate",
        "memory allocation",
    ]
    .iter()
    .any(|k| m.contains(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_messages_are_recognised() {
        for m in [
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "Cannot allocate memory (os error 12)",
            "out of memory: allocation failed (injected)",
            "memory allocation of 1024 bytes failed",
        ] {
            assert!(is_out_of_memory_message(m), "{m}");
        }
        assert!(!is_out_of_memory_message("shape mismatch in matmul"));
        assert!(!is_out_of_memory_message(
            "cannot memory-map the weights file"
        ));
    }

    #[test]
    fn parses_proc_status_lines() {
        let text = "Name:\tx\nVmHWM:\t  12345 kB\nVmRSS:\t    678 kB\n";
        assert_eq!(parse_status_kib(text, "VmRSS:"), Some(678));
        assert_eq!(parse_status_kib(text, "VmHWM:"), Some(12345));
        assert_eq!(parse_status_kib(text, "VmSwap:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_rss_on_linux() {
        let rss = process_rss_bytes().unwrap_or(0);
        let hwm = peak_rss_bytes().unwrap_or(0);
        assert!(rss > 0 && hwm >= rss, "rss {rss} hwm {hwm}");
    }
}
