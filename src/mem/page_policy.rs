//! The process's page policy for training: no transparent huge pages.
//!
//! Why: mimalloc advises `MADV_HUGEPAGE` on its arena, so where the kernel's THP mode is
//! `madvise` (Ubuntu's default) or `always` (RHEL's), the first touch of any byte in a 2 MiB
//! range makes all 2 MiB resident. The small objects a training step scatters then cost whole
//! huge pages that stay: on the demo, mimalloc's arena grew from 34 to 55 MiB resident over
//! 30 steps in 2 MiB increments (`/proc/<pid>/smaps`: every resident byte of it
//! `AnonHugePages`), so the whole run peaked 20–30 MiB above its second step and the plan
//! could not match both. With THP off the arena grows by 4 KiB pages only, the resident
//! set is the same on a `madvise` host and an `always` host, and nothing was measured slower:
//! SmolLM2-135M `bench` 133–164 tokens/s against 136–148 with THP (three rounds each), and
//! tokenising 50,000 Alpaca rows (`tunestudio preview`) 7.7–9.5 s with the binary's whole
//! setting (THP off, mimalloc purging) against 9.4–11.7 s with THP and no purging.

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`): the
/// kernel checks the flag at each page fault, so it holds for mappings made before the call
/// too (mimalloc's arena). Returns whether the kernel accepted it. A no-op off Linux.
pub fn disable_transparent_huge_pages() -> bool {
    imp::disable_transparent_huge_pages()
}

#[cfg(target_os = "linux")]
mod imp {
    pub(super) fn disable_transparent_huge_pages() -> bool {
        // SAFETY: PR_SET_THP_DISABLE takes an integer flag and no pointers; it only changes
        // how later page faults of this process are served.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0 }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn disable_transparent_huge_pages() -> bool {
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// The flag is set and reads back (a test binary is its own process; THP only changes
    /// how pages are served, so the rest of the suite is unaffected).
    #[test]
    fn huge_pages_are_off_after_the_call() {
        assert!(super::disable_transparent_huge_pages());
        // SAFETY: PR_GET_THP_DISABLE takes no pointers; it returns the flag.
        let flag = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(flag, 1);
    }
}
