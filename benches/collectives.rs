//! Criterion benchmarks: the reduction kernels (and each kernel set against the baseline), gradient
//! bucket pack/unpack, and all_reduce on the in-process world and on the shared-memory world (private
//! arrays, one-shot sizes and the first past them; each rank a thread that maps the segment as a
//! process would).
//!
//! `cargo bench` runs all; `cargo bench -- allreduce/4` one group. The all-reduce timing is the
//! slowest rank's, for `iters` back-to-back collectives on persistent rank threads.

use std::hint::black_box;
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use axonml_distributed::reduce::{reduce_slices, reduce_slices_on, Kernels, Scale};
use axonml_distributed::transport::shm::{ShmBackend, ShmOptions};
use axonml_distributed::{Backend, Element};
use axonml_distributed::{GradientBucket, ProcessGroup, ReduceOp, ThreadBackend};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_kernel");
    for len in [1 << 10, 1 << 17, 1 << 20] {
        let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let b = a.clone();
        let mut out = vec![0.0f32; len];
        g.throughput(Throughput::Bytes((len * 4 * 3) as u64));
        // AVERAGE divides by the count, or multiplies when it is a power of two: 2 inputs against 3.
        for (name, op, inputs) in [
            ("sum_f32_2in", ReduceOp::Sum, vec![&a, &b]),
            ("avg_f32_2in", ReduceOp::Average, vec![&a, &b]),
            ("avg_f32_3in", ReduceOp::Average, vec![&a, &b, &a]),
        ] {
            let inputs: Vec<&[f32]> = inputs.into_iter().map(|v| &v[..]).collect();
            g.bench_with_input(BenchmarkId::new(name, len), &len, |bench, _| {
                bench.iter(|| reduce_slices(op, black_box(&inputs), &mut out).unwrap())
            });
        }
    }
    g.finish();
}

/// SUM of 2 inputs of `bytes` each on the baseline, then on the set this process chose, one after the
/// other for each size (so a change in the machine's load hits both): compare their ratio.
fn kernel_set_pair<T: Element>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    bytes: usize,
    x: impl Fn(usize) -> T,
) {
    let len = bytes / size_of::<T>();
    let a: Vec<T> = (0..len).map(&x).collect();
    let b: Vec<T> = (0..len).map(|i| x(i + 7)).collect();
    let mut out = a.clone();
    g.throughput(Throughput::Bytes((bytes * 3) as u64));
    for kernels in [Kernels::Baseline, Kernels::active()] {
        g.bench_function(BenchmarkId::new(format!("{name}/{kernels}"), bytes), |bench| {
            bench.iter(|| {
                reduce_slices_on(kernels, ReduceOp::Sum, Scale::NONE, black_box(&[&a[..], &b[..]]), &mut out)
                    .unwrap()
            })
        });
    }
}

fn kernel_sets(c: &mut Criterion) {
    let mut g = c.benchmark_group("kernel_sets");
    for bytes in [4 << 10, 256 << 10, 4 << 20] {
        kernel_set_pair(&mut g, "sum_f32_2in", bytes, |i| i as f32 * 0.37);
        kernel_set_pair(&mut g, "sum_bf16_2in", bytes, |i| bf16::from_f32(i as f32 * 0.37));
        kernel_set_pair(&mut g, "sum_f16_2in", bytes, |i| f16::from_f32((i % 4096) as f32 * 0.37));
    }
    g.finish();
}

fn buckets(c: &mut Criterion) {
    let mut g = c.benchmark_group("bucket");
    // 16 gradients of 64K f32 each (4 MiB): pack them into one bucket, then unpack.
    let grads: Vec<Vec<f32>> = (0..16).map(|i| vec![i as f32; 1 << 16]).collect();
    g.throughput(Throughput::Bytes((16 << 16) * 4));
    g.bench_function("pack_16x256KiB", |b| {
        let mut bucket = GradientBucket::new(16 << 16);
        b.iter(|| {
            bucket.clear();
            for gr in &grads {
                assert!(bucket.add(black_box(gr)).unwrap());
            }
        })
    });
    let mut full = GradientBucket::new(16 << 16);
    grads.iter().for_each(|gr| assert!(full.add(gr).unwrap()));
    g.bench_function("unpack_16x256KiB", |b| b.iter(|| black_box(full.extract::<f32>().unwrap())));
    g.finish();
}

/// Rank threads that run `iters` all-reduces of `len` f32 on command and report their elapsed time.
struct Ranks {
    go: Vec<mpsc::Sender<u64>>,
    done: mpsc::Receiver<Duration>,
}

impl Ranks {
    fn new(n: usize, len: usize) -> Ranks {
        let backends =
            ThreadBackend::create_world(n).into_iter().map(|b| move || Arc::new(b) as Arc<dyn Backend>);
        Ranks::with(backends.collect(), len, ReduceOp::Average)
    }

    /// Rank threads of an `n`-rank shared-memory world (each joins through rank 0's TCP store and maps
    /// the segment itself, as a process would), summing arrays of their own (private) memory.
    fn shm(n: usize, len: usize) -> Ranks {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let join = |r: usize| {
            move || {
                Arc::new(ShmBackend::connect(ShmOptions::new(r, n, "127.0.0.1", port)).unwrap())
                    as Arc<dyn Backend>
            }
        };
        Ranks::with((0..n).map(join).collect(), len, ReduceOp::Sum)
    }

    /// One thread per rank, each making its backend with `make`.
    fn with<F: FnOnce() -> Arc<dyn Backend> + Send + 'static>(
        make: Vec<F>,
        len: usize,
        op: ReduceOp,
    ) -> Ranks {
        let (done_tx, done) = mpsc::channel();
        let start = Arc::new(Barrier::new(make.len()));
        let go = make
            .into_iter()
            .map(|make| {
                let (tx, rx) = mpsc::channel::<u64>();
                let (done_tx, start) = (done_tx.clone(), start.clone());
                std::thread::spawn(move || {
                    let pg = ProcessGroup::new(make());
                    // Zeros: repeated sums stay finite.
                    let mut x = vec![0.0f32; len];
                    for iters in rx {
                        start.wait();
                        let t = Instant::now();
                        for _ in 0..iters {
                            pg.all_reduce(&mut x, op).unwrap();
                        }
                        done_tx.send(t.elapsed()).unwrap();
                    }
                });
                tx
            })
            .collect();
        Ranks { go, done }
    }

    fn time(&self, iters: u64) -> Duration {
        self.go.iter().for_each(|g| g.send(iters).unwrap());
        (0..self.go.len()).map(|_| self.done.recv().unwrap()).max().unwrap()
    }
}

fn allreduce(c: &mut Criterion) {
    for n in [2usize, 4] {
        let mut g = c.benchmark_group(format!("allreduce/{n}"));
        g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
        for bytes in [8usize, 64 << 10, 64 << 20] {
            let ranks = Ranks::new(n, bytes / 4);
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(BenchmarkId::new("threads/f32", bytes), |b| {
                b.iter_custom(|iters| ranks.time(iters))
            });
        }
        g.finish();
    }
}

/// The shared-memory world on private arrays, from one-shot sizes to the first staged one.
fn shm_allreduce(c: &mut Criterion) {
    for n in [2usize, 4] {
        let mut g = c.benchmark_group(format!("shm_allreduce/{n}"));
        g.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
        for bytes in [8usize, 4 << 10, 64 << 10, 256 << 10] {
            let ranks = Ranks::shm(n, bytes / 4);
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(BenchmarkId::new("f32", bytes), |b| b.iter_custom(|iters| ranks.time(iters)));
        }
        g.finish();
    }
}

criterion_group!(benches, kernels, kernel_sets, buckets, allreduce, shm_allreduce);
criterion_main!(benches);
