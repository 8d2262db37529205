//! Point-to-point messages: one channel per ordered pair of ranks, in the segment.
//!
//! Semantics are the in-process world's (`transport::thread::mailbox`): receives match by (source,
//! tag), in send order per tag but out of order across tags, and small messages are sent eagerly.
//!
//! A channel is a stream of chunks through two cells: the sender fills cell q % 2 once the receiver
//! drained chunk q − 2 (`filled`/`drained` count chunks over the pair's life). Each message starts
//! with a header (tag, dtype, count, message number) at the front of its first chunk, its bytes
//! follow. A message whose header and bytes fit in the two cells (and of at most [`EAGER`] bytes)
//! is eager: the send returns once its chunks are posted (waiting, with the normal deadline, only
//! while the cells still hold earlier messages). A larger send returns once the receiver has drained
//! all of it, and fails when the receiver refused it (dtype or length differ from its recv).
//!
//! The receiver takes messages off its channel in order. One whose tag is not the one asked for is
//! copied into this rank's private queue of unexpected messages for that tag (draining the channel, so
//! the sender can go on), where a later recv for its tag finds it first. Each side keeps its counts
//! (and the receiver its queue) under a lock, so threads of one rank take turns on a channel. A
//! receive from any source does the same on every channel into this rank in turn, and sleeps on the
//! rank's inbox event in the header, which a sender bumps as each message starts.

use std::sync::atomic::Ordering::*;
use std::sync::TryLockError;
use std::time::Duration;

use super::layout::ChanHead;
use super::shared::{ChanState, Shared};
use crate::call;
use crate::config::{EAGER, EARLY_MAX};
use crate::dtype::{Buf, BufMut, DType};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::sync::wait::{may_spin, Stop, Wait};

/// Bytes of a message header: tag, dtype code, element count, message number.
const HEADER: usize = 32;

/// What travels at the front of a message's first chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Head {
    pub tag: u64,
    pub dtype: DType,
    /// Elements.
    pub count: u64,
    /// The message's number on its channel (1, 2, ...).
    pub number: u64,
}

impl Head {
    pub(crate) fn words(&self) -> [u64; 4] {
        [self.tag, self.dtype as u64, self.count, self.number]
    }

    /// The header a peer posted as message `m` of a channel, with the message's length in bytes; `None`
    /// when the words are not one (a corrupted segment): an unknown dtype, another number, or a length
    /// that does not fit in memory.
    pub(crate) fn read(w: [u64; 4], m: u64) -> Option<(Head, usize)> {
        let [tag, code, count, number] = w;
        let dtype = u8::try_from(code).ok().and_then(DType::from_code).filter(|_| number == m)?;
        let bytes = usize::try_from(count).ok()?.checked_mul(dtype.size())?;
        Some((Head { tag, dtype, count, number }, bytes))
    }
}

/// Chunks taken by a message of `bytes` bytes with cells of `cell` bytes.
fn chunks(bytes: usize, cell: usize) -> u64 {
    (HEADER + bytes).div_ceil(cell) as u64
}

/// Send `buf` to `dst` (eagerly when small; module docs).
/// Waits last `timeout` (the communicator's).
pub(crate) fn send(
    w: &Shared,
    buf: Buf<'_>,
    dst: usize,
    tag: u64,
    op: &str,
    timeout: Duration,
) -> Result<()> {
    let mut st = lock(&w.sends[dst]);
    let (ch, cells) = w.chan(w.rank, dst);
    let peers = [dst];
    let wait = |ready: &dyn Fn() -> bool| {
        w.wait(&ch.event, &peers, op, timeout, ready)
            .map_err(|e| e.unwrap_or_else(|| call::p2p_timeout(w.rank, op, timeout, dst)))
    };
    let m = st.msgs + 1;
    st.msgs = m;
    let refused = || ch.answer.load(Acquire) == m << 1 | 1;
    let refusal = || call::refused(w.rank, op);
    let cell = w.layout.params.cell;
    let data = buf.bytes();
    let header = Head { tag, dtype: buf.dtype(), count: buf.len() as u64, number: m }.words();
    let mut sent = 0;
    let mut first = true;
    while first || sent < data.len() {
        let q = st.chunks + 1;
        wait(&|| ch.drained.load(Acquire) + 2 >= q || refused())?;
        if refused() {
            return Err(refusal());
        }
        let at = cells.wrapping_add((q % 2) as usize * cell);
        let skip = if first { HEADER } else { 0 };
        let piece = &data[sent..data.len().min(sent + cell - skip)];
        // SAFETY: cell q % 2 was drained (chunk q − 2 consumed) and the receiver reads it only after
        // `filled = q`; header and piece fit in the cell.
        unsafe {
            if first {
                std::ptr::copy_nonoverlapping(header.as_ptr().cast::<u8>(), at, HEADER);
            }
            std::ptr::copy_nonoverlapping(piece.as_ptr(), at.add(skip), piece.len());
        }
        ch.filled.store(q, Release);
        ch.event.notify(true);
        if first {
            // A receive from any source waits on the receiver's inbox, not on this channel.
            w.header().inbox[dst].notify(true);
        }
        st.chunks = q;
        sent += piece.len();
        first = false;
    }
    if data.len() <= EAGER && chunks(data.len(), cell) <= 2 {
        return Ok(());
    }
    let last = st.chunks;
    wait(&|| ch.drained.load(Acquire) >= last || refused())?;
    if refused() {
        return Err(refusal());
    }
    Ok(())
}

/// Receive into `buf` the first message from `src` with `tag`, which must carry `buf`'s dtype and
/// length. Waits last `timeout` (the communicator's).
pub(crate) fn recv(
    w: &Shared,
    mut buf: BufMut<'_>,
    src: usize,
    tag: u64,
    op: &str,
    timeout: Duration,
) -> Result<()> {
    let mut st = lock(&w.recvs[src]);
    if take_early(w, &mut st, &mut buf, src, tag, op)? {
        return Ok(());
    }
    let ch = w.chan(src, w.rank).0;
    loop {
        let q = st.chunks + 1;
        w.wait(&ch.event, &[src], op, timeout, || ch.filled.load(Acquire) >= q)
            .map_err(|e| e.unwrap_or_else(|| call::p2p_timeout(w.rank, op, timeout, src)))?;
        if take_next(w, &mut st, &mut buf, src, tag, op, timeout)? {
            return Ok(());
        }
    }
}

/// Receive into `buf` the first message with `tag` from one of `from` (the earliest in `from` with
/// one ready), returning its sender. Each pass takes what every channel holds (keeping other tags for
/// their recvs), then sleeps on this rank's inbox event, which senders bump when a message starts. A
/// channel another thread of this rank is reading is skipped for that pass. It fails early only once
/// every one of `from` has died: the others may still send. Waits last `timeout` (the communicator's).
pub(crate) fn recv_any(
    w: &Shared,
    mut buf: BufMut<'_>,
    from: &[usize],
    tag: u64,
    op: &str,
    timeout: Duration,
) -> Result<usize> {
    let try_lock = |s: usize| match w.recvs[s].try_lock() {
        Ok(st) => Some(st),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    };
    let ready = || {
        from.iter().any(|&s| {
            try_lock(s).is_some_and(|st| {
                st.early.get(&tag).is_some_and(|q| !q.is_empty())
                    || w.chan(s, w.rank).0.filled.load(Acquire) > st.chunks
            })
        })
    };
    let wait =
        Wait { event: &w.header().inbox[w.rank], shared: true, spin: may_spin(w.size), timeout, op: &op };
    loop {
        for &s in from {
            let Some(mut st) = try_lock(s) else { continue };
            if take_early(w, &mut st, &mut buf, s, tag, op)? {
                return Ok(s);
            }
            while w.chan(s, w.rank).0.filled.load(Acquire) > st.chunks {
                if take_next(w, &mut st, &mut buf, s, tag, op, timeout)? {
                    return Ok(s);
                }
            }
        }
        let all_dead = || match from.iter().all(|&s| w.liveness.first_dead(&[s]).is_some()) {
            true => w.check_alive(from, op),
            false => Ok(()),
        };
        match wait.until(ready, || w.check_abort(op, Some(from)), all_dead) {
            Ok(()) => {}
            Err(Stop::Failed(e)) => return Err(e),
            Err(Stop::TimedOut) => return Err(call::any_source_timeout(w.rank, op, timeout, from)),
        }
    }
}

/// Take the first held message with `tag` from `src` into `buf` (true), if there is one.
fn take_early(
    w: &Shared,
    st: &mut ChanState,
    buf: &mut BufMut<'_>,
    src: usize,
    tag: u64,
    op: &str,
) -> Result<bool> {
    let Some((dtype, count, data)) = st.early.get_mut(&tag).and_then(|q| q.pop_front()) else {
        return Ok(false);
    };
    w.early_bytes.fetch_sub(data.len(), AcqRel);
    if dtype != buf.dtype() || count != buf.len() as u64 {
        return Err(call::wrong_message(w.rank, op, count, &dtype, src));
    }
    buf.bytes_mut().copy_from_slice(&data);
    Ok(true)
}

/// Take the next message on the channel from `src`, whose first chunk is filled: into `buf` when it
/// has `tag` (true; its dtype and length must be `buf`'s), else into this rank's held messages. Waits
/// for its further chunks last `timeout`.
fn take_next(
    w: &Shared,
    st: &mut ChanState,
    buf: &mut BufMut<'_>,
    src: usize,
    tag: u64,
    op: &str,
    timeout: Duration,
) -> Result<bool> {
    let (ch, cells) = w.chan(src, w.rank);
    let peers = [src];
    let wait = |ready: &dyn Fn() -> bool| {
        w.wait(&ch.event, &peers, op, timeout, ready)
            .map_err(|e| e.unwrap_or_else(|| call::p2p_timeout(w.rank, op, timeout, src)))
    };
    let cell = w.layout.params.cell;
    let (m, q) = (st.msgs + 1, st.chunks + 1);
    let mut header = [0u64; 4];
    // SAFETY: chunk q (filled, acquired by the caller) starts with the message's header; the sender
    // leaves the cell until we drain it.
    unsafe {
        std::ptr::copy_nonoverlapping(
            cells.add((q % 2) as usize * cell),
            header.as_mut_ptr().cast::<u8>(),
            HEADER,
        )
    };
    let Some((Head { tag: got, dtype, count, .. }, bytes)) = Head::read(header, m) else {
        return Err(Error::invalid(format!(
            "rank {}: {op}: rank {src} posted an unreadable message (corrupted segment?)",
            w.rank
        )));
    };
    st.msgs = m;
    let fits = dtype == buf.dtype() && count == buf.len() as u64;
    if got == tag && !fits {
        ch.answer.store(m << 1 | 1, Release);
        ch.event.notify(true);
        return Err(call::wrong_message(w.rank, op, count, &dtype, src));
    }
    ch.answer.store(m << 1, Release);
    ch.event.notify(true);
    if got == tag {
        drain(ch, cells, cell, st, buf.bytes_mut(), &wait)?;
        return Ok(true);
    }
    // Not ours yet: keep it for the recv that asks for its tag, and free the channel. Its size is the
    // sender's word: bound it before allocating, and never let an allocation failure abort.
    let held =
        w.early_bytes.fetch_update(AcqRel, Acquire, |h| h.checked_add(bytes).filter(|&t| t <= EARLY_MAX));
    let mut data = Vec::new();
    if held.is_err() || data.try_reserve_exact(bytes).is_err() {
        if held.is_ok() {
            w.early_bytes.fetch_sub(bytes, AcqRel);
        }
        return Err(Error::invalid(format!(
            "rank {}: {op}: rank {src} sent a message of {bytes} bytes with tag {got}, which no recv \
             asked for yet; this rank holds at most {} MiB of such messages (post the recv for tag \
             {got} first, or send smaller messages)",
            w.rank,
            EARLY_MAX >> 20
        )));
    }
    data.resize(bytes, 0);
    drain(ch, cells, cell, st, &mut data, &wait)?;
    st.early.entry(got).or_default().push_back((dtype, count, data));
    // A receive from any source on another thread of this rank may be waiting for it.
    w.header().inbox[w.rank].notify(true);
    Ok(false)
}

/// Copy the message whose first chunk (`st.chunks + 1`, already filled) is next on channel `ch` (cells
/// of `cell` bytes at `cells`) into `out`, draining every chunk.
fn drain(
    ch: &ChanHead,
    cells: *mut u8,
    cell: usize,
    st: &mut ChanState,
    out: &mut [u8],
    wait: &dyn Fn(&dyn Fn() -> bool) -> Result<()>,
) -> Result<()> {
    let mut done = 0;
    for i in 0..chunks(out.len(), cell) {
        let q = st.chunks + 1;
        let skip = if i == 0 { HEADER } else { 0 };
        let piece = (cell - skip).min(out.len() - done);
        wait(&|| ch.filled.load(Acquire) >= q)?;
        // SAFETY: chunk q is in cell q % 2 (acquired above) and the sender leaves it until we drain it;
        // the header and `piece` bytes fit in the cell, `piece` in what is left of `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                cells.add((q % 2) as usize * cell + skip),
                out[done..].as_mut_ptr(),
                piece,
            )
        };
        done += piece;
        st.chunks = q;
        ch.drained.store(q, Release);
        ch.event.notify(true);
    }
    Ok(())
}
