//! The job's shared-memory segment as a file: created exclusively, reserved, mapped, attached and
//! checked before anyone trusts it (its contents: `layout`).

use std::mem::size_of;
use std::ptr::NonNull;

use rustix::fs::{FallocateFlags, FileType, Mode};
use rustix::io::Errno;
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
use rustix::shm;

use super::layout::{Header, Layout, Params, MAGIC, PAGE, VERSION};
use crate::error::{Error, Result};

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
    /// Make `range` (page aligned, inside the mapping) read-only, or writable again, in this process
    /// only: each rank maps what only its peers write read-only, so a stray write faults at once.
    pub(crate) fn protect(&self, range: std::ops::Range<usize>, writable: bool) -> Result<()> {
        assert!(
            range.start.is_multiple_of(PAGE) && range.end.is_multiple_of(PAGE) && range.end <= self.len,
            "{range:?}"
        );
        let flags = if writable { MprotectFlags::READ | MprotectFlags::WRITE } else { MprotectFlags::READ };
        // SAFETY: the range lies inside our mapping; read-only parts are never written by this process
        // (only their owner writes them, through its own mapping).
        unsafe { rustix::mm::mprotect(self.base().add(range.start).cast(), range.len(), flags) }
            .map_err(os(format!("protecting bytes {range:?} of the segment")))
    }
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: every mapping is at least one header long (checked before mapping) and page aligned.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }
}

/// A segment we will not use, with the errno that says why (`Errno::LOOP`, `ACCESS`, ...), so Python
/// raises the matching `OSError` subclass with a real `errno`.
fn refuse(name: &str, errno: Errno, what: String) -> Error {
    Error::os(format!("refusing shared-memory segment {name}: {what}"), errno.into())
}

fn os(what: String) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::os(what, e.into())
}

/// `shm::open` that never follows a symbolic link planted under the segment's name (`ELOOP` then).
/// `shm::OFlags` has no `NOFOLLOW`; it passes unnamed bits through to `open(2)`.
fn open_nofollow(name: &str, flags: shm::OFlags, mode: Mode) -> rustix::io::Result<rustix::fd::OwnedFd> {
    let nofollow = shm::OFlags::from_bits_retain(rustix::fs::OFlags::NOFOLLOW.bits());
    shm::open(name, flags | nofollow, mode)
}

/// The error for a failed open of segment `name` (`doing`: what we were doing).
fn open_error<'a>(name: &'a str, doing: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error + 'a {
    move |e| {
        if e == Errno::LOOP {
            refuse(name, Errno::LOOP, "it is a symbolic link".into())
        } else {
            Error::os(format!("{doing} shared-memory segment {name}"), e.into())
        }
    }
}

/// Check that an open segment is a regular file of ours, unreadable to others; returns its size.
fn check_file(fd: &rustix::fd::OwnedFd, name: &str) -> Result<usize> {
    let st = rustix::fs::fstat(fd).map_err(os(format!("fstat of {name}")))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(refuse(name, Errno::INVAL, "not a regular file".into()));
    }
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(refuse(name, Errno::PERM, format!("owned by uid {}, not by us (uid {me})", st.st_uid)));
    }
    if st.st_mode & 0o077 != 0 {
        return Err(refuse(
            name,
            Errno::ACCESS,
            format!("mode {:o} gives other users access (expected 600)", st.st_mode & 0o777),
        ));
    }
    usize::try_from(st.st_size).map_err(|_| refuse(name, Errno::BADMSG, "negative size".into()))
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
    Ok(Mapping { base: NonNull::new(p.cast()).expect("mmap never returns null on success"), len })
}

/// How every segment name starts (`/axonml-<uid>-<job id or random hex>`).
pub const PREFIX: &str = "/axonml-";

/// Where the kernel shows named segments as files (a segment `name` is the file `DIR` + `name`).
pub const DIR: &str = "/dev/shm";

/// The segment name of this user (its effective uid, which names the file's owner too) for `suffix`
/// (a job id, or random hex).
pub fn name_for(suffix: &str) -> String {
    format!("{PREFIX}{}-{suffix}", rustix::process::geteuid().as_raw())
}

/// Whether a name received from a peer or a store may be a segment's: [`PREFIX`] and then only what
/// [`name_for`] writes (a uid, a job id or hex: letters, digits, '-', '_'), so never a path elsewhere.
pub(crate) fn plausible_name(name: &str) -> bool {
    name.len() < 250
        && name.strip_prefix(PREFIX).is_some_and(|rest| {
            !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// A random segment name: it keeps a job's segment apart from other jobs of the same user (the
/// file's mode keeps other users out).
pub(crate) fn random_name() -> Result<String> {
    let hex: String = crate::rendezvous::secret::random::<16>()?.iter().map(|x| format!("{x:02x}")).collect();
    Ok(name_for(&hex))
}

/// Create a segment under a fresh random name (see [`create`]). A random name collides only with a
/// planted file: then try another rather than use it.
pub(crate) fn create_random(layout: &Layout, nonce: [u8; 16]) -> Result<(String, Mapping)> {
    let mut tries = 0;
    loop {
        let name = random_name()?;
        match create(&name, layout, nonce) {
            Ok(m) => return Ok((name, m)),
            Err(Error::Os { source, .. })
                if tries < 4 && source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                tries += 1
            }
            Err(e) => return Err(e),
        }
    }
}

/// Remove a segment name (the mapping stays valid for everyone who has it).
pub(crate) fn unlink(name: &str) {
    // Already gone is fine: the launcher may have cleaned it up.
    let _ = shm::unlink(name);
}

/// Create a segment exclusively under `name`, reserve its memory and write its header.
/// On any failure the name is removed again.
pub(crate) fn create(name: &str, layout: &Layout, nonce: [u8; 16]) -> Result<Mapping> {
    let flags = shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR;
    // O_EXCL alone already refuses an existing name, symbolic links included; NOFOLLOW makes it explicit.
    let fd = open_nofollow(name, flags, Mode::RUSR | Mode::WUSR).map_err(|e| {
        if e == Errno::EXIST {
            refuse(
                name,
                Errno::EXIST,
                "the name already exists (a stale segment of a crashed job with the same AXONML_JOB_ID, \
                 or someone else's file); remove it from /dev/shm or use a new job id"
                    .into(),
            )
        } else {
            open_error(name, "creating")(e)
        }
    })?;
    let made = (|| {
        check_file(&fd, name)?;
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, layout.total as u64).map_err(os(format!(
            "reserving {} MiB for {name} in /dev/shm (too small? lower AXONML_SHM_ARENA_MB, or give \
             containers more: --shm-size)",
            layout.total >> 20
        )))?;
        let m = map(&fd, layout.total, name)?;
        // SAFETY: the fresh file is zero-filled (so every atomic starts at 0), and no one else can open
        // it before we send its name; the header fits in the first page.
        unsafe { (*m.base().cast::<Header>()).init(layout, nonce) };
        Ok(m)
    })();
    if made.is_err() {
        unlink(name);
    }
    made
}

/// Open an existing segment (never creating one) and check everything before trusting it.
pub(crate) fn attach(name: &str, world: usize, nonce: [u8; 16]) -> Result<(Mapping, Layout)> {
    let fd = open_nofollow(name, shm::OFlags::RDWR, Mode::empty()).map_err(open_error(name, "opening"))?;
    let size = check_file(&fd, name)?;
    if size < size_of::<Header>() {
        return Err(refuse(name, Errno::BADMSG, format!("only {size} bytes long")));
    }
    let m = map(&fd, size, name)?;
    let layout =
        validate(m.header(), size, world, nonce).map_err(|what| refuse(name, Errno::BADMSG, what))?;
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
    if h.total != size as u64 {
        return Err(format!(
            "its header records {} bytes, but the file has {size} (truncated or corrupted)",
            h.total
        ));
    }
    if layout.total != size {
        return Err(format!(
            "the file has {size} bytes, but the layout its header describes needs {} (corrupted header?)",
            layout.total
        ));
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_for(layout: &Layout, nonce: [u8; 16]) -> Box<Header> {
        let mut h = Header::zeroed();
        h.init(layout, nonce);
        h
    }

    /// Names from peers and stores are what `name_for` writes: no path, no control or other characters
    /// (a NUL, a newline or a dot used to pass as long as no '/' followed the first).
    #[test]
    fn plausible_names_are_what_name_for_writes() {
        assert!(plausible_name(&name_for("job-1_a")) && plausible_name(&random_name().unwrap()));
        for bad in [
            "/axonml-",
            "axonml-1-x",
            "/axonml-1/x",
            "/axonml-1-\0",
            "/axonml-1-x\n",
            "/axonml-..",
            "/axonml-é",
        ] {
            assert!(!plausible_name(bad), "{bad:?}");
        }
        assert!(!plausible_name(&format!("{PREFIX}{}", "a".repeat(250))));
    }

    #[test]
    fn segments_behind_symbolic_links_are_refused() {
        let name = format!("/axonml-test-link-{}", std::process::id());
        let target = std::env::temp_dir().join(format!("axonml-link-target-{}", std::process::id()));
        std::fs::write(&target, [0u8; 64]).unwrap();
        let link = format!("{DIR}{name}");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let attached = attach(&name, 2, [0; 16]).err().map(|e| e.to_string());
        let layout = Layout::new(Params::new(1, PAGE)).unwrap();
        let created = create(&name, &layout, [0; 16]).err().map(|e| e.to_string());
        let still_there = std::fs::symlink_metadata(&link).is_ok();
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_file(&target);
        assert!(attached.as_deref().is_some_and(|e| e.contains("symbolic link")), "{attached:?}");
        assert!(created.as_deref().is_some_and(|e| e.contains("already exists")), "{created:?}");
        assert!(still_there, "a refused create leaves someone else's name alone");
    }

    #[test]
    fn header_validation_names_what_is_wrong() {
        let layout = Layout::new(Params::new(2, PAGE)).unwrap();
        let nonce = [7; 16];
        let h = header_for(&layout, nonce);
        assert_eq!(validate(&h, layout.total, 2, nonce), Ok(layout));

        let mut bad = header_for(&layout, nonce);
        bad.magic ^= 1;
        assert!(validate(&bad, layout.total, 2, nonce).unwrap_err().contains("magic"));
        let mut bad = header_for(&layout, nonce);
        bad.version += 1;
        assert!(validate(&bad, layout.total, 2, nonce).unwrap_err().contains("version"));
        assert!(validate(&h, layout.total, 2, [8; 16]).unwrap_err().contains("nonce"));
        assert!(validate(&h, layout.total, 3, nonce).unwrap_err().contains("2 ranks"));
        // Two different disagreements, each named for what is really compared.
        let e = validate(&h, layout.total + PAGE, 2, nonce).unwrap_err();
        assert!(
            e.contains(&format!("records {} bytes, but the file has {}", layout.total, layout.total + PAGE)),
            "{e}"
        );
        let mut bad = header_for(&layout, nonce);
        bad.total += PAGE as u64;
        let e = validate(&bad, layout.total + PAGE, 2, nonce).unwrap_err();
        let want = format!(
            "file has {} bytes, but the layout its header describes needs {}",
            layout.total + PAGE,
            layout.total
        );
        assert!(e.contains(&want), "{e}");
        let mut bad = header_for(&layout, nonce);
        bad.chunk = 12345;
        assert!(validate(&bad, layout.total, 2, nonce).unwrap_err().contains("layout"));
    }
}
