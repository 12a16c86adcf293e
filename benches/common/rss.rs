//! Resident set size (RSS) of this process: current, peak, and a way to
//! measure the peak of one stretch of a run.
//!
//! Read from `/proc/self/status` (Linux): `VmRSS` is the memory the process
//! has in RAM now, `VmHWM` ("high water mark") the most it had at any time.
//! Writing `5` to `/proc/self/clear_refs` resets `VmHWM` to the current RSS
//! (Linux 4.0 and later), so [`Window`] can report the peak of one stretch
//! rather than of the whole process. On other systems, or where the kernel
//! refuses the write (some sandboxes), every reading is `None` or the reset
//! reports failure, and callers print "n/a" rather than a wrong number.
//!
//! What these numbers are, and are not:
//! - **RSS is not the heap.** It counts pages touched and still mapped:
//!   the heap, but also thread stacks, the binary, shared libraries and
//!   allocator metadata; and a page counts as soon as one byte of it is
//!   touched. The counting allocators in the benches give the heap itself.
//! - **Allocators retain freed memory.** glibc's `malloc` keeps most freed
//!   memory for reuse instead of returning it to the kernel, so after a big
//!   structure is dropped RSS stays high, and the next structure built in
//!   the same process can reuse those pages without RSS growing at all.
//!   [`release_free_memory`] (`malloc_trim(0)` on glibc) hands free pages
//!   back first; [`Window::start`] calls it. A figure that must not depend on
//!   what ran before is best taken in a fresh process (`fanout_1m` does).
//! - **The kernel's counters are approximate.** RSS is kept in per-CPU
//!   counters and may lag by a few dozen pages (a few hundred KiB), so
//!   growths under about a megabyte are noise.
//! - `VmHWM` is a maximum over sampled states: the kernel folds the current
//!   RSS into it when it is read and before it unmaps memory, so a peak that
//!   was given back with `munmap`/`madvise` is still seen.

#![allow(dead_code)] // each bench target uses a different part of this module

/// Memory readings of this process, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rss {
    /// `VmRSS`: resident now.
    pub current: u64,
    /// `VmHWM`: the most resident since the process started or the peak was
    /// last reset.
    pub peak: u64,
}

/// Both readings at once; `None` where `/proc/self/status` is unavailable.
pub fn read() -> Option<Rss> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some(Rss {
        current: field_kib(&status, "VmRSS:")? * 1024,
        peak: field_kib(&status, "VmHWM:")? * 1024,
    })
}

/// Resident bytes now (`VmRSS`).
pub fn current() -> Option<u64> {
    read().map(|r| r.current)
}

/// The peak resident bytes (`VmHWM`).
pub fn peak() -> Option<u64> {
    read().map(|r| r.peak)
}

/// Resets the peak to the current RSS. Returns whether the kernel did it;
/// on failure the peak stays the whole process's.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Asks the allocator to return free memory to the kernel, so that RSS
/// afterwards reflects memory in use rather than memory kept for reuse
/// (`malloc_trim(0)` with glibc; nothing elsewhere). Returns whether
/// anything was released.
#[allow(unsafe_code)]
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: malloc_trim takes no pointers and only reorganises the
        // allocator's free lists; the Rust global allocator (System, or a
        // counting wrapper around it) is this same malloc.
        unsafe { malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The RSS growth of one stretch of a run: started with [`Window::start`],
/// read with [`Window::peak_growth`] and [`Window::current_growth`].
#[derive(Clone, Copy, Debug)]
pub struct Window {
    baseline: Option<u64>,
    peak_was_reset: bool,
}

impl Window {
    /// Releases free memory to the kernel, resets the peak, and records the
    /// current RSS as the baseline.
    pub fn start() -> Self {
        release_free_memory();
        let peak_was_reset = reset_peak();
        Self {
            baseline: current(),
            peak_was_reset,
        }
    }

    /// The RSS the window started from.
    pub fn baseline(&self) -> Option<u64> {
        self.baseline
    }

    /// How far the peak RSS rose above the baseline since the window
    /// started; `None` if the peak could not be reset (the process's peak
    /// would then include earlier stretches) or RSS cannot be read.
    pub fn peak_growth(&self) -> Option<u64> {
        if !self.peak_was_reset {
            return None;
        }
        Some(peak()?.saturating_sub(self.baseline?))
    }

    /// How far RSS is now above the baseline.
    pub fn current_growth(&self) -> Option<u64> {
        Some(current()?.saturating_sub(self.baseline?))
    }
}

/// Bytes for a table, in decimal megabytes: "48.9 MB"; "n/a" for `None`.
pub fn format_mb(bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!("{:.1} MB", b as f64 / 1e6),
        None => "n/a".to_owned(),
    }
}

/// The value of a `Name:   1234 kB` line of `/proc/self/status`, in KiB.
fn field_kib(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with(name))?;
    line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}
