//! Per-rank accounting for the counting allocator: how many bytes each data-parallel rank
//! holds, where every rank is a logical device in one process (`cpu:0,cpu:1`), whose tensors
//! all come from the one heap.
//!
//! The trainer names the rank it works for ([`on_rank`]: building a rank's model, its forward
//! and backward, the collectives' output for it, its optimizer step); while a measurement is
//! on ([`track_ranks`]), every allocation of at least [`MIN_TRACKED_BYTES`] made under a rank
//! is recorded in a fixed table (pointer → rank), so its release is charged to the rank that
//! made it, whichever thread frees it. Smaller allocations (shapes, names, boxes) are not
//! attributed: a tensor of the smallest test model is 16 KiB.
//!
//! Without a measurement, [`on_rank`] costs a thread-local write, and the allocator one
//! relaxed load per call.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Ranks the table tells apart (the rank sits in the low bits of an aligned pointer).
pub const MAX_RANKS: usize = 8;
/// Allocations smaller than this are never attributed to a rank.
pub const MIN_TRACKED_BYTES: usize = 256;

/// Table slots: enough for every live tensor of a tiny model's ranks with activations.
const SLOTS: usize = 1 << 16;
/// How far an insert or a lookup probes before giving up (an insert then counts an overflow).
const MAX_PROBES: usize = 4096;
const EMPTY: usize = 0;
/// A freed slot: lookups probe past it, inserts reuse it.
const TOMBSTONE: usize = 1;
const RANK_BITS: usize = MAX_RANKS - 1;

thread_local! {
    /// The rank this thread works for, plus one (0: none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// Whether allocations under a rank are recorded now.
static TRACKING: AtomicBool = AtomicBool::new(false);
/// Whether any allocation was ever recorded (frees probe the table only then).
static EVER_TRACKED: AtomicBool = AtomicBool::new(false);
/// Allocations that found no free slot (a measurement with any is not trusted).
static OVERFLOWS: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static LIVE_BYTES: [AtomicU64; MAX_RANKS] = [ZERO; MAX_RANKS];
static PEAK_BYTES: [AtomicU64; MAX_RANKS] = [ZERO; MAX_RANKS];
#[allow(clippy::declare_interior_mutable_const)]
const FREE: AtomicUsize = AtomicUsize::new(EMPTY);
static TABLE: [AtomicUsize; SLOTS] = [FREE; SLOTS];

/// Runs `f` on behalf of `rank`: what it allocates (and keeps) is charged to that rank while
/// a measurement is on. Nests (the previous rank is restored), per thread.
pub fn on_rank<R>(rank: usize, f: impl FnOnce() -> R) -> R {
    let _rank = RankGuard::enter(rank);
    f()
}

/// [`on_rank`] for the rest of a scope: allocations on this thread are charged to the rank
/// until the guard drops (the previous rank is restored then).
#[must_use = "the rank is charged only while the guard lives"]
pub struct RankGuard {
    previous: usize,
}

impl RankGuard {
    /// Charges this thread's allocations to `rank` until the guard drops.
    pub fn enter(rank: usize) -> Self {
        RankGuard {
            previous: CURRENT.with(|c| c.replace(rank.min(RANK_BITS) + 1)),
        }
    }
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// Starts (or stops) recording allocations under a rank; starting clears every rank's count
/// and the overflow count. Allocations recorded before a stop are still charged when freed.
pub fn track_ranks(on: bool) {
    if on {
        // Blocks recorded by an earlier measurement are forgotten (their frees uncharged).
        for slot in &TABLE {
            slot.store(EMPTY, Ordering::Relaxed);
        }
        for r in 0..MAX_RANKS {
            LIVE_BYTES[r].store(0, Ordering::Relaxed);
            PEAK_BYTES[r].store(0, Ordering::Relaxed);
        }
        OVERFLOWS.store(0, Ordering::Relaxed);
        EVER_TRACKED.store(true, Ordering::Relaxed);
    }
    TRACKING.store(on, Ordering::Relaxed);
}

/// Bytes rank `rank` holds now (allocated under it since [`track_ranks`] and not freed).
pub fn rank_live_bytes(rank: usize) -> u64 {
    LIVE_BYTES
        .get(rank)
        .map_or(0, |b| b.load(Ordering::Relaxed))
}

/// The most rank `rank` held at once since [`track_ranks`] or [`reset_rank_peaks`].
pub fn rank_peak_bytes(rank: usize) -> u64 {
    PEAK_BYTES
        .get(rank)
        .map_or(0, |b| b.load(Ordering::Relaxed))
}

/// Restarts every rank's peak from what it holds now.
pub fn reset_rank_peaks() {
    for r in 0..MAX_RANKS {
        PEAK_BYTES[r].store(LIVE_BYTES[r].load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Whether a measurement is on.
pub fn tracking_ranks() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// Allocations the table had no room for since [`track_ranks`]: a measurement with any
/// under-counts.
pub fn overflowed_allocations() -> u64 {
    OVERFLOWS.load(Ordering::Relaxed)
}

fn slot_of(ptr: usize) -> usize {
    // Fibonacci hashing of the pointer (its low bits are alignment zeros).
    (ptr.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) % SLOTS
}

/// Called by the counting allocator after it handed out `ptr` (`bytes` long).
#[inline]
pub(super) fn allocated(ptr: *mut u8, bytes: usize) {
    if !TRACKING.load(Ordering::Relaxed) || bytes < MIN_TRACKED_BYTES {
        return;
    }
    let tag = CURRENT.with(Cell::get);
    if tag == 0 {
        return;
    }
    charge(ptr as usize, tag - 1, bytes);
}

fn charge(ptr: usize, rank: usize, bytes: usize) {
    // Blocks of this size are at least 8-aligned, so the rank fits in the low bits.
    if ptr & RANK_BITS != 0 {
        OVERFLOWS.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let entry = ptr | rank;
    let start = slot_of(ptr);
    for probe in 0..MAX_PROBES {
        let slot = &TABLE[(start + probe) % SLOTS];
        let seen = slot.load(Ordering::Relaxed);
        if (seen == EMPTY || seen == TOMBSTONE)
            && slot
                .compare_exchange(seen, entry, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let live = LIVE_BYTES[rank]
                .fetch_add(bytes as u64, Ordering::Relaxed)
                .wrapping_add(bytes as u64);
            PEAK_BYTES[rank].fetch_max(live, Ordering::Relaxed);
            return;
        }
    }
    OVERFLOWS.fetch_add(1, Ordering::Relaxed);
}

/// Called by the counting allocator before it releases `ptr` (`bytes` long); returns the
/// rank it was charged to, if any.
#[inline]
pub(super) fn released(ptr: *mut u8, bytes: usize) -> Option<usize> {
    if bytes < MIN_TRACKED_BYTES || !EVER_TRACKED.load(Ordering::Relaxed) {
        return None;
    }
    let ptr = ptr as usize;
    let start = slot_of(ptr);
    for probe in 0..MAX_PROBES {
        let slot = &TABLE[(start + probe) % SLOTS];
        let seen = slot.load(Ordering::Acquire);
        if seen == EMPTY {
            return None;
        }
        if seen != TOMBSTONE && seen & !RANK_BITS == ptr {
            // Only this block's owner frees it, so nobody else writes this slot now.
            slot.store(TOMBSTONE, Ordering::Release);
            let rank = seen & RANK_BITS;
            LIVE_BYTES[rank].fetch_sub(bytes as u64, Ordering::Relaxed);
            return Some(rank);
        }
    }
    None
}

/// Called by the counting allocator after a reallocation: the new block (`new`, `bytes`
/// long) is charged to `rank`, the old block's rank from [`released`] (a growing buffer stays
/// its maker's), or, for a block no rank made, to the current rank. A failed reallocation
/// passes the old block back, to be charged again.
#[inline]
pub(super) fn recharged(new: *mut u8, bytes: usize, rank: Option<usize>) {
    match rank {
        Some(rank) if bytes >= MIN_TRACKED_BYTES => charge(new as usize, rank, bytes),
        Some(_) => {}
        None => allocated(new, bytes),
    }
}
