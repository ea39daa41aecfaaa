//! Gives the heap's free memory back to the OS when the engine goes idle.
//!
//! A finished sequence's caches are freed, but glibc keeps freed chunks in its arenas (one per
//! thread that allocated, up to 8 per core) and returns only the top of the main heap by
//! itself, so an idle server's RSS stayed at whatever the last burst's interleaving left
//! behind: the load test's RSS after a 60 s warm-up ranged 478-537 MiB between runs of the same
//! load with nothing leaked. `malloc_trim(0)` releases the free pages of every arena; it runs
//! only when the last sequence is done and the worker is about to wait for work, never inside a
//! decode step. Elsewhere (musl, macOS) this does nothing. The `kvq` binary allocates through
//! jemalloc, whose background thread returns freed pages by itself (decay); there this trims
//! only what C code left in glibc's heap, and matters for other embedders of the engine.

/// Returns free heap pages to the OS (glibc); a no-op on other C libraries.
pub(crate) fn free_heap_to_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes each arena's own lock and only releases pages of free chunks;
    // it touches no memory the program holds.
    unsafe {
        libc::malloc_trim(0);
    }
}
