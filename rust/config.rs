//! Every tunable of the core in one place: timeouts, message-size thresholds, segment sizes, and the
//! environment knobs, which are read here and nowhere else.

use std::time::Duration;

/// Default for how long any wait lasts before it fails: finite, and long enough for slow first steps.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest timeout accepted (about 31 years): `Instant + Duration` must never overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// In the in-process world, all-reduces up to this many bytes travel inside the rendezvous page.
pub const INLINE: usize = 256;

/// Point-to-point messages up to this size are sent eagerly (copied; the send returns at once).
pub const EAGER: usize = 64 * 1024;

/// Default bytes of segment arrays (`alloc`, `ProcessGroup.empty`) per rank in the shm world.
pub const DEFAULT_ARENA: usize = 64 << 20;

/// `AXONML_SHM_CHUNK_KIB`: the shm world's pipeline round size for large messages on private arrays,
/// a tuning knob for benchmarks (rank 0's value counts; the others learn it from the segment header).
pub fn shm_chunk_from_env() -> Option<usize> {
    std::env::var("AXONML_SHM_CHUNK_KIB").ok()?.parse::<usize>().ok()?.checked_mul(1024)
}
