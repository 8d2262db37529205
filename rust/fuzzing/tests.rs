//! The bounded fuzz run of `cargo test`: each entry point of `fuzzing` on arbitrary bytes and on valid
//! encodings mutated (bits flipped, truncated, extended, words set to boundary values), and each
//! encoder's output accepted back as what it encoded. `PROPTEST_CASES=<n>` runs more cases.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

use super::*;
use crate::dtype::DType;
use crate::reduce::{ReduceOp, Scale};
use crate::rendezvous::parsers::{Hello, Request, Verdict};
use crate::transport::shm::parsers::Head;
use crate::transport::shm::PREFIX;

/// Values that break careless size arithmetic.
const BOUNDARIES: [u64; 16] = [
    0,
    1,
    2,
    63,
    64,
    65,
    4095,
    4096,
    65535,
    65536,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Extend(Vec<u8>),
    /// An 8-byte word (aligned to the encoding's words) set to a value.
    Word(usize, u64),
}

fn value() -> impl Strategy<Value = u64> {
    prop_oneof![select(BOUNDARIES.to_vec()), any::<u64>()]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0..8u8).prop_map(|(i, bit)| Mutation::Flip(i, bit)),
        any::<usize>().prop_map(Mutation::Truncate),
        vec(any::<u8>(), 1..24).prop_map(Mutation::Extend),
        (any::<usize>(), value()).prop_map(|(i, v)| Mutation::Word(i, v)),
    ]
}

/// `b` with `ms` applied; its words start at byte `origin`.
fn mutate(mut b: Vec<u8>, ms: Vec<Mutation>, origin: usize) -> Vec<u8> {
    for m in ms {
        let n = b.len();
        match m {
            Mutation::Flip(i, bit) if n > 0 => b[i % n] ^= 1 << bit,
            Mutation::Truncate(k) => b.truncate(k % (n + 1)),
            Mutation::Extend(x) => b.extend(x),
            Mutation::Word(i, v) if n > origin => {
                let at = origin + (i % (n - origin)) / 8 * 8;
                let k = (n - at).min(8);
                b[at..at + k].copy_from_slice(&v.to_le_bytes()[..k]);
            }
            _ => {}
        }
    }
    b
}

/// Mostly valid encodings mutated up to three times (words from byte `origin`), else arbitrary bytes.
fn inputs(valid: impl Strategy<Value = Vec<u8>>, origin: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => (valid, vec(mutation(), 0..4)).prop_map(move |(b, ms)| mutate(b, ms, origin)),
        1 => vec(any::<u8>(), 0..256),
    ]
}

fn hellos() -> impl Strategy<Value = Hello> {
    let number = prop_oneof![0..80u32, any::<u32>()];
    let proof = prop_oneof![Just(None), any::<[u8; 32]>().prop_map(Some)];
    (number.clone(), number, "[a-zé0-9 ()-]{0,80}", any::<[u8; 32]>(), proof)
        .prop_map(|(rank, world, host, nonce, proof)| Hello { rank, world, host, nonce, proof })
}

fn verdicts() -> impl Strategy<Value = Verdict> {
    (any::<[u8; 32]>(), any::<bool>(), vec(any::<u8>(), 0..300), vec(any::<[u8; 32]>(), 0..9))
        .prop_map(|(nonce, admitted, body, tags)| Verdict { nonce, admitted, body, tags })
}

fn requests() -> impl Strategy<Value = Request> {
    let key = "[a-z/0-9]{0,40}";
    prop_oneof![
        (key, vec(any::<u8>(), 0..300)).prop_map(|(k, v)| Request::Set(k, v)),
        key.prop_map(Request::Get),
        (key, any::<i64>()).prop_map(|(k, d)| Request::Add(k, d)),
        key.prop_map(Request::Delete),
        key.prop_map(Request::Check),
    ]
}

fn frame_streams() -> impl Strategy<Value = Vec<u8>> {
    let frames =
        prop_oneof![(any::<u8>(), vec(any::<u8>(), 0..300)), requests().prop_map(|q| r::request(&q)),];
    vec(frames, 0..4).prop_map(|fs| fs.iter().flat_map(|(status, body)| r::frame(*status, body)).collect())
}

/// Segment names as `segment::name_for` makes them.
fn names() -> impl Strategy<Value = String> {
    let chars: Vec<char> = "abcxyzABCXYZ0189-_".chars().collect();
    (any::<u32>(), vec(select(chars), 1..64))
        .prop_map(|(uid, s)| format!("{PREFIX}{uid}-{}", s.into_iter().collect::<String>()))
}

fn tokens() -> impl Strategy<Value = Vec<u8>> {
    (1..=p::MAX_RANKS, names(), any::<[u8; 16]>()).prop_map(|(world, name, nonce)| {
        [&[world as u8][..], p::token(&name, nonce, world).as_bytes()].concat()
    })
}

/// A segment's valid header, as [`segment_header`] takes it (mode 0: the bytes as they are).
fn headers() -> impl Strategy<Value = Vec<u8>> {
    let chunk = prop_oneof![Just(None), (1..=1024usize).prop_map(|pages| Some(pages * 4096))];
    (1..=p::MAX_RANKS, 0..(64usize << 20), chunk, any::<[u8; 16]>())
        .prop_filter_map("parameters a creator refuses", |(world, arena, chunk, nonce)| {
            Some([&[0][..], &valid_header(world, arena, chunk, nonce)?].concat())
        })
}

fn heads() -> impl Strategy<Value = Head> {
    let count = prop_oneof![0..(1u64 << 20), value()];
    (any::<u64>(), select(DType::ALL.to_vec()), count, value()).prop_map(|(tag, dtype, count, number)| Head {
        tag,
        dtype,
        count,
        number,
    })
}

fn signatures() -> impl Strategy<Value = Signature> {
    let kind = select(CollKind::ALL.to_vec());
    let dtype = proptest::option::of(select(DType::ALL.to_vec()));
    let op = proptest::option::of(select(ReduceOp::ALL.to_vec()));
    let scale = (any::<u64>(), any::<u64>())
        .prop_map(|(pre, post)| Scale { pre: f64::from_bits(pre), post: f64::from_bits(post) });
    (kind, value(), value(), proptest::option::of(any::<u32>()), dtype, op, scale).prop_map(
        |(kind, seq, count, root, dtype, op, scale)| Signature { seq, count, root, kind, dtype, op, scale },
    )
}

fn words_of(w: &[u64]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Plan inputs: the four choice bytes, all_to_all's count, and layout words, small or boundary ones.
fn plans() -> impl Strategy<Value = Vec<u8>> {
    let word = prop_oneof![3 => 0..100u64, 1 => value()];
    (any::<[u8; 4]>(), value(), vec(word, 0..600))
        .prop_map(|(choice, count, w)| [&choice[..], &words_of(&[count]), &words_of(&w)].concat())
}

/// 4096 cases a property (the whole run takes well under a second), or PROPTEST_CASES of them.
fn config() -> ProptestConfig {
    let cases =
        if std::env::var_os("PROPTEST_CASES").is_some() { ProptestConfig::default().cases } else { 4096 };
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn hellos_are_refused_or_exact(data in inputs(hellos().prop_map(|h| h.encode()), 8)) {
        hello(&data);
    }

    #[test]
    fn frames_are_bounded_and_exact(data in inputs(frame_streams(), 1)) {
        frames(&data);
    }

    #[test]
    fn verdicts_are_refused_or_exact(data in inputs(verdicts().prop_map(|v| v.encode()), 8)) {
        verdict(&data);
    }

    #[test]
    fn tokens_are_refused_or_exact(data in inputs(tokens(), 1)) {
        token(&data);
    }

    #[test]
    fn segment_headers_are_refused_or_describe_the_file(data in inputs(headers(), 26)) {
        segment_header(&data);
    }

    #[test]
    fn message_headers_are_refused_or_exact(
        data in inputs(heads().prop_map(|h| words_of(&[&[h.number][..], &h.words()].concat())), 0)
    ) {
        message_header(&data);
    }

    #[test]
    fn signatures_are_refused_or_exact(data in inputs(signatures().prop_map(|s| words_of(&wire::encode(&s))), 0)) {
        signature(&data);
    }

    #[test]
    fn plans_are_refused_or_keep_every_piece_inside_the_buffers(data in inputs(plans(), 4)) {
        plan(&data);
    }

    /// What the encoders write is accepted back as what they encoded.
    #[test]
    fn encodings_round_trip(
        h in hellos(), v in verdicts(), q in requests(), name in names(), nonce in any::<[u8; 16]>(),
        world in 1..=p::MAX_RANKS, head in heads(), sig in signatures(), status in any::<u8>(),
        body in vec(any::<u8>(), 0..300),
    ) {
        prop_assert_eq!(Hello::decode(&h.encode()), Some(h));
        prop_assert_eq!(Verdict::decode(&v.encode()), Some(v));
        let (op, req) = r::request(&q);
        prop_assert_eq!(r::parse_request(op, &req), Some(q));
        prop_assert_eq!(p::parse_token(&p::token(&name, nonce, world), world).ok(), Some((name, nonce)));
        let bytes = (head.count as u128 * head.dtype.size() as u128).try_into().ok();
        prop_assert_eq!(p::Head::read(head.words(), head.number), bytes.map(|b| (head, b)));
        prop_assert_eq!(wire::decode(wire::encode(&sig)), Some(sig));
        let f = r::frame(status, &body);
        prop_assert_eq!(r::frame_head(f[..3].try_into().unwrap()), (status, body.len()));
        prop_assert_eq!(&f[3..], &body[..]);
    }
}

#[test]
fn valid_headers_are_accepted() {
    for world in [1, 2, 3, 8, 9, 64] {
        let layout = Layout::new(Params::new(world, 3 << 20)).unwrap();
        let mut h = Header::zeroed();
        h.init(&layout, [5; 16]);
        assert_eq!(p::validate(&h, layout.total, world, [5; 16]), Ok(layout));
    }
}

#[test]
fn agreeing_layouts_make_plans() {
    // AllGatherV (kind 2) of 3 members with counts 1, 2, 3 and 4-byte elements (elem choice 2).
    let mut data = vec![2, 0x80 | 2, 2, 0];
    data.extend(words_of(&[0, 1, 2, 3, 1, 2, 3, 1, 2, 3]));
    plan(&data);
    let s = Signature::new(CollKind::AllGatherV, 1, 0).dtype(DType::U8);
    let l: &[u64] = &[1, 2, 3];
    assert!(Plan::new(&s, 4, Some(0), &[l, l, l], &[0, 1, 2]).is_ok());
}

/// A frame's body is bounded by its 16-bit length: the largest a peer can announce is [`MAX_BODY`],
/// and a longer body is cut there rather than wrapping the length.
#[test]
fn frame_bodies_are_bounded() {
    assert_eq!(r::frame_head([1, 0xff, 0xff]), (1, r::MAX_BODY));
    let long = vec![7u8; r::MAX_BODY + 10];
    let f = r::frame(2, &long);
    assert_eq!((f.len(), r::frame_head(f[..3].try_into().unwrap())), (3 + r::MAX_BODY, (2, r::MAX_BODY)));
    frames(&f);
}
