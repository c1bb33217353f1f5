//! A global allocator layer that keeps large blocks (≥ [`LARGE_BLOCK_BYTES`]) in a pool of
//! its own and serves everything else from an inner allocator (mimalloc in the binary).
//!
//! Why: a training step frees and re-allocates tensors whose sizes change with every batch
//! (logits chunks, activations and their gradients follow the batch's padded length). With
//! mimalloc's purging off (as the binary first ran it), a freed 60 MB block that the next step's
//! 65 MB logits do not fit stays resident, and the next block is placed elsewhere: over the
//! demo's 60 steps the large blocks touched 225 MiB for a heap that never held more than
//! 117 MiB at once, and the resident set came out 259 or 287 MiB from run to run (which of
//! the two depended on which thread freed first). Purging instead (mimalloc's
//! `purge_delay` 0, or `arena_max_object_size` so large blocks are unmapped on free) made the
//! resident set repeatable but cost 25–45 % of the SmolLM2-135M step in page faults.
//!
//! The pool keeps every freed large block mapped and hands it to the next request it fits
//! best (the smallest free block at least as large), cut to size: the rest stays a free block
//! of its own, and freed neighbours merge again. When nothing fits, it grows the largest free
//! block with `mremap`, which moves page tables, not bytes, so only the added pages are
//! faulted in. Replaying the ≥ 1 MiB allocations of five whole runs (the demo, SmolLM2-135M
//! full and LoRA, tiny-llama, tiny-mistral; logged with a wrapper allocator) through this
//! policy, the pool's mapped bytes came to 101–109 % of the most those blocks held at once,
//! and no page was faulted twice. Without the cutting, small requests took large blocks (up
//! to 307 % at 1 MiB). It is the idea of PyTorch's CUDA caching allocator (keep freed blocks,
//! best fit, split), on the CPU's pages.
//!
//! The threshold is 128 KiB, not 1 MiB: the small models' activations (the demo's hidden 64
//! at 512 tokens is a 128 KiB tensor) then come here too, and mimalloc keeps only small
//! objects, whose freed pages its purge returns (see `src/main.rs`). Measured on the demo
//! (THP off, mimalloc's default purge): 2 steps peak at 145 MiB and 60 steps at 157.5, against
//! 147.8 and 163.5 with a 1 MiB threshold.
//!
//! Off Linux (no `mremap`) every request goes to the inner allocator.

use std::alloc::{GlobalAlloc, Layout};

/// Requests of this size or more are served by the pool (128 KiB, see the module docs).
pub const LARGE_BLOCK_BYTES: usize = 1 << 17;

/// A global allocator: large blocks from the pool, the rest from `A`. Install it in a binary:
///
/// ```
/// use tunestudio::mem::LargeBlockPool;
///
/// #[global_allocator]
/// static GLOBAL: LargeBlockPool<mimalloc::MiMalloc> = LargeBlockPool::new(mimalloc::MiMalloc);
/// # fn main() {}
/// ```
#[derive(Debug)]
pub struct LargeBlockPool<A> {
    small: A,
}

impl<A> LargeBlockPool<A> {
    /// A pool over `small`, the allocator of requests below [`LARGE_BLOCK_BYTES`].
    pub const fn new(small: A) -> Self {
        Self { small }
    }
}

/// Unmaps the free blocks the pool keeps (the studio calls it when a run ends, so the
/// resident set falls back to what the studio itself holds); returns the bytes released.
/// A no-op when the pool is not the global allocator.
pub fn release_free_blocks() -> u64 {
    imp::release_free_blocks()
}

/// Bytes of the free blocks the pool keeps mapped (0 when it is not installed).
pub fn free_block_bytes() -> u64 {
    imp::free_block_bytes()
}

#[cfg(target_os = "linux")]
fn pooled(layout: &Layout) -> bool {
    layout.size() >= LARGE_BLOCK_BYTES && layout.align() <= imp::PAGE_BYTES
}

#[cfg(not(target_os = "linux"))]
fn pooled(_layout: &Layout) -> bool {
    false
}

// SAFETY: a pointer is served by the pool exactly when its layout is `pooled`, and Rust hands
// `dealloc`/`realloc` the layout the block was allocated with, so every pointer returns to
// the allocator that made it. Pool blocks are page-aligned, which covers any `align` ≤ a page.
unsafe impl<A: GlobalAlloc> GlobalAlloc for LargeBlockPool<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if pooled(&layout) {
            imp::take(layout.size(), false)
        } else {
            // SAFETY: forwarded with the caller's layout.
            unsafe { self.small.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if pooled(&layout) {
            imp::take(layout.size(), true)
        } else {
            // SAFETY: forwarded with the caller's layout.
            unsafe { self.small.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if pooled(&layout) {
            // SAFETY: `ptr` came from `imp::take` (its layout is pooled).
            unsafe { imp::give_back(ptr) }
        } else {
            // SAFETY: `ptr` came from `small` with this layout.
            unsafe { self.small.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (all arms): `layout` is the block's, `new_size` is non-zero and does not
        // overflow when rounded to `layout.align()` (the caller's contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (pooled(&layout), pooled(&new_layout)) {
            (false, false) => unsafe { self.small.realloc(ptr, layout, new_size) },
            (true, true) => unsafe { imp::resize(ptr, new_size) },
            _ => {
                // Crossing the threshold: a new block from the other side and a copy.
                let new_ptr = unsafe { self.alloc(new_layout) };
                if !new_ptr.is_null() {
                    let keep = layout.size().min(new_size);
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new_ptr, keep);
                        self.dealloc(ptr, layout);
                    }
                }
                new_ptr
            }
        }
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::sync::Mutex;

    /// The first page of each mapping holds its length (the caller's bytes start one page
    /// in, page-aligned): 4 KiB on a block of at least 128 KiB, ≤ 3.1 %.
    pub(super) const PAGE_BYTES: usize = 4096;

    /// Free blocks kept at most; beyond it a freed block is unmapped (a step of SmolLM2-135M
    /// at micro-batch 4 allocates about 2,700 blocks of ≥ 1 MiB, most of them freed within
    /// the step and merged with their neighbours).
    const MAX_FREE_BLOCKS: usize = 1024;

    /// A page range the pool owns: one mapping, a piece cut from one, or neighbouring pieces
    /// merged; its start and its length in bytes (a multiple of the page).
    #[derive(Clone, Copy, Debug)]
    struct Block {
        start: usize,
        len: usize,
    }

    /// The free blocks, unordered (a scan of ≤ 1024 entries per large request is far below
    /// the cost of the tensor it serves). No allocation happens under the lock.
    struct FreeBlocks {
        blocks: [Block; MAX_FREE_BLOCKS],
        count: usize,
        /// The blocks' total length.
        bytes: usize,
    }

    static FREE: Mutex<FreeBlocks> = Mutex::new(FreeBlocks::new());

    fn lock() -> std::sync::MutexGuard<'static, FreeBlocks> {
        // Nothing under the lock panics; a poisoned lock still holds consistent entries.
        FREE.lock().unwrap_or_else(|e| e.into_inner())
    }

    impl FreeBlocks {
        const fn new() -> Self {
            Self {
                blocks: [Block { start: 0, len: 0 }; MAX_FREE_BLOCKS],
                count: 0,
                bytes: 0,
            }
        }

        fn remove(&mut self, i: usize) -> Block {
            let b = self.blocks[i];
            self.count -= 1;
            self.blocks[i] = self.blocks[self.count];
            self.bytes -= b.len;
            b
        }

        /// Adds a free block, merged with the free blocks right before and after it (pieces
        /// of one mapping that were split come back together). Returns the block back when
        /// the list is full.
        fn insert(&mut self, mut b: Block) -> Result<(), Block> {
            let mut i = 0;
            while i < self.count {
                let f = self.blocks[i];
                if f.start + f.len == b.start || b.start + b.len == f.start {
                    self.remove(i);
                    b = Block {
                        start: b.start.min(f.start),
                        len: b.len + f.len,
                    };
                } else {
                    i += 1;
                }
            }
            if self.count == MAX_FREE_BLOCKS {
                return Err(b);
            }
            self.blocks[self.count] = b;
            self.count += 1;
            self.bytes += b.len;
            Ok(())
        }

        /// The smallest free block of at least `len` bytes, cut to `len` when the rest is a
        /// block of its own (which stays free); else the largest smaller one, to be grown.
        fn best_for(&mut self, len: usize) -> Option<Block> {
            let free = &self.blocks[..self.count];
            let fits = (0..free.len())
                .filter(|&i| free[i].len >= len)
                .min_by_key(|&i| free[i].len);
            let Some(i) = fits else {
                let largest = (0..free.len()).max_by_key(|&i| free[i].len)?;
                return Some(self.remove(largest));
            };
            let b = self.remove(i);
            if b.len - len < super::LARGE_BLOCK_BYTES {
                return Some(b);
            }
            let rest = Block {
                start: b.start + len,
                len: b.len - len,
            };
            // A slot was just freed, so the rest always has one.
            let _ = self.insert(rest);
            Some(Block {
                start: b.start,
                len,
            })
        }
    }

    fn mapping_len(size: usize) -> usize {
        (size + PAGE_BYTES).div_ceil(PAGE_BYTES) * PAGE_BYTES
    }

    /// Writes the mapping's length into its first page and returns the caller's pointer.
    fn hand_out(b: Block) -> *mut u8 {
        let header = b.start as *mut usize;
        // SAFETY: `b.start` is a live, writable, page-aligned mapping of ≥ 2 pages.
        unsafe { header.write(b.len) };
        (b.start + PAGE_BYTES) as *mut u8
    }

    fn map_fresh(len: usize) -> Option<Block> {
        // SAFETY: an anonymous private mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(Block {
            start: p as usize,
            len,
        })
    }

    /// Grows a block to `len` bytes, moving its pages elsewhere when its neighbours are taken;
    /// its bytes are kept. Fails for a block merged from two kernel mappings (`mremap` works
    /// within one), and the callers fall back.
    fn remap(b: Block, len: usize) -> Option<Block> {
        // SAFETY: `b` is a page range the pool owns and nobody else uses; MREMAP_MAYMOVE lets
        // the kernel move its page tables, and no pointer into the old range is used after.
        let p = unsafe { libc::mremap(b.start as *mut _, b.len, len, libc::MREMAP_MAYMOVE) };
        (p != libc::MAP_FAILED).then_some(Block {
            start: p as usize,
            len,
        })
    }

    fn unmap(b: Block) {
        // SAFETY: `b` is a page range the pool owns and nothing points into it any more.
        unsafe { libc::munmap(b.start as *mut _, b.len) };
    }

    /// A block for `size` bytes: a free one that fits, else the largest free one grown, else
    /// a fresh mapping. `zeroed`: the caller's bytes must read as zero (fresh pages are).
    pub(super) fn take(size: usize, zeroed: bool) -> *mut u8 {
        let len = mapping_len(size);
        let reused = lock().best_for(len);
        let (block, dirty) = match reused {
            Some(b) if b.len >= len => (Some(b), true),
            Some(b) => match remap(b, len) {
                Some(grown) => (Some(grown), true),
                None => {
                    unmap(b);
                    (map_fresh(len), false)
                }
            },
            None => (map_fresh(len), false),
        };
        let Some(block) = block else {
            return std::ptr::null_mut();
        };
        let ptr = hand_out(block);
        if zeroed && dirty {
            // SAFETY: the block holds at least `size` bytes after the header page.
            unsafe { ptr.write_bytes(0, size) };
        }
        ptr
    }

    /// The mapping behind a pointer `take` returned.
    ///
    /// # Safety
    /// `ptr` must come from [`take`] or [`resize`] and not have been given back.
    unsafe fn block_of(ptr: *mut u8) -> Block {
        let start = ptr as usize - PAGE_BYTES;
        // SAFETY: the header page precedes every pointer the pool hands out.
        let len = unsafe { (start as *const usize).read() };
        Block { start, len }
    }

    /// Returns a block to the free list (or unmaps it when the list is full).
    ///
    /// # Safety
    /// As [`block_of`].
    pub(super) unsafe fn give_back(ptr: *mut u8) {
        // SAFETY: the caller's contract.
        let b = unsafe { block_of(ptr) };
        let full = lock().insert(b);
        if let Err(b) = full {
            unmap(b);
        }
    }

    /// Resizes a pool block in place when it is large enough, else with `mremap`.
    ///
    /// # Safety
    /// As [`block_of`].
    pub(super) unsafe fn resize(ptr: *mut u8, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract.
        let b = unsafe { block_of(ptr) };
        let len = mapping_len(new_size);
        if len <= b.len {
            return ptr;
        }
        if let Some(moved) = remap(b, len) {
            return hand_out(moved);
        }
        // `mremap` needs one kernel mapping; a block merged from two cannot move. Copy.
        let new_ptr = take(new_size, false);
        if !new_ptr.is_null() {
            // SAFETY: both blocks are live and hold at least the old block's bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new_ptr, b.len - PAGE_BYTES);
                give_back(ptr);
            }
        }
        new_ptr
    }

    pub(super) fn release_free_blocks() -> u64 {
        let mut released = 0;
        loop {
            let b = {
                let mut free = lock();
                if free.count == 0 {
                    break;
                }
                free.remove(0)
            };
            released += b.len as u64;
            unmap(b);
        }
        released
    }

    pub(super) fn free_block_bytes() -> u64 {
        lock().bytes as u64
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const MIB: usize = 1 << 20;

        fn block(start_mib: usize, len_mib: usize) -> Block {
            Block {
                start: start_mib * MIB,
                len: len_mib * MIB,
            }
        }

        #[test]
        fn the_smallest_fitting_block_is_cut_and_freed_pieces_merge() {
            let mut free = Box::new(FreeBlocks::new());
            // Two blocks far apart.
            free.insert(block(100, 8)).unwrap();
            free.insert(block(400, 20)).unwrap();
            assert_eq!(free.bytes, 28 * MIB);

            // 6 MiB come from the 8 MiB block; its last 2 MiB stay free.
            let c = free.best_for(6 * MIB).unwrap();
            assert_eq!((c.start, c.len), (100 * MIB, 6 * MIB));
            assert_eq!(free.bytes, 22 * MIB);
            // 7 MiB come from the 20 MiB block (the 2 MiB piece is too small).
            let z = free.best_for(7 * MIB).unwrap();
            assert_eq!((z.start, z.len), (400 * MIB, 7 * MIB));
            // Freed, the 7 MiB piece merges with the rest of its block.
            free.insert(z).unwrap();
            assert_eq!(free.count, 2);
            let whole = free.best_for(20 * MIB).unwrap();
            assert_eq!((whole.start, whole.len), (400 * MIB, 20 * MIB));
            free.insert(whole).unwrap();

            // Less than the threshold left over: the whole block is handed out.
            let snug = free.best_for(20 * MIB - 4096).unwrap();
            assert_eq!(snug.len, 20 * MIB);
            free.insert(snug).unwrap();

            // Nothing holds 30 MiB: the largest free block is handed out, to be grown.
            let grow = free.best_for(30 * MIB).unwrap();
            assert_eq!((grow.start, grow.len), (400 * MIB, 20 * MIB));
            assert_eq!(free.bytes, 2 * MIB);

            // Freed neighbours on both sides merge into one block.
            free.insert(block(98, 2)).unwrap();
            free.insert(c).unwrap();
            assert_eq!(free.count, 1);
            assert_eq!(
                (free.blocks[0].start, free.blocks[0].len),
                (98 * MIB, 10 * MIB)
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    // Never called: no layout is pooled off Linux.
    pub(super) fn take(_size: usize, _zeroed: bool) -> *mut u8 {
        std::ptr::null_mut()
    }

    pub(super) unsafe fn give_back(_ptr: *mut u8) {}

    pub(super) unsafe fn resize(_ptr: *mut u8, _new_size: usize) -> *mut u8 {
        std::ptr::null_mut()
    }

    pub(super) fn release_free_blocks() -> u64 {
        0
    }

    pub(super) fn free_block_bytes() -> u64 {
        0
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::alloc::System;

    fn mib(n: usize) -> Layout {
        Layout::from_size_align(n << 20, 64).expect("a valid layout")
    }

    fn filled(ptr: *mut u8, bytes: usize, value: u8) -> bool {
        // SAFETY: the tests read blocks they allocated with at least `bytes` bytes.
        unsafe { std::slice::from_raw_parts(ptr, bytes) }
            .iter()
            .all(|&b| b == value)
    }

    /// One test through the allocator interface: the pool's free list is process-wide, so
    /// its steps must not interleave with another test's (no other lib test allocates
    /// through a pool; the lib tests' global allocator is the system's). Where the kernel
    /// places the mappings is not up to the test, so it asserts only what holds wherever
    /// they land (the cutting and merging are tested on fixed addresses in `imp`).
    #[test]
    fn freed_large_blocks_serve_the_next_requests_and_keep_their_bytes() {
        let pool = LargeBlockPool::new(System);
        release_free_blocks();
        unsafe {
            // A freed block stays mapped and serves the next request of its size.
            let a = pool.alloc(mib(8));
            a.write_bytes(1, 8 << 20);
            pool.dealloc(a, mib(8));
            assert!(free_block_bytes() >= 8 << 20, "{}", free_block_bytes());
            let again = pool.alloc(mib(8));
            assert_eq!(again, a);
            assert_eq!(free_block_bytes(), 0);
            // A zeroed request on a reused block reads zero.
            pool.dealloc(again, mib(8));
            let z = pool.alloc_zeroed(mib(6));
            assert_eq!(z, a);
            assert!(filled(z, 6 << 20, 0));
            z.write_bytes(3, 6 << 20);

            // Growing a pooled block keeps its bytes; shrinking below the threshold copies
            // them into the small allocator's block.
            let big = pool.realloc(z, mib(6), 48 << 20);
            assert!(filled(big, 6 << 20, 3));
            let small = pool.realloc(big, mib(48), 64 << 10);
            assert!(filled(small, 64 << 10, 3));
            pool.dealloc(small, Layout::from_size_align(64 << 10, 64).unwrap());

            // Below the threshold, requests go to the inner allocator.
            let before = free_block_bytes();
            let tiny = Layout::from_size_align(4096, 8).unwrap();
            pool.dealloc(pool.alloc(tiny), tiny);
            assert_eq!(free_block_bytes(), before);

            // An alignment above a page goes to the inner allocator, which honours it.
            let wide = Layout::from_size_align(8 << 20, 1 << 16).unwrap();
            let w = pool.alloc(wide);
            assert_eq!(w as usize % (1 << 16), 0);
            pool.dealloc(w, wide);
        }
        let kept = free_block_bytes();
        assert!(
            kept >= 48 << 20,
            "the 48 MiB block (and the 2 MiB cut off it): {kept}"
        );
        assert_eq!(release_free_blocks(), kept);
        assert_eq!(free_block_bytes(), 0);
    }
}
