//! Entry points for fuzzing the parsers of what peers, stores and files say: the libFuzzer targets in
//! `fuzz/` and the property tests (`fuzzing/tests.rs`) both run them. Each takes arbitrary bytes, runs
//! one parser on them, and panics only when the parser broke its contract:
//! * it refuses the input, or accepts exactly what its encoder writes (so a corrupted word never
//!   passes for the value it was, and two peers that decode alike said the same thing);
//! * every size it returns is bounded, and computed without overflow (checked here in 128 bits), so
//!   no peer's number decides an allocation or an address beyond the documented limits.
//!
//! Built for the crate's tests and with the `fuzzing` feature only; not an API.

use std::mem::size_of;

use crate::algo::layout::{words, Fault, Plan};
use crate::engine::wire;
use crate::error::Error;
use crate::rendezvous::parsers as r;
use crate::signature::{CollKind, Signature};
use crate::transport::shm::parsers::{self as p, Header, Layout, Params};

#[cfg(test)]
mod tests;

/// The next `N` bytes of `data`, zero-padded when it runs out: short inputs still reach the parser.
fn take<const N: usize>(data: &mut &[u8]) -> [u8; N] {
    let mut b = [0u8; N];
    let k = data.len().min(N);
    b[..k].copy_from_slice(&data[..k]);
    *data = &data[k..];
    b
}

fn word(data: &mut &[u8]) -> u64 {
    u64::from_le_bytes(take(data))
}

/// A rank's hello, as the ranks read it from the store.
pub fn hello(data: &[u8]) {
    if let Some(h) = r::Hello::decode(data) {
        assert!(h.host.len() <= r::MAX_HOST, "{h:?}");
        assert_eq!(h.encode(), data, "a hello decodes only from what encode writes: {h:?}");
    }
}

/// A stream of the TCP store's frames, each read as `tcp::read_frame` reads one and parsed as a
/// request, until the bytes run out.
pub fn frames(data: &[u8]) {
    let mut rest = data;
    while let Some((head, after)) = rest.split_first_chunk::<3>() {
        let (status, len) = r::frame_head(*head);
        assert!(len <= r::MAX_BODY, "a frame announces {len} bytes");
        let Some(body) = after.get(..len) else { return };
        assert_eq!(r::frame(status, body), rest[..3 + len], "frames round trip");
        if let Some(req) = r::parse_request(status, body) {
            assert_eq!(
                r::request(&req),
                (status, body.to_vec()),
                "a request parses only from what request writes"
            );
        }
        rest = &after[len..];
    }
}

/// Rank 0's verdict, as the ranks read it from the store.
pub fn verdict(data: &[u8]) {
    if let Some(v) = r::Verdict::decode(data) {
        assert_eq!(v.encode(), data, "a verdict decodes only from what encode writes: {v:?}");
    }
}

/// A segment token read from a store: `data` is the world size of the reading rank (one byte), then
/// the token (UTF-8: a store's values reach Rust as `str`).
pub fn token(data: &[u8]) {
    let Some((&world, text)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    let world = usize::from(world) % (p::MAX_RANKS + 2);
    match p::parse_token(text, world) {
        Ok((name, nonce)) => {
            assert!(p::plausible_name(&name), "{name:?}");
            assert_eq!(p::token(&name, nonce, world), text, "a token parses only from what token writes");
        }
        Err(e) => assert!(matches!(e, Error::InvalidArgument(_)), "{e}"),
    }
}

/// What [`segment_header`] reads for a valid segment of `world` ranks with `arena` bytes each (and
/// `chunk`, when given): the attaching rank's world size (one byte), the file's size (8 bytes), the
/// nonce the rank was given (16), then the header's bytes. `None` when a creator refuses them.
pub(crate) fn valid_header(
    world: usize,
    arena: usize,
    chunk: Option<usize>,
    nonce: [u8; 16],
) -> Option<Vec<u8>> {
    let mut params = Params::new(world, arena);
    params.chunk = chunk.unwrap_or(params.chunk);
    let layout = Layout::new(params).ok()?;
    let mut h = Header::zeroed();
    h.init(&layout, nonce);
    // SAFETY: the header is plain bytes to read (integers, atomics, byte arrays).
    let bytes =
        unsafe { std::slice::from_raw_parts((&*h as *const Header).cast::<u8>(), size_of::<Header>()) };
    Some([&[world as u8][..], &(layout.total as u64).to_le_bytes(), &nonce, bytes].concat())
}

/// A segment's header as `segment::attach` checks it. `data` starts with a mode byte: when odd, the
/// next three bytes choose a valid segment ([`valid_header`]: world size, arena pages) and the rest
/// of `data` flips its bits (XOR), so the fuzzer starts from headers that pass; when even, the rest
/// is what `valid_header` describes.
pub fn segment_header(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let flipped;
    let mut d = if mode & 1 == 1 {
        let mut r = rest;
        let [w, a0, a1] = take::<3>(&mut r);
        let pages = usize::from(u16::from_le_bytes([a0, a1]));
        let base = valid_header(1 + usize::from(w) % p::MAX_RANKS, pages * 4096, None, [7; 16])
            .expect("default parameters make a layout");
        flipped =
            base.iter().zip(r.iter().chain(std::iter::repeat(&0))).map(|(b, x)| b ^ x).collect::<Vec<u8>>();
        &flipped[..]
    } else {
        rest
    };
    let world = usize::from(take::<1>(&mut d)[0]);
    let size = word(&mut d);
    let nonce = take::<16>(&mut d);
    let Ok(size) = usize::try_from(size) else { return };
    let mut h = Header::zeroed();
    let n = d.len().min(size_of::<Header>());
    // SAFETY: every bit pattern is a valid Header (`Header::zeroed`); at most its size is copied into
    // it, from bytes that do not overlap it.
    unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), (&mut *h as *mut Header).cast::<u8>(), n) };
    let Ok(l) = p::validate(&h, size, world, nonce) else { return };
    let w = l.params.world;
    assert!((1..=p::MAX_RANKS).contains(&w) && w == world && h.nonce == nonce);
    assert_eq!(l, Layout::new(l.params).expect("an accepted header's parameters make a layout"));
    // Every region ends inside the file, computed independently and without wrapping.
    let u = |x: usize| x as u128;
    let chans_end = u(l.chans) + u(w * w) * u(l.chan_stride);
    let blocks_end = u(l.staging) + (u(w) + u(l.params.pool)) * u(l.block);
    let arenas_end = u(l.arenas) + u(w) * u(l.params.arena);
    assert!(size_of::<Header>() as u128 <= u(l.comms) && u(l.comms) <= u(l.chans));
    assert!(chans_end <= u(l.staging) && blocks_end <= u(l.arenas) && arenas_end == u(size), "{l:?}");
    assert!(u(l.params.cell) * 2 < u(l.chan_stride) && 2 * u(l.params.chunk) <= u(l.block));
}

/// A point-to-point message header: the message number the receiver expects (8 bytes), then the 32
/// bytes the sender posted.
pub fn message_header(data: &[u8]) {
    let mut d = data;
    let m = word(&mut d);
    let w = [word(&mut d), word(&mut d), word(&mut d), word(&mut d)];
    if let Some((head, bytes)) = p::Head::read(w, m) {
        assert_eq!((head.words(), head.number), (w, m), "a header reads only from what words writes");
        assert_eq!(bytes as u128, u128::from(head.count) * head.dtype.size() as u128);
    }
}

/// A signature from a peer's page (6 words).
pub fn signature(data: &[u8]) {
    let mut d = data;
    let w: [u64; wire::WORDS] = std::array::from_fn(|_| word(&mut d));
    if let Some(s) = wire::decode(w) {
        assert_eq!(wire::encode(&s), w, "a signature decodes only from what encode writes: {s}");
    }
}

/// The plan of a pairwise collective from layouts members published: `data` picks the kind, group
/// size (1..=16), element size, root and count (for all_to_all), whether the layouts are made to agree
/// (so the fuzzer gets past the comparison), then gives the layouts' words.
pub fn plan(data: &[u8]) {
    let mut d = data;
    let [kind, n, elem, root] = take::<4>(&mut d);
    // The pairwise collectives, whose plans come from what peers publish (all_to_all: from the signature).
    let pairwise: Vec<CollKind> =
        CollKind::ALL.into_iter().filter(|k| *k == CollKind::AllToAll || k.has_layout()).collect();
    let kind = pairwise[usize::from(kind) % pairwise.len()];
    let (agree, n) = (n & 0x80 != 0, 1 + usize::from(n) % 16);
    let elem = [1, 2, 4, 8, 16][usize::from(elem) % 5];
    let root = usize::from(root) % n;
    let count = word(&mut d);
    let w = words(kind, n);
    let mut layouts: Vec<Vec<u64>> = (0..n).map(|_| (0..w).map(|_| word(&mut d)).collect()).collect();
    match kind {
        _ if !agree => {}
        CollKind::AllToAll => {}
        CollKind::AllToAllSingle => {
            // Member i expects from member j what j sends i.
            let input: Vec<Vec<u64>> = layouts.iter().map(|l| l[..n].to_vec()).collect();
            for (i, l) in layouts.iter_mut().enumerate() {
                for (j, sends) in input.iter().enumerate() {
                    l[n + j] = sends[i];
                }
            }
        }
        _ => {
            let first = layouts[0].clone();
            layouts.fill(first);
        }
    }
    let sig = Signature { count, ..Signature::new(kind, 1, 0).dtype(crate::dtype::DType::U8) };
    let views: Vec<&[u64]> = layouts.iter().map(Vec::as_slice).collect();
    let members: Vec<usize> = (0..n).collect();
    let got = Plan::new(&sig, elem, Some(root), &views, &members);
    // The reference, in 128 bits: elements member j sends member i, and whether the layouts agree.
    let e = elem as u128;
    let elems = |j: usize, i: usize| -> u128 {
        let c = |x: u64| u128::from(x);
        match kind {
            CollKind::AllToAll => c(count),
            CollKind::AllToAllSingle => c(layouts[j][i]),
            CollKind::AllGatherV => c(layouts[0][j]),
            CollKind::GatherV => c(if i == root { layouts[0][j] } else { 0 }),
            _ if kind == CollKind::ScatterV && j != root => 0,
            _ => c(layouts[0][i]),
        }
    };
    let agreed = match kind {
        CollKind::AllToAll => true,
        CollKind::AllToAllSingle => (0..n).all(|j| (0..n).all(|i| layouts[j][i] == layouts[i][n + j])),
        _ => layouts.iter().all(|l| l == &layouts[0]),
    };
    let max = usize::MAX as u128;
    // Each member's buffers hold at most a whole row or column of the counts (all of them for `_v`).
    let whole = |f: &dyn Fn(usize) -> u128| (0..n).map(f).max().unwrap_or(0);
    let fits = match kind {
        CollKind::AllToAll => u128::from(count) * e * n as u128 <= max,
        CollKind::AllToAllSingle => {
            whole(&|j| (0..n).map(|i| elems(j, i) * e).sum()) <= max
                && whole(&|i| (0..n).map(|j| elems(j, i) * e).sum()) <= max
        }
        _ => layouts[0].iter().map(|&c| u128::from(c) * e).sum::<u128>() <= max,
    };
    let plan = match got {
        Err(Fault::Disagree(_)) => return assert!(!agreed, "agreeing layouts refused"),
        Err(Fault::Overflow) => return assert!(agreed && !fits, "sizes that fit were refused"),
        Ok(plan) => plan,
    };
    assert!(agreed && fits, "layouts that disagree or overflow made a plan");
    assert!(plan.len.len() == n * n && plan.src.len() == n * n && plan.dst.len() == n * n);
    for j in 0..n {
        for i in 0..n {
            let at = j * n + i;
            let (len, src, dst) = (plan.len[at] as u128, plan.src[at] as u128, plan.dst[at] as u128);
            assert_eq!(len, elems(j, i) * e, "bytes {j} sends {i}");
            // Every piece lies inside both members' buffers, whatever the layouts said.
            assert!(src + len <= plan.spans[j].0 as u128, "{j} -> {i}: {plan:?}");
            assert!(dst + len <= plan.spans[i].1 as u128, "{j} -> {i}: {plan:?}");
        }
    }
}
