//! The job's shared-memory segment: its layout, header, and how it is created, attached and checked.
//!
//! ```text
//! header page   magic, version, layout params, nonce, abort word, per-rank pids
//! comm table    MAX_COMMS slots: key (members, occurrence), event, one control block per world rank
//! channels      one send/recv channel per ordered pair of ranks: control lines + 2 cells
//! staging       one block per (communicator, member): 2 small one-shot slots + 2 pipeline buffers
//! arenas        one per rank: memory handed out by `alloc` (segment arrays)
//! ```
//! Everything is offsets from the segment start (peers map it at other addresses), and every rank
//! recomputes the layout from the header's parameters and checks it against the file size before use.

use std::cell::UnsafeCell;
use std::io::{self, Read};
use std::mem::size_of;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crossbeam_utils::CachePadded;
use rustix::fs::{FallocateFlags, FileType, Mode};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm;

use crate::error::{Error, Result};
use crate::transport::wait::Event;

/// "AXONSHM" + format generation, little endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"AXONSHM1");
/// Bumped whenever the layout or protocol changes.
pub(crate) const VERSION: u32 = 1;
/// Ranks per world: group membership is a 64-bit mask.
pub const MAX_RANKS: usize = 64;
/// Communicators per job (the world plus subgroups; slots are never freed).
pub(crate) const MAX_COMMS: usize = 32;
/// Bytes of an abort reason kept in the header.
pub(crate) const REASON: usize = 448;
const PAGE: usize = 4096;

/// The sizes that determine the layout. Chosen by rank 0, stored in the header, checked by everyone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Params {
    /// Ranks in the world.
    pub world: usize,
    /// Bytes per pipeline round of a staged collective (one buffer; two per member).
    pub chunk: usize,
    /// Largest all_reduce sent one-shot (one slot; two per member).
    pub small: usize,
    /// Bytes of each rank's arena for segment arrays.
    pub arena: usize,
    /// Bytes per send/recv cell (two per ordered pair of ranks).
    pub cell: usize,
    /// Staging blocks for subgroups, handed out as slots are claimed.
    pub pool: usize,
}

impl Params {
    /// Defaults for `world` ranks, with `arena` bytes of segment arrays per rank. Staging grows with
    /// the world (a block per member and communicator, a channel per pair), so large worlds get
    /// smaller buffers to keep the segment within a few hundred MiB.
    pub(crate) fn new(world: usize, arena: usize) -> Params {
        let large = world > 8;
        Params {
            world,
            chunk: if large {
                (world * 4096).max(256 << 10)
            } else {
                1 << 20
            },
            small: if large { 16 << 10 } else { 64 << 10 },
            arena: arena.div_ceil(PAGE) * PAGE,
            cell: if large { 8 << 10 } else { 64 << 10 },
            pool: if large { world } else { 2 * world.max(2) },
        }
    }

    fn check(&self) -> std::result::Result<(), String> {
        let pow2_pages = |x: usize| x >= PAGE && x % PAGE == 0;
        if !(1..=MAX_RANKS).contains(&self.world) {
            return Err(format!("world size {} (1..={MAX_RANKS})", self.world));
        }
        if !pow2_pages(self.chunk) || self.chunk > 256 << 20 || self.chunk / self.world < 4096 {
            return Err(format!("pipeline chunk {} bytes", self.chunk));
        }
        if !pow2_pages(self.small) || self.small > self.chunk {
            return Err(format!("one-shot slot {} bytes", self.small));
        }
        if !pow2_pages(self.cell) || self.cell > 64 << 20 {
            return Err(format!("send/recv cell {} bytes", self.cell));
        }
        if self.arena % PAGE != 0 || self.arena > 1 << 40 || self.pool > 4096 {
            return Err(format!("arena {} / pool {}", self.arena, self.pool));
        }
        Ok(())
    }
}

/// Where everything is, in bytes from the segment start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub params: Params,
    pub comms: usize,
    pub comm_stride: usize,
    pub chans: usize,
    pub chan_stride: usize,
    pub staging: usize,
    pub block: usize,
    pub arenas: usize,
    pub total: usize,
}

fn up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Layout {
    /// The layout for `params`, or why they are unusable.
    pub(crate) fn new(params: Params) -> std::result::Result<Layout, String> {
        params.check()?;
        let w = params.world;
        let comms = up(size_of::<Header>(), PAGE);
        let comm_stride = up(size_of::<CommHead>() + w * size_of::<Ctrl>(), 128);
        let chans = up(comms + MAX_COMMS * comm_stride, PAGE);
        let chan_stride = up(size_of::<ChanHead>(), PAGE) + 2 * params.cell;
        let staging = chans + w * w * chan_stride;
        let block = 2 * params.small + 2 * params.chunk;
        let arenas = staging + (w + params.pool) * block;
        let total = arenas + w * params.arena;
        Ok(Layout {
            params,
            comms,
            comm_stride,
            chans,
            chan_stride,
            staging,
            block,
            arenas,
            total,
        })
    }

    /// A number that changes whenever the shape of the shared structs does, so two builds that
    /// disagree on them refuse each other's segments.
    pub(crate) fn shape_hash() -> u64 {
        [
            size_of::<Header>(),
            size_of::<CommHead>(),
            size_of::<Ctrl>(),
            size_of::<ChanHead>(),
            size_of::<Page>(),
        ]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &s| {
            (h ^ s as u64).wrapping_mul(0x100_0000_01b3)
        })
    }
}

/// The first bytes of the segment. Fields above `attached` are written once by the creator before
/// anyone else can open the segment; the rest are atomics (or, for the abort reason, written once by
/// the rank that wins the abort, before it publishes `abort_state = 2`).
#[repr(C)]
pub(crate) struct Header {
    pub magic: u64,
    pub version: u32,
    pub world: u32,
    pub uid: u32,
    pub creator: u32,
    pub nonce: [u8; 16],
    pub total: u64,
    pub shape: u64,
    pub chunk: u64,
    pub small: u64,
    pub arena: u64,
    pub cell: u64,
    pub pool: u64,
    /// Ranks that have attached (the creator counts).
    pub attached: AtomicU32,
    /// 0: running; 1: an abort is being recorded; 2: aborted (reason readable).
    pub abort_state: AtomicU32,
    pub abort_by: AtomicU32,
    /// The dead peer when the abort reports one, else `u32::MAX`.
    pub abort_peer: AtomicU32,
    pub abort_len: AtomicU32,
    /// Next free subgroup staging block.
    pub pool_next: AtomicU32,
    /// When a timeout aborted the world: the ranks that never arrived (bitmask), else 0.
    pub abort_missing: AtomicU64,
    pub abort_reason: UnsafeCell<[u8; REASON]>,
    pub event: Event,
    pub pids: [AtomicU32; MAX_RANKS],
}

/// A communicator slot: free, being claimed, or bound to (members, occurrence).
#[repr(C)]
pub(crate) struct CommHead {
    /// 0 free, 1 being claimed, 2 ready.
    pub state: AtomicU32,
    pub occurrence: AtomicU32,
    pub members: AtomicU64,
    /// First staging block of its members (block + group index), or `u32::MAX` when none was left.
    pub first_block: AtomicU32,
    pub event: Event,
}

/// What a member publishes for one collective (page `k % 2` for call k). Plain numbers only: peers
/// decode and bounds-check them, never trust them as pointers.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct Page {
    /// The encoded signature (see `wire`).
    pub sig: [u64; 4],
    /// Offsets of the member's send and receive buffers in the segment, or `NOT_SHARED`.
    pub send: u64,
    pub recv: u64,
}

/// A buffer that does not live in the segment.
pub(crate) const NOT_SHARED: u64 = u64::MAX;

/// One member's control block in a communicator slot. Counters are monotonic over the slot's life.
#[repr(C)]
pub(crate) struct Ctrl {
    /// Sequence number of the last collective this member entered (its page is published).
    pub arrive: CachePadded<AtomicU64>,
    /// Sequence number of the last collective whose shared buffers this member no longer touches.
    pub done: CachePadded<AtomicU64>,
    /// Pipeline steps completed (three per staged round).
    pub step: CachePadded<AtomicU64>,
    pub pages: [CachePadded<UnsafeCell<Page>>; 2],
}

/// The control lines of one ordered pair's channel. The sender writes `tag`/`dtype`/`count` and then
/// `posted`; the receiver answers; data moves through the two cells that follow.
#[repr(C)]
pub(crate) struct ChanHead {
    pub posted: CachePadded<AtomicU64>,
    /// `m << 1 | refused` for the receiver's answer to message m.
    pub answer: CachePadded<AtomicU64>,
    pub filled: CachePadded<AtomicU64>,
    pub drained: CachePadded<AtomicU64>,
    pub meta: CachePadded<UnsafeCell<[u64; 3]>>,
    pub event: Event,
}

/// A mapping of the whole segment into this process.
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics or through ranges the
// protocol gives to one writer at a time.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` came from one successful mmap, and nothing borrowed from it outlives the
        // mapping (everything holding pointers into it holds an Arc on its owner).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl Mapping {
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: every mapping is at least one header long (checked before mapping) and page aligned.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }
}

fn refuse(name: &str, kind: io::ErrorKind, what: String) -> Error {
    Error::os(
        format!("refusing shared-memory segment {name}: {what}"),
        io::Error::from(kind),
    )
}

fn os(what: String) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::os(what, e.into())
}

/// Check that an open segment is a regular file of ours, unreadable to others; returns its size.
fn check_file(fd: &rustix::fd::OwnedFd, name: &str) -> Result<usize> {
    let st = rustix::fs::fstat(fd).map_err(os(format!("fstat of {name}")))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(refuse(
            name,
            io::ErrorKind::InvalidInput,
            "not a regular file".into(),
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(refuse(
            name,
            io::ErrorKind::PermissionDenied,
            format!("owned by uid {}, not by us (uid {me})", st.st_uid),
        ));
    }
    if st.st_mode & 0o077 != 0 {
        return Err(refuse(
            name,
            io::ErrorKind::PermissionDenied,
            format!(
                "mode {:o} gives other users access (expected 600)",
                st.st_mode & 0o777
            ),
        ));
    }
    usize::try_from(st.st_size)
        .map_err(|_| refuse(name, io::ErrorKind::InvalidData, "negative size".into()))
}

fn map(fd: &rustix::fd::OwnedFd, len: usize, name: &str) -> Result<Mapping> {
    // SAFETY: a fresh shared mapping of a file we opened read-write; nothing else is placed there.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(os(format!("mapping {name} ({len} bytes)")))?;
    Ok(Mapping {
        base: NonNull::new(p.cast()).expect("mmap never returns null on success"),
        len,
    })
}

/// A random segment name: the name is the only secret between the ranks and other users' processes.
pub(crate) fn random_name() -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::os("reading /dev/urandom", e))?;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "/axonml-{}-{hex}",
        rustix::process::geteuid().as_raw()
    ))
}

/// 16 random bytes: the session nonce every attacher must present.
pub(crate) fn nonce() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::os("reading /dev/urandom", e))?;
    Ok(b)
}

/// Remove a segment name (the mapping stays valid for everyone who has it).
pub(crate) fn unlink(name: &str) {
    // Already gone is fine: the launcher may have cleaned it up.
    let _ = shm::unlink(name);
}

/// Create a segment exclusively under `name`, reserve its memory and write its header.
/// On any failure the name is removed again.
pub(crate) fn create(name: &str, layout: &Layout, nonce: [u8; 16]) -> Result<Mapping> {
    let fd = shm::open(
        name,
        shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|e| {
        if e == rustix::io::Errno::EXIST {
            refuse(
                name,
                io::ErrorKind::AlreadyExists,
                "the name already exists (a stale segment of a crashed job with the same AXONML_JOB_ID, \
                 or someone else's file); remove it from /dev/shm or use a new job id"
                    .into(),
            )
        } else {
            Error::os(format!("creating shared-memory segment {name}"), e.into())
        }
    })?;
    let made = (|| {
        check_file(&fd, name)?;
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, layout.total as u64).map_err(os(
            format!(
                "reserving {} MiB for {name} in /dev/shm (too small? lower AXONML_SHM_ARENA_MB, or give \
             containers more: --shm-size)",
                layout.total >> 20
            ),
        ))?;
        let m = map(&fd, layout.total, name)?;
        // SAFETY: the fresh file is zero-filled (so every atomic starts at 0), and no one else can open
        // it before we send its name; the header fits in the first page.
        unsafe {
            let h = m.base().cast::<Header>();
            (*h).magic = MAGIC;
            (*h).version = VERSION;
            (*h).world = layout.params.world as u32;
            (*h).uid = rustix::process::geteuid().as_raw();
            (*h).creator = rustix::process::getpid().as_raw_nonzero().get() as u32;
            (*h).nonce = nonce;
            (*h).total = layout.total as u64;
            (*h).shape = Layout::shape_hash();
            (*h).chunk = layout.params.chunk as u64;
            (*h).small = layout.params.small as u64;
            (*h).arena = layout.params.arena as u64;
            (*h).cell = layout.params.cell as u64;
            (*h).pool = layout.params.pool as u64;
            (*h).abort_peer
                .store(u32::MAX, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(m)
    })();
    if made.is_err() {
        unlink(name);
    }
    made
}

/// Open an existing segment (never creating one) and check everything before trusting it.
pub(crate) fn attach(name: &str, world: usize, nonce: [u8; 16]) -> Result<(Mapping, Layout)> {
    let fd = shm::open(name, shm::OFlags::RDWR, Mode::empty())
        .map_err(os(format!("opening shared-memory segment {name}")))?;
    let size = check_file(&fd, name)?;
    if size < size_of::<Header>() {
        return Err(refuse(
            name,
            io::ErrorKind::InvalidData,
            format!("only {size} bytes long"),
        ));
    }
    let m = map(&fd, size, name)?;
    let layout = validate(m.header(), size, world, nonce)
        .map_err(|what| refuse(name, io::ErrorKind::InvalidData, what))?;
    Ok((m, layout))
}

/// Check a header against what this rank expects; returns the layout it describes.
pub(crate) fn validate(
    h: &Header,
    size: usize,
    world: usize,
    nonce: [u8; 16],
) -> std::result::Result<Layout, String> {
    if h.magic != MAGIC {
        return Err("not an axonml segment (bad magic)".into());
    }
    if h.version != VERSION || h.shape != Layout::shape_hash() {
        return Err(format!(
            "made by another version of axonml-distributed (format {}, ours {VERSION})",
            h.version
        ));
    }
    if h.nonce != nonce {
        return Err("session nonce differs: a stale segment or another job's".into());
    }
    if h.world as usize != world {
        return Err(format!("made for {} ranks, this job has {world}", h.world));
    }
    let params = Params {
        world,
        chunk: h.chunk as usize,
        small: h.small as usize,
        arena: h.arena as usize,
        cell: h.cell as usize,
        pool: h.pool as usize,
    };
    let layout = Layout::new(params).map_err(|p| format!("bad layout parameter: {p}"))?;
    if layout.total != size || h.total as usize != size {
        return Err(format!(
            "size {size} does not match its layout ({} bytes)",
            layout.total
        ));
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_for(layout: &Layout, nonce: [u8; 16]) -> Box<Header> {
        // SAFETY: all-zero is a valid Header (integers, atomics, byte arrays).
        let mut h: Box<Header> = Box::new(unsafe { std::mem::zeroed() });
        h.magic = MAGIC;
        h.version = VERSION;
        h.world = layout.params.world as u32;
        h.nonce = nonce;
        h.total = layout.total as u64;
        h.shape = Layout::shape_hash();
        h.chunk = layout.params.chunk as u64;
        h.small = layout.params.small as u64;
        h.arena = layout.params.arena as u64;
        h.cell = layout.params.cell as u64;
        h.pool = layout.params.pool as u64;
        h
    }

    #[test]
    fn layout_regions_are_ordered_aligned_and_disjoint() {
        for w in [1, 2, 3, 4, 8, 64] {
            let l = Layout::new(Params::new(w, 3 << 20)).unwrap();
            assert!(size_of::<Header>() <= l.comms);
            assert!(l.comms + MAX_COMMS * l.comm_stride <= l.chans);
            assert!(l.chans + w * w * l.chan_stride <= l.staging);
            assert_eq!(l.staging + (w + l.params.pool) * l.block, l.arenas);
            assert_eq!(l.arenas + w * l.params.arena, l.total);
            for off in [
                l.comms,
                l.chans,
                l.chan_stride,
                l.staging,
                l.block,
                l.arenas,
                l.total,
            ] {
                assert_eq!(off % PAGE, 0, "w={w}");
            }
            assert_eq!(l.comm_stride % 128, 0);
        }
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(Layout::new(Params::new(0, 0)).is_err());
        assert!(Layout::new(Params::new(MAX_RANKS + 1, 0)).is_err());
        let mut p = Params::new(2, 0);
        p.chunk = 1000;
        assert!(Layout::new(p).is_err());
        let mut p = Params::new(2, 0);
        p.small = p.chunk * 2;
        assert!(Layout::new(p).is_err());
    }

    #[test]
    fn header_validation_names_what_is_wrong() {
        let layout = Layout::new(Params::new(2, PAGE)).unwrap();
        let nonce = [7; 16];
        let h = header_for(&layout, nonce);
        assert_eq!(validate(&h, layout.total, 2, nonce), Ok(layout));

        let mut bad = header_for(&layout, nonce);
        bad.magic ^= 1;
        assert!(validate(&bad, layout.total, 2, nonce)
            .unwrap_err()
            .contains("magic"));
        let mut bad = header_for(&layout, nonce);
        bad.version += 1;
        assert!(validate(&bad, layout.total, 2, nonce)
            .unwrap_err()
            .contains("version"));
        assert!(validate(&h, layout.total, 2, [8; 16])
            .unwrap_err()
            .contains("nonce"));
        assert!(validate(&h, layout.total, 3, nonce)
            .unwrap_err()
            .contains("2 ranks"));
        assert!(validate(&h, layout.total + PAGE, 2, nonce)
            .unwrap_err()
            .contains("size"));
        let mut bad = header_for(&layout, nonce);
        bad.chunk = 12345;
        assert!(validate(&bad, layout.total, 2, nonce)
            .unwrap_err()
            .contains("layout"));
    }
}
