//! Where the data of the pairwise collectives goes (all_to_all, all_to_all_single and the `_v`
//! collectives): a [`Plan`] of byte ranges, "member j's send `[src, src + len)` goes to member i's recv
//! at `dst`", built on every member from the same inputs, so every member knows every transfer.
//!
//! all_to_all builds it from the signature alone. The others from the layouts the members published
//! beside their signatures (see [`words`]): counts (every member passes the same vector) or split
//! sizes (member j's input split i must equal member i's output split j). A layout that disagrees
//! fails every member alike, before any buffer is touched. Layouts from peers are checked, never
//! trusted: every sum and product is checked arithmetic.

use crate::signature::{CollKind, Extent, Signature};

/// Words of one member's layout for `kind` in a group of `n`: split sizes (input, then output) for
/// all_to_all_single, the counts for the `_v` collectives, none otherwise.
pub(crate) fn words(kind: CollKind, n: usize) -> usize {
    match kind {
        CollKind::AllToAllSingle => 2 * n,
        k if k.has_layout() => n,
        _ => 0,
    }
}

/// The byte ranges of one pairwise collective, for every (sender j, receiver i) pair at `j * n + i`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub n: usize,
    /// Bytes j sends i.
    pub len: Vec<usize>,
    /// Where they start in j's send.
    pub src: Vec<usize>,
    /// Where they land in i's recv.
    pub dst: Vec<usize>,
    /// reduce_scatter_v: receiver i reduces the pieces of every sender, in rank order, into its recv.
    pub reduce: bool,
    /// Every receiver's piece from a sender is the same bytes (all_gather_v, gather_v).
    pub shared: bool,
    /// Bytes of each member's send and recv buffer.
    pub spans: Vec<(usize, usize)>,
}

/// Why members' layouts cannot make one plan.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// They disagree: who passed what, for the mismatch error.
    Disagree(String),
    /// A size overflows (only a corrupted layout does: each member checked its own against its buffers).
    Overflow,
}

fn mul(a: u64, e: usize) -> Result<usize, Fault> {
    usize::try_from(a).ok().and_then(|a| a.checked_mul(e)).ok_or(Fault::Overflow)
}

fn sum(v: impl IntoIterator<Item = usize>) -> Result<usize, Fault> {
    v.into_iter().try_fold(0usize, |a, b| a.checked_add(b)).ok_or(Fault::Overflow)
}

/// Offsets of consecutive pieces of these lengths.
fn prefix(lens: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut at = 0;
    // Overflow is impossible: callers checked the sum of the same lengths first.
    lens.into_iter()
        .map(|l| {
            let start = at;
            at += l;
            start
        })
        .collect()
}

impl Plan {
    /// The plan of `sig` (`elem` bytes per element, `root` a group index) in a group whose members
    /// published `layouts` (in group order; ignored for all_to_all). `members` names them in errors.
    pub(crate) fn new(
        sig: &Signature,
        elem: usize,
        root: Option<usize>,
        layouts: &[&[u64]],
        members: &[usize],
    ) -> Result<Plan, Fault> {
        let n = members.len();
        let mut p = Plan {
            n,
            len: vec![0; n * n],
            src: vec![0; n * n],
            dst: vec![0; n * n],
            reduce: sig.kind.reduces(),
            // A sender's whole input goes to each receiver (all_gather_v, gather_v).
            shared: sig.kind.buffers().0 == Extent::Part,
            spans: vec![(0, 0); n],
        };
        match sig.kind {
            CollKind::AllToAll => {
                let part = mul(sig.count, elem)?;
                let whole = part.checked_mul(n).ok_or(Fault::Overflow)?;
                for j in 0..n {
                    for i in 0..n {
                        (p.len[j * n + i], p.src[j * n + i], p.dst[j * n + i]) = (part, i * part, j * part);
                    }
                }
                p.spans.fill((whole, whole));
            }
            CollKind::AllToAllSingle => p.splits(sig, elem, layouts, members)?,
            _ => p.counts(sig, elem, root.unwrap_or(0), layouts, members)?,
        }
        Ok(p)
    }

    /// all_to_all_single: member j's layout is its input split sizes, then its output split sizes.
    fn splits(
        &mut self,
        sig: &Signature,
        e: usize,
        layouts: &[&[u64]],
        members: &[usize],
    ) -> Result<(), Fault> {
        let n = self.n;
        let (input, output) = (|j: usize| &layouts[j][..n], |i: usize| &layouts[i][n..]);
        let odd: Vec<String> = (0..n)
            .flat_map(|j| (0..n).map(move |i| (j, i)))
            .filter(|&(j, i)| input(j)[i] != output(i)[j])
            .map(|(j, i)| {
                let (rj, ri) = (members[j], members[i]);
                format!(
                    "rank {rj} sends {} element(s) to rank {ri} (input_split_sizes) but rank {ri} expects {} \
                     from rank {rj} (output_split_sizes)",
                    input(j)[i],
                    output(i)[j]
                )
            })
            .collect();
        if !odd.is_empty() {
            return Err(Fault::Disagree(format!("{sig}: {}", odd.join("; "))));
        }
        for j in 0..n {
            let lens = input(j).iter().map(|&c| mul(c, e)).collect::<Result<Vec<_>, _>>()?;
            self.spans[j].0 = sum(lens.iter().copied())?;
            for (i, off) in prefix(lens.iter().copied()).into_iter().enumerate() {
                (self.len[j * n + i], self.src[j * n + i]) = (lens[i], off);
            }
        }
        for i in 0..n {
            let lens: Vec<usize> = (0..n).map(|j| self.len[j * n + i]).collect();
            self.spans[i].1 = sum(lens.iter().copied())?;
            for (j, off) in prefix(lens).into_iter().enumerate() {
                self.dst[j * n + i] = off;
            }
        }
        Ok(())
    }

    /// The `_v` collectives: every member passes the same counts (elements of member i's part).
    fn counts(
        &mut self,
        sig: &Signature,
        e: usize,
        root: usize,
        layouts: &[&[u64]],
        members: &[usize],
    ) -> Result<(), Fault> {
        let n = self.n;
        let odd: Vec<String> = (1..n)
            .filter(|&j| layouts[j] != layouts[0])
            .map(|j| format!("rank {} passed counts {:?}", members[j], layouts[j]))
            .collect();
        if !odd.is_empty() {
            let first = format!("rank {} passed counts {:?}", members[0], layouts[0]);
            return Err(Fault::Disagree(format!("{sig}: {first}, but {}", odd.join(", "))));
        }
        let lens = layouts[0].iter().map(|&c| mul(c, e)).collect::<Result<Vec<_>, _>>()?;
        let total = sum(lens.iter().copied())?;
        let offs = prefix(lens.iter().copied());
        // The buffers that hold every member's part take member j's piece at its offset, the others
        // hold member j's part alone: a sender's part goes whole into every receiver's (gathering), or
        // a sender's group buffer is cut into one piece per receiver (scattering).
        let (send, recv) = sig.kind.buffers();
        let span = |e: Extent, j: usize| match e {
            _ if !e.on(j, root) => 0,
            _ if e.is_group() => total,
            _ => lens[j],
        };
        for j in 0..n {
            for i in (0..n).filter(|&i| send.on(j, root) && recv.on(i, root)) {
                let at = j * n + i;
                if recv.is_group() {
                    (self.len[at], self.dst[at]) = (lens[j], offs[j]);
                } else {
                    (self.len[at], self.src[at]) = (lens[i], offs[i]);
                }
            }
            self.spans[j] = (span(send, j), span(recv, j));
        }
        Ok(())
    }

    /// True when no byte moves.
    pub(crate) fn is_empty(&self) -> bool {
        self.len.iter().all(|&l| l == 0)
    }

    /// The longest piece any pair moves.
    pub(crate) fn longest(&self) -> usize {
        self.len.iter().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn sig(kind: CollKind, count: u64) -> Signature {
        Signature::new(kind, 1, count as usize).dtype(DType::F32)
    }

    #[test]
    fn split_sizes_make_offsets_and_spans() {
        // Rank 0 sends 1 to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and none to itself.
        let l0 = [1, 2, 1, 3];
        let l1 = [3, 0, 2, 0];
        let p = Plan::new(&sig(CollKind::AllToAllSingle, 0), 4, None, &[&l0, &l1], &[0, 1]).unwrap();
        assert_eq!(p.len, vec![4, 8, 12, 0]);
        assert_eq!(p.src, vec![0, 4, 0, 12]);
        assert_eq!(p.dst, vec![0, 0, 4, 8]);
        assert_eq!(p.spans, vec![(12, 16), (12, 8)]);
    }

    #[test]
    fn disagreeing_layouts_name_the_ranks() {
        let s = sig(CollKind::AllToAllSingle, 0);
        let Err(Fault::Disagree(d)) = Plan::new(&s, 4, None, &[&[1, 1, 1, 1], &[2, 1, 1, 1]], &[3, 5]) else {
            panic!("agreed")
        };
        assert!(d.contains("rank 5 sends 2 element(s) to rank 3"), "{d}");
        let s = sig(CollKind::AllGatherV, 3);
        let Err(Fault::Disagree(d)) = Plan::new(&s, 4, None, &[&[1, 2], &[2, 1]], &[0, 1]) else {
            panic!("agreed")
        };
        assert!(d.contains("rank 0 passed counts [1, 2], but rank 1 passed counts [2, 1]"), "{d}");
    }

    #[test]
    fn huge_layouts_are_refused_not_wrapped() {
        let s = sig(CollKind::AllGatherV, 0);
        let big = [u64::MAX / 2, u64::MAX / 2];
        assert_eq!(Plan::new(&s, 4, None, &[&big, &big], &[0, 1]), Err(Fault::Overflow));
    }
}
