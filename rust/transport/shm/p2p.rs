//! Point-to-point messages: one channel per ordered pair of ranks, in the segment.
//!
//! The sender writes (tag, dtype, count) and posts message m; the receiver takes message m only when
//! its tag is the one asked for (so messages of a pair arrive in send order), answers "accepted" or
//! "refused" (dtype or length differ: both sides fail), and the data streams through two cells: the
//! sender fills cell q % 2 once the receiver drained chunk q − 2. `send` returns once the receiver has
//! drained every chunk. Message and chunk numbers count over the pair's life; each side keeps its own
//! count, under a lock, so threads of one rank take turns on a channel.

use std::sync::atomic::Ordering::*;

use super::world::{lock, Shared};
use crate::dtype::{Buf, BufMut, DType};
use crate::error::{Error, Result};

fn timed_out(w: &Shared, op: &str, peer: usize) -> Error {
    Error::Timeout {
        rank: w.rank,
        op: op.to_string(),
        waited: w.timeout,
        missing: vec![peer],
        group: vec![w.rank, peer],
    }
}

/// Send `buf` to `dst`; returns once `dst` has received all of it.
pub(crate) fn send(w: &Shared, buf: Buf<'_>, dst: usize, tag: u64) -> Result<()> {
    let op = format!("send({} x {} to rank {dst}, tag {tag})", buf.len(), buf.dtype());
    let mut st = lock(&w.sends[dst]);
    let (ch, cells) = w.chan(w.rank, dst);
    let peers = [dst];
    let wait = |ready: &dyn Fn() -> bool| {
        w.wait(&ch.event, &peers, &op, ready).map_err(|e| e.unwrap_or_else(|| timed_out(w, &op, dst)))
    };
    let m = st.msgs + 1;
    // SAFETY: only this rank's sender (holding the lock) writes the meta, and the receiver reads it
    // only after seeing `posted = m` (release below).
    unsafe { std::ptr::write_volatile(ch.meta.get(), [tag, buf.dtype() as u64, buf.len() as u64]) };
    ch.posted.store(m, Release);
    ch.event.notify(true);
    wait(&|| ch.answer.load(Acquire) >> 1 >= m)?;
    st.msgs = m;
    if ch.answer.load(Acquire) & 1 == 1 {
        return Err(Error::invalid(format!(
            "rank {}: {op} was refused by the receiver: dtype or length differ from its recv",
            w.rank
        )));
    }
    let cell = w.layout.params.cell;
    for piece in buf.bytes().chunks(cell) {
        let q = st.chunks + 1;
        wait(&|| ch.drained.load(Acquire) + 2 >= q)?;
        // SAFETY: cell q % 2 was drained (chunk q − 2 consumed); the receiver reads it only after
        // `filled = q`.
        unsafe {
            std::ptr::copy_nonoverlapping(piece.as_ptr(), cells.add((q % 2) as usize * cell), piece.len())
        };
        ch.filled.store(q, Release);
        ch.event.notify(true);
        st.chunks = q;
    }
    let last = st.chunks;
    wait(&|| ch.drained.load(Acquire) >= last)
}

/// Receive into `buf` the next message from `src`, which must carry `tag`, `buf`'s dtype and length.
pub(crate) fn recv(w: &Shared, mut buf: BufMut<'_>, src: usize, tag: u64) -> Result<()> {
    let op = format!("recv({} x {} from rank {src}, tag {tag})", buf.len(), buf.dtype());
    let mut st = lock(&w.recvs[src]);
    let (ch, cells) = w.chan(src, w.rank);
    let peers = [src];
    let wait = |ready: &dyn Fn() -> bool| {
        w.wait(&ch.event, &peers, &op, ready).map_err(|e| e.unwrap_or_else(|| timed_out(w, &op, src)))
    };
    let m = st.msgs + 1;
    // SAFETY: the meta is read only after `posted >= m` (acquire), and the sender rewrites it only for
    // message m + 1, after our answer.
    let meta = || unsafe { std::ptr::read_volatile(ch.meta.get()) };
    wait(&|| ch.posted.load(Acquire) >= m && meta()[0] == tag)?;
    let [_, dtype, count] = meta();
    st.msgs = m;
    if DType::from_code(dtype as u8).filter(|_| dtype < 256) != Some(buf.dtype()) || count != buf.len() as u64
    {
        ch.answer.store(m << 1 | 1, Release);
        ch.event.notify(true);
        let what =
            DType::from_code(dtype as u8).map_or_else(|| format!("dtype code {dtype}"), |d| d.to_string());
        return Err(Error::invalid(format!(
            "rank {}: {op} got a message of {count} x {what} from rank {src}: dtype or length differ",
            w.rank
        )));
    }
    ch.answer.store(m << 1, Release);
    ch.event.notify(true);
    let cell = w.layout.params.cell;
    for piece in buf.bytes_mut().chunks_mut(cell) {
        let q = st.chunks + 1;
        wait(&|| ch.filled.load(Acquire) >= q)?;
        // SAFETY: chunk q is in cell q % 2 (acquired above) and the sender leaves it until we drain it.
        unsafe {
            std::ptr::copy_nonoverlapping(cells.add((q % 2) as usize * cell), piece.as_mut_ptr(), piece.len())
        };
        ch.drained.store(q, Release);
        ch.event.notify(true);
        st.chunks = q;
    }
    Ok(())
}
