//! The fingerprint of one collective call. Every rank publishes its own before any data moves; ranks
//! whose fingerprints differ all fail with a mismatch error naming who called what.

use std::fmt;

use crate::dtype::DType;
use crate::error::Error;
use crate::reduce::{ReduceOp, Scale};

/// Declares [`CollKind`] from one row per collective: its variant, wire code, the name users call it
/// by, whether it has a layout, whether it reduces, and what a member's send and receive buffers hold.
macro_rules! coll_kinds {
    ($($(#[$doc:meta])* $kind:ident = $code:literal, $name:literal, layout: $layout:literal,
       reduces: $reduces:literal, buffers: ($send:ident, $recv:ident);)*) => {
        /// Which collective a rank called.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum CollKind {
            $($(#[$doc])* $kind = $code,)*
        }

        impl CollKind {
            /// Every collective.
            pub const ALL: [CollKind; [$($code),*].len()] = [$(CollKind::$kind),*];

            /// The name users call it by.
            pub const fn name(self) -> &'static str {
                match self {
                    $(CollKind::$kind => $name,)*
                }
            }

            /// Whether each member publishes a layout (its counts or split sizes) beside its signature,
            /// which the members compare before any data moves (`algo::layout`).
            pub const fn has_layout(self) -> bool {
                match self {
                    $(CollKind::$kind => $layout,)*
                }
            }

            /// Whether it combines the members' data with a reduction operator.
            pub const fn reduces(self) -> bool {
                match self {
                    $(CollKind::$kind => $reduces,)*
                }
            }

            /// What a member's send and receive buffers hold.
            pub const fn buffers(self) -> (Extent, Extent) {
                match self {
                    $(CollKind::$kind => (Extent::$send, Extent::$recv),)*
                }
            }
        }
    };
}

/// What one member's buffer of a collective holds, in parts: a part is [`Signature::count`] elements
/// for the kinds of equal parts, a member's own count for the `_v` kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// Nothing (a barrier), or sizes the layout's split sizes give (all_to_all_single).
    Nothing,
    /// The member's own part.
    Part,
    /// Every member's part, in group order.
    Group,
    /// Every member's part on the root, nothing on the others.
    RootGroup,
}

impl Extent {
    /// Whether a member holds every member's part (on the root, for `RootGroup`).
    pub const fn is_group(self) -> bool {
        matches!(self, Extent::Group | Extent::RootGroup)
    }
    /// Whether the member whose group index is `j` holds this buffer, when `root` is the root's.
    pub const fn on(self, j: usize, root: usize) -> bool {
        !matches!(self, Extent::Nothing) && (j == root || !matches!(self, Extent::RootGroup))
    }
}

coll_kinds! {
    /// all_reduce
    AllReduce = 1, "all_reduce", layout: false, reduces: true, buffers: (Part, Part);
    /// broadcast
    Broadcast = 2, "broadcast", layout: false, reduces: false, buffers: (Part, Part);
    /// all_gather
    AllGather = 3, "all_gather", layout: false, reduces: false, buffers: (Part, Group);
    /// reduce_scatter
    ReduceScatter = 4, "reduce_scatter", layout: false, reduces: true, buffers: (Group, Part);
    /// gather
    Gather = 5, "gather", layout: false, reduces: false, buffers: (Part, RootGroup);
    /// scatter
    Scatter = 6, "scatter", layout: false, reduces: false, buffers: (RootGroup, Part);
    /// reduce
    Reduce = 7, "reduce", layout: false, reduces: true, buffers: (Part, Part);
    /// barrier
    Barrier = 8, "barrier", layout: false, reduces: false, buffers: (Nothing, Nothing);
    /// all_to_all (equal parts)
    AllToAll = 9, "all_to_all", layout: false, reduces: false, buffers: (Group, Group);
    /// all_to_all_single (per-member split sizes)
    AllToAllSingle = 10, "all_to_all_single", layout: true, reduces: false, buffers: (Nothing, Nothing);
    /// all_gather_v (per-member counts)
    AllGatherV = 11, "all_gather_v", layout: true, reduces: false, buffers: (Part, Group);
    /// gather_v
    GatherV = 12, "gather_v", layout: true, reduces: false, buffers: (Part, RootGroup);
    /// scatter_v
    ScatterV = 13, "scatter_v", layout: true, reduces: false, buffers: (RootGroup, Part);
    /// reduce_scatter_v
    ReduceScatterV = 14, "reduce_scatter_v", layout: true, reduces: true, buffers: (Group, Part);
}

impl CollKind {
    /// The kind with this code (`kind as u8`), if any.
    pub fn from_code(code: u8) -> Option<CollKind> {
        Self::ALL.into_iter().find(|k| *k as u8 == code)
    }
}

/// One rank's description of the collective it entered. Plain data (`repr(C)`, `Copy`), so it can be
/// published in shared memory as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct Signature {
    /// Per-group sequence number of this call (1 for the first collective in the group).
    pub seq: u64,
    /// Elements each rank contributes (the per-rank part for all_gather/gather/scatter/reduce_scatter
    /// and all_to_all; the sum of the counts for the `_v` collectives; 0 for all_to_all_single, whose
    /// split sizes are compared as its layout).
    pub count: u64,
    /// Global rank of the root, for rooted collectives.
    pub root: Option<u32>,
    /// The collective.
    pub kind: CollKind,
    /// Element type, if the collective carries data.
    pub dtype: Option<DType>,
    /// Reduction operator, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// Horovod's scaling factors of a reduction ([`Scale::NONE`] when not scaled).
    pub scale: Scale,
}

impl Signature {
    /// A signature with no dtype, op or root set.
    pub fn new(kind: CollKind, seq: u64, count: usize) -> Self {
        Signature { seq, count: count as u64, root: None, kind, dtype: None, op: None, scale: Scale::NONE }
    }
    /// With the element type.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }
    /// With the reduction operator.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = Some(op);
        self
    }
    /// With scaling factors.
    pub fn scale(mut self, scale: Scale) -> Self {
        self.scale = scale;
        self
    }
    /// With the root's global rank.
    pub fn root(mut self, root: usize) -> Self {
        self.root = Some(root as u32);
        self
    }
    /// The sequence number in the text of a call, as `Display` writes it ("all_reduce(#3, ...)"); None
    /// for a call that has none (a send, a receive, setup). Errors carry their call as text.
    pub fn seq_in(call: &str) -> Option<u64> {
        let (_, after) = call.split_once("(#")?;
        let digits = after.find(|c: char| !c.is_ascii_digit()).map_or(after, |end| &after[..end]);
        digits.parse().ok()
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(#{}", self.kind.name(), self.seq)?;
        match self.dtype {
            Some(d) if self.kind == CollKind::AllToAllSingle => write!(f, ", {d}")?,
            Some(d) => write!(f, ", {} x {d}", self.count)?,
            None => {}
        }
        if let Some(op) = self.op {
            write!(f, ", op={op}")?;
        }
        if !self.scale.is_none() {
            write!(f, ", prescale={}, postscale={}", self.scale.pre, self.scale.post)?;
        }
        if let Some(r) = self.root {
            write!(f, ", root={r}")?;
        }
        f.write_str(")")
    }
}

/// Compare every member's signature; `None` when they all agree, else a message naming who differs
/// from the first member and how.
pub(crate) fn describe_mismatch(calls: &[(usize, Signature)]) -> Option<String> {
    let (r0, s0) = calls.first()?;
    let odd: Vec<String> =
        calls.iter().filter(|(_, s)| s != s0).map(|(r, s)| format!("rank {r} called {s}")).collect();
    (!odd.is_empty()).then(|| format!("rank {r0} called {s0}, but {}", odd.join(", ")))
}

/// Where one member of a group is, for timeout reports: the last call it completed and the one it
/// has entered since, if any.
pub(crate) struct Progress {
    /// Global rank.
    pub rank: usize,
    /// Sequence number of the last call it completed successfully (0: none yet), and its kind.
    pub completed: (u64, Option<CollKind>),
    /// Sequence number of the last call it entered, and its kind when known.
    pub entered: (u64, Option<CollKind>),
    /// Whether it has left the call it entered last (with an error, when that call is not completed).
    pub left: bool,
}

/// "; where each rank is: rank 0 completed #3 all_reduce and waits in #4 barrier, rank 1 completed #3
/// all_reduce", so a user sees who skipped what.
pub(crate) fn describe_progress(members: &[Progress]) -> String {
    let call = |(seq, kind): (u64, Option<CollKind>)| {
        format!("#{seq} {}", kind.map_or("(unknown call)", CollKind::name))
    };
    let each: Vec<String> = members
        .iter()
        .map(|p| {
            let done = if p.completed.0 == 0 {
                "completed no collective yet".into()
            } else {
                format!("completed {}", call(p.completed))
            };
            match (p.entered.0 > p.completed.0, p.left) {
                (false, _) => format!("rank {} {done}", p.rank),
                (true, false) => format!("rank {} {done} and waits in {}", p.rank, call(p.entered)),
                (true, true) => format!("rank {} {done} and left {} with an error", p.rank, call(p.entered)),
            }
        })
        .collect();
    format!("; where each rank is: {}", each.join(", "))
}

/// The mismatch error of a group whose members' calls are `calls` (in group order; `None` for a member
/// that has not entered the call), or `None` when every member entered the same one. The worlds that
/// publish signatures in memory compare them with `describe_mismatch`; a backend that exchanges them
/// (MPI) comes here, so its users read the same message.
pub fn mismatch(members: &[usize], calls: &[Option<Signature>]) -> Option<Error> {
    let entered: Vec<(usize, Signature)> =
        members.iter().zip(calls).filter_map(|(&r, s)| Some((r, (*s)?))).collect();
    let absent: Vec<usize> =
        members.iter().zip(calls).filter(|(_, s)| s.is_none()).map(|(&r, _)| r).collect();
    let details = match (describe_mismatch(&entered), &absent[..], entered.first()) {
        (details, [], _) => details?,
        (Some(d), _, _) => format!("{d}, and rank(s) {absent:?} entered no call"),
        (None, _, Some((r0, s0))) => format!("rank {r0} called {s0}, but rank(s) {absent:?} entered no call"),
        (None, _, None) => return None,
    };
    Some(mismatch_error(members, details, &entered))
}

/// The mismatch error of the group of global ranks `members`, whose calls were `calls` (those that
/// entered one, in group order), told in `details` ([`describe_mismatch`]).
pub(crate) fn mismatch_error(members: &[usize], details: String, calls: &[(usize, Signature)]) -> Error {
    let calls = calls.iter().map(|(r, s)| (*r, s.to_string())).collect();
    Error::Mismatch { group: members.to_vec(), details, calls }
}

#[cfg(test)]
mod tests {
    use super::{CollKind, Signature};
    use crate::dtype::DType;
    use crate::reduce::ReduceOp;

    #[test]
    fn seq_in_reads_the_sequence_number_display_writes() {
        for kind in CollKind::ALL {
            let sig = Signature::new(kind, 12345, 7).dtype(DType::F32).op(ReduceOp::Sum).root(3);
            assert_eq!(Signature::seq_in(&sig.to_string()), Some(12345), "{sig}");
            assert_eq!(Signature::seq_in(&Signature::new(kind, 1, 0).to_string()), Some(1), "{kind:?}");
        }
        assert_eq!(Signature::seq_in("send(4 x float32 to rank 1, tag 0)"), None);
        assert_eq!(Signature::seq_in("rendezvous"), None);
    }
}
