//! The route a call's data takes, one owner for the choice, asked at the two moments of a meeting:
//! * as a member publishes a private buffer, what it offers its peers for it ([`offer`], under its
//!   process's [`Policy`] and its timings, `route_times`); its world's store writes that into its
//!   page, as it writes where the buffer is;
//! * once every member arrived, the engine asks for the route ([`choose`]), from where every member's
//!   buffers are as the store reads them back from the pages ([`Place`]): direct when every buffer is
//!   addressable here; across processes (`cma`) when every member offered every buffer and any member
//!   asked; else staged.

use super::cma::Member;
use super::process_vm::Loc;
use super::route_times::RouteTimes;
use super::Peer;
use crate::config::{cma_forced_by_env, CMA_MIN, CMA_REDUCE_CROWDED};
use crate::error::{Error, Result};
use crate::signature::{CollKind, Signature};

/// How a collective's data moves ([`choose`]).
pub(crate) enum Route {
    /// Every member's buffers, addressable here: run `algo::direct`.
    Direct(Vec<Peer>),
    /// Through every member's two pipeline buffers of `chunk` bytes (`staged`).
    Staged { bufs: Vec<[*mut u8; 2]>, chunk: usize },
    /// Every member's buffers, in this process or in a peer's that lets us copy (`cma`).
    Cma(Vec<Member>),
}

/// Where one of a member's buffers is, as its world reads it from the member's page.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Place {
    /// Addressable in this process, at this address (the in-process world's buffers, the arrays of
    /// the shm segment; null for a buffer of no bytes).
    Here(*mut u8),
    /// Private to its member's process, offered for copies across processes ([`Offer::Address`]);
    /// `cross` when its member asked the call to cross ([`Offer::Cross`]).
    Offered { at: Loc, cross: bool },
    /// Out of reach: its member withheld it ([`Offer::Withheld`]).
    Withheld,
}

/// Every member's two pipeline buffers (`staged`) and their size in bytes.
pub(crate) type Staging = (Vec<[*mut u8; 2]>, usize);

/// The route of a call of `kind` among the global ranks `members`, whose send and receive buffers are
/// at `places` (in group order): direct when every buffer is addressable here; copied across
/// processes when this route runs `kind` ([`handles`]), every member offered every buffer and any
/// member asked; else staged, through the world's `staging` (none in a world whose buffers every
/// member addresses, where a call that would stage is a bug).
pub(crate) fn choose(
    kind: CollKind,
    members: &[usize],
    places: &[[Place; 2]],
    staging: impl FnOnce() -> Option<Staging>,
) -> Result<Route> {
    let here = |p: &Place| match *p {
        Place::Here(ptr) => Some(ptr),
        _ => None,
    };
    let direct: Option<Vec<Peer>> =
        places.iter().map(|[s, r]| Some(Peer { send: here(s)?.cast_const(), recv: here(r)? })).collect();
    if let Some(peers) = direct {
        return Ok(Route::Direct(peers));
    }
    let asked = places.iter().flatten().any(|p| matches!(p, Place::Offered { cross: true, .. }));
    if handles(kind) && asked {
        let loc = |p: &Place, rank: usize| match *p {
            Place::Here(ptr) => Some(Loc { pid: None, addr: ptr as usize, rank }),
            Place::Offered { at, .. } => Some(at),
            Place::Withheld => None,
        };
        let crossing: Option<Vec<Member>> = places
            .iter()
            .zip(members)
            .map(|([s, r], &rank)| Some(Member { send: loc(s, rank)?, recv: loc(r, rank)? }))
            .collect();
        if let Some(members) = crossing {
            return Ok(Route::Cma(members));
        }
    }
    let (bufs, chunk) = staging().ok_or_else(|| {
        Error::Internal(format!("{}: a call would stage in a world without staging", kind.name()))
    })?;
    Ok(Route::Staged { bufs, chunk })
}

/// Whether the cross-memory route (`cma`) runs `kind` (the others, reduce_scatter_v, stage).
pub(crate) fn handles(kind: CollKind) -> bool {
    !matches!(kind, CollKind::ReduceScatterV)
}

/// When a member lets its peers copy its private buffers straight from its memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Policy {
    /// Never (`AXONML_SHM_CMA=0`, or the kernel refused a peer: `probe`); every call stages.
    Never,
    /// Calls that took less time crossing than staging lately, or large enough ([`offer`]): the
    /// default.
    Timed,
    /// Every buffer of at least `CMA_MIN` bytes (`AXONML_SHM_CMA=1`).
    Always,
}

impl Policy {
    /// The policy `AXONML_SHM_CMA` asks for (`config::cma_forced_by_env`).
    pub(crate) fn from_env() -> Policy {
        match cma_forced_by_env() {
            Some(false) => Policy::Never,
            Some(true) => Policy::Always,
            None => Policy::Timed,
        }
    }
}

/// What a member offers its peers for a private buffer of a call, under its `Policy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Offer {
    /// Nothing: peers cannot copy from or to it, and the call stages.
    Withheld,
    /// Its address, that peers may copy from and to it if the call crosses.
    Address,
    /// Its address, asking the call to cross: it does when any member asks and every member offered
    /// every buffer ([`choose`]).
    Cross,
}

/// What a member offers for a private buffer of `bytes` of call `sig` (in a group of `n`) under
/// `policy`: by default it asks the call to cross when crossing took it less time than staging lately
/// (`routes`, for the calls it times), else by [`by_size`]. `routes` is `None` where the world's ranks
/// outnumber the cores (crowded): timings there say more about who held a core than about the route,
/// so nothing is timed and [`by_size`] decides. A call crosses when any member asks, so a
/// member with other settings (`AXONML_SHM_CMA=1`) or other timings can make it cross; one that
/// withholds makes it stage. The policy is asked only for buffers of at least [`CMA_MIN`] bytes, so
/// smaller ones never make a process probe its peers (`Policy::Never` after a refused probe).
pub(crate) fn offer(
    policy: impl FnOnce() -> Policy,
    sig: &Signature,
    n: usize,
    bytes: usize,
    routes: Option<&RouteTimes>,
) -> Offer {
    if bytes < CMA_MIN {
        return Offer::Withheld;
    }
    let ask = match policy() {
        Policy::Never => return Offer::Withheld,
        Policy::Always => true,
        Policy::Timed => match routes {
            Some(routes) => routes.ask(sig, n).unwrap_or_else(|| by_size(sig, n, false)),
            None => by_size(sig, n, true),
        },
    };
    if ask {
        Offer::Cross
    } else {
        Offer::Address
    }
}

/// Whether a member asks a call it does not time to cross: calls of `ROUTE_TIMED_BELOW` or more, or
/// of the pairwise kinds, or any call when the world's ranks outnumber the cores (`crowded`: there a
/// member's time depends mostly on when the scheduler ran it, and the samples of both routes spread
/// over the same range). Then the pairwise kinds always cross; the reductions cross from
/// [`CMA_REDUCE_CROWDED`] when crowded, always otherwise; the copy kinds never cross when crowded,
/// where the staged copies run at user-space speed and stream their output, and always otherwise (the
/// measurements behind each: the docs of the Python bench, `bench.procs`).
fn by_size(sig: &Signature, n: usize, crowded: bool) -> bool {
    let (send, recv) = super::spans(sig, n, true);
    match sig.kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            !crowded || send.max(recv) >= CMA_REDUCE_CROWDED
        }
        CollKind::Broadcast | CollKind::AllGather | CollKind::Gather | CollKind::Scatter => !crowded,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::null_mut as null;

    #[test]
    fn a_call_goes_direct_when_all_is_here_crosses_when_all_offered_and_one_asked_else_stages() {
        let (mut a, mut b) = (0u64, 0u64);
        let (pa, pb) = ((&raw mut a).cast::<u8>(), (&raw mut b).cast::<u8>());
        let offered = |addr: usize, cross| Place::Offered { at: Loc { pid: Some(7), addr, rank: 1 }, cross };
        let staging = || Some((vec![[pa, pb]; 2], 64));
        let route = |kind, places: &[[Place; 2]]| choose(kind, &[0, 1], places, staging).unwrap();
        let here = [Place::Here(pa), Place::Here(pb)];
        // Every buffer addressable here (a buffer of no bytes is a null one): direct, as published.
        let Route::Direct(peers) =
            route(CollKind::AllReduce, &[here, [Place::Here(pb), Place::Here(null())]])
        else {
            panic!("not direct")
        };
        assert_eq!(
            (peers[0].send, peers[0].recv, peers[1].send, peers[1].recv),
            (pa.cast_const(), pb, pb.cast_const(), null())
        );
        // One member's private buffers, offered, one of them asked to cross: across processes, the
        // buffers here as this process's own.
        let asked = [offered(0x1000, false), offered(0x2000, true)];
        let Route::Cma(members) = route(CollKind::AllReduce, &[here, asked]) else { panic!("not crossing") };
        assert_eq!((members[0].send.pid, members[0].send.addr, members[0].recv.rank), (None, pa as usize, 0));
        assert_eq!(
            (members[1].send.pid, members[1].send.addr, members[1].recv.addr),
            (Some(7), 0x1000, 0x2000)
        );
        // Offered but nobody asked, a withheld buffer, or a kind this route does not run: staged.
        let not_asked = [offered(0x1000, false), offered(0x2000, false)];
        let withheld = [Place::Withheld, offered(0x2000, true)];
        for (kind, other) in [
            (CollKind::AllReduce, not_asked),
            (CollKind::AllReduce, withheld),
            (CollKind::ReduceScatterV, asked),
        ] {
            let Route::Staged { bufs, chunk } = route(kind, &[here, other]) else {
                panic!("{kind:?} not staged")
            };
            assert_eq!((bufs.len(), chunk), (2, 64));
        }
        // A world without staging (every buffer addressable) never gets there: a bug, not a crash.
        let e = choose(CollKind::AllReduce, &[0, 1], &[here, not_asked], || None).err().unwrap();
        assert!(matches!(e, Error::Internal(_)), "{e}");
    }

    #[test]
    fn calls_cross_by_timing_or_size_and_every_member_of_a_call_decides_alike() {
        use crate::algo::spans;
        use crate::config::{ROUTE_LEARN, ROUTE_PROBE_EVERY, ROUTE_RUN, ROUTE_TIMED_BELOW};
        use crate::dtype::DType;
        use std::time::Duration;
        // A call of `count` float32 per part on `n` members: what the root and any other member offer
        // for their buffers, and whether the call crosses: when every buffer is offered and any member
        // asks. The root and the others must ask alike (their timings alike).
        let decide_with = |p: Policy, kind, count: usize, n: usize, routes: Option<&RouteTimes>| {
            let s = Signature::new(kind, 1, count).dtype(DType::F32);
            let member = |is_root| {
                let (send, recv) = spans(&s, n, is_root);
                let offers: Vec<Offer> = [send, recv]
                    .into_iter()
                    .filter(|&b| b > 0)
                    .map(|b| offer(|| p, &s, n, b, routes))
                    .collect();
                (offers.iter().all(|&o| o != Offer::Withheld), offers.contains(&Offer::Cross))
            };
            let ((root_offers, root_asks), (other_offers, other_asks)) = (member(true), member(false));
            assert_eq!(root_asks, other_asks, "{kind:?} {count}: the root and the others disagree");
            root_offers && other_offers && root_asks
        };
        let fresh = RouteTimes::default();
        let decide = |p: Policy, kind, count: usize, n: usize, crowded: bool| {
            decide_with(p, kind, count, n, (!crowded).then_some(&fresh))
        };
        // float32 elements of the smallest call not timed, and per MiB.
        let (big, mib) = (ROUTE_TIMED_BELOW / 4, (1 << 20) / 4);
        // Calls too large to time: reductions cross, copies cross unless ranks outnumber the cores.
        for kind in [CollKind::AllReduce, CollKind::Reduce] {
            assert!(decide(Policy::Timed, kind, big, 2, false) && decide(Policy::Timed, kind, big, 4, true));
        }
        // Where ranks outnumber cores nothing is timed: reductions cross from CMA_REDUCE_CROWDED by
        // their largest buffer, copies never.
        let crowded = CMA_REDUCE_CROWDED / 4;
        assert!(!decide(Policy::Timed, CollKind::AllReduce, crowded - 1, 4, true));
        assert!(decide(Policy::Timed, CollKind::AllReduce, crowded, 4, true));
        assert!(!decide(Policy::Timed, CollKind::ReduceScatter, crowded / 4 - 1, 4, true));
        assert!(decide(Policy::Timed, CollKind::ReduceScatter, crowded / 4, 4, true));
        // reduce_scatter by its input (count per member, n parts), all_gather and gather by their
        // output, scatter by its input: the call's largest buffer.
        assert!(decide(Policy::Timed, CollKind::ReduceScatter, big / 2, 2, false));
        for kind in [CollKind::Broadcast, CollKind::AllGather, CollKind::Gather, CollKind::Scatter] {
            let part = if kind == CollKind::Broadcast { big } else { big / 2 };
            assert!(decide(Policy::Timed, kind, part, 2, false), "{kind:?}");
            assert!(!decide(Policy::Timed, kind, part, 2, true), "{kind:?}");
            assert!(decide(Policy::Always, kind, part, 2, true), "{kind:?}");
        }
        // A fresh member stages a timed call first (learning, no samples yet).
        for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::Broadcast, CollKind::AllGather] {
            assert!(!decide(Policy::Timed, kind, mib / 2, 2, false), "{kind:?}");
            assert!(decide(Policy::Always, kind, mib / 2, 2, false), "{kind:?}");
        }
        // Once crossing took less than staging, timed calls of every kind cross, but for the probe
        // calls, and never when the policy forbids it.
        for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::Broadcast, CollKind::AllGather] {
            let routes = RouteTimes::default();
            let s = Signature::new(kind, 1, mib / 2).dtype(DType::F32);
            let mut crossed = Vec::new();
            for _ in 0..2 * ROUTE_LEARN + 2 * ROUTE_PROBE_EVERY {
                let cross = decide_with(Policy::Timed, kind, mib / 2, 2, Some(&routes));
                let took = Duration::from_micros(if cross { 10 } else { 30 });
                routes.record(&s, 2, cross, took);
                crossed.push(cross);
            }
            let learning = 2 * ROUTE_LEARN as usize;
            let crossings = crossed[..learning].iter().filter(|&&c| c).count();
            assert!(!crossed[0] && crossings as u64 == ROUTE_LEARN, "{kind:?} learns both, staging first");
            let staged = crossed[learning..].iter().filter(|&&c| !c).count() as u64;
            assert_eq!(staged, 2 * ROUTE_RUN, "{kind:?}: one staged probe run per {ROUTE_PROBE_EVERY} calls");
            assert!(!decide_with(Policy::Never, kind, mib / 2, 2, Some(&routes)), "{kind:?}");
        }
        // A large call whose parts are under CMA_MIN stages (64 members, 2 MiB gathered).
        assert!(!decide(Policy::Always, CollKind::AllGather, 2 * mib / 64, 64, false));
        assert!(decide(Policy::Always, CollKind::AllReduce, CMA_MIN / 4, 2, false));
        assert!(!decide(Policy::Always, CollKind::AllReduce, CMA_MIN / 4 - 1, 2, false));
        assert!(!decide(Policy::Never, CollKind::AllReduce, big, 2, false));
        // The kinds with per-member sizes go by each buffer alone (their spans come from the plan).
        let v = Signature::new(CollKind::AllToAll, 1, 0).dtype(DType::F32);
        assert_eq!(offer(|| Policy::Timed, &v, 4, CMA_MIN, None), Offer::Cross);
        assert_eq!(offer(|| Policy::Timed, &v, 4, CMA_MIN - 1, Some(&fresh)), Offer::Withheld);
        // Buffers under CMA_MIN never ask for the policy (which may probe the peers).
        assert_eq!(offer(|| unreachable!("asked"), &v, 4, CMA_MIN - 1, Some(&fresh)), Offer::Withheld);
    }
}
