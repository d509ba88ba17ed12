//! Running workloads on pinned threads and reporting medians.

use std::io::{IsTerminal as _, Write as _};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

/// One implementation of a scenario, built fresh for each measurement.
pub trait Workload: Sync {
    /// Performs `iters` operations as worker `tid` (of `threads`).
    fn run(&self, tid: usize, iters: u64);

    /// The row worker `tid` reports into: `""` for the implementation's own
    /// row, or a role such as `"reads"` (reported as `IMPL:reads`).
    fn role(&self, _tid: usize) -> &'static str {
        ""
    }

    /// Operations per call of [`run`](Self::run) for worker `tid`; the stop
    /// flag is checked once per batch, so the harness costs nothing per
    /// operation.
    fn batch(&self, _tid: usize) -> u64 {
        1024
    }

    /// Workers per requested thread: `threads` counts CPUs, and each CPU
    /// runs this many workers pinned to it (to measure oversubscription;
    /// rows count every worker in their label and report per CPU).
    fn oversubscription(&self) -> usize {
        1
    }

    /// Checks the work done against `ops_per_worker` (e.g. a counter's sum
    /// against the operations counted), after all workers stopped.
    fn verify(&self, _ops_per_worker: &[u64]) -> Result<(), String> {
        Ok(())
    }
}

/// Builds the workload of implementation `imp` for `threads` workers, or
/// says why it cannot run here (the row is then skipped with that reason).
pub type Build = fn(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String>;

/// A named benchmark with its implementations.
#[derive(Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub impls: &'static [&'static str],
    pub build: Build,
    /// The implementations that can be built as if the machine had N
    /// CPUs (`--lists N`): each runs once per N, as `IMPL@N`, and its build
    /// gets that name ([`split_lists`]).
    pub lists: &'static [&'static str],
}

/// An implementation name and the list count `--lists` gave it
/// (`"hint@256"` -> `("hint", Some(256))`).
#[must_use]
pub fn split_lists(imp: &str) -> (&str, Option<usize>) {
    match imp.split_once('@') {
        Some((name, n)) => (name, n.parse().ok()),
        None => (imp, None),
    }
}

/// How to run: thread counts, durations, repetitions, implementation filter.
#[derive(Clone, Debug)]
pub struct Options {
    pub threads: Vec<usize>,
    pub duration: Duration,
    pub runs: usize,
    pub impls: Option<Vec<String>>,
    /// List counts for the implementations that take one (see
    /// [`Scenario::lists`]); empty: the machine's.
    pub lists: Vec<usize>,
}

/// One reported line: the median over runs of one (row, threads).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub scenario: String,
    #[serde(rename = "impl")]
    pub imp: String,
    /// The requested thread count (one of `--threads`).
    pub threads: usize,
    /// Worker threads that ran: `threads` times the workload's
    /// oversubscription.
    pub workers: usize,
    /// Distinct CPUs the workers were pinned to: `threads`, or the number
    /// of allowed CPUs when `threads` exceeds it.
    pub cpus: usize,
    /// Median total throughput, million operations per second.
    pub mops: f64,
    /// Sample standard deviation of the runs' totals.
    pub stddev: f64,
    /// `mops` divided by `threads`.
    pub mops_per_thread: f64,
    /// Number of runs the median is taken over.
    pub runs: usize,
    /// Each run's total, in run order.
    pub samples: Vec<f64>,
}

/// Column widths that line up a set of rows (see [`Row::line`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Columns {
    name: usize,
    label: usize,
}

impl Columns {
    /// The widths that fit every row of `rows`.
    pub fn fit<'a>(rows: impl IntoIterator<Item = &'a Row>) -> Self {
        rows.into_iter().fold(Self::default(), |c, r| Self {
            name: c.name.max(r.name().len()),
            label: c.label.max(r.label().len()),
        })
    }
}

impl Row {
    /// `SCENARIO/IMPL`.
    #[must_use]
    pub fn name(&self) -> String {
        format!("{}/{}", self.scenario, self.imp)
    }

    /// What ran, in parentheses: `(  2 threads)` with a CPU of its own for
    /// each thread, `(  4 threads on 2 cpus)` when threads share CPUs.
    #[must_use]
    pub fn label(&self) -> String {
        let plural = |n: usize, what: &str| format!("{what}{}", if n == 1 { "" } else { "s" });
        let threads = format!("{:>3} {}", self.workers, plural(self.workers, "thread"));
        if self.workers > self.cpus {
            format!("({threads} on {} {})", self.cpus, plural(self.cpus, "cpu"))
        } else {
            format!("({threads})")
        }
    }

    /// The row in the kernel selftests' format, with the thread count
    /// spelled out: `NAME (LABEL): TOTAL ± STDDEV M/s  (PER_CPU M/s/cpu)`,
    /// padded to `cols`.
    #[must_use]
    pub fn line(&self, cols: Columns) -> String {
        // Three decimals as in the seeds, more for slow rows (a writer
        // paced at thousands per second would print as 0.005).
        let p = if self.mops < 0.1 { 6 } else { 3 };
        format!(
            "{:<name$} {:<label$} {:>9.p$} ± {:>7.p$}M/s  ({:>8.p$}M/s/cpu)",
            self.name(),
            format!("{}:", self.label()),
            self.mops,
            self.stddev,
            self.mops / self.cpus.max(1) as f64,
            name = cols.name,
            label = cols.label + 1,
        )
    }
}

/// The CPUs this process may run on (its affinity mask), in order.
#[must_use]
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut set) != 0 {
            return (0..std::thread::available_parallelism().map_or(1, usize::from)).collect();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn pin_to(cpu: usize) {
    // SAFETY: as above; a failure to pin only makes the run less tidy.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set);
    }
}

/// Runs `w` on `threads` workers (times its oversubscription) pinned
/// round-robin to the first `threads` of `cpus` for `duration`; returns
/// each worker's operations and rate (ops/s).
fn measure(
    w: &dyn Workload,
    threads: usize,
    cpus: &[usize],
    duration: Duration,
) -> Vec<(u64, f64)> {
    let workers = threads * w.oversubscription().max(1);
    let stop = AtomicBool::new(false);
    let start = Barrier::new(workers + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..workers)
            .map(|tid| {
                let (stop, start) = (&stop, &start);
                let cpu = cpus[(tid % threads) % cpus.len()];
                s.spawn(move || {
                    pin_to(cpu);
                    let batch = w.batch(tid).max(1);
                    start.wait();
                    let t0 = Instant::now();
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        w.run(tid, batch);
                        ops += batch;
                    }
                    (ops, ops as f64 / t0.elapsed().as_secs_f64())
                })
            })
            .collect();
        start.wait();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        workers
            .into_iter()
            .map(|h| h.join().expect("benchmark worker panicked"))
            .collect()
    })
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

fn stddev(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// Progress on stderr, for runs longer than a few seconds.
struct Progress {
    total: usize,
    done: usize,
    enabled: bool,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        if !self.enabled {
            return;
        }
        if std::io::stderr().is_terminal() {
            eprint!("\r\x1b[2K[{}/{}] {what}", self.done, self.total);
            let _ = std::io::stderr().flush();
        } else if self.done == 1 || self.done * 10 / self.total != (self.done - 1) * 10 / self.total
        {
            // Logs get a line per tenth, not a line per measurement.
            eprintln!("[{}/{}] {what}", self.done, self.total);
        }
    }

    fn finish(&self) {
        if self.enabled && std::io::stderr().is_terminal() {
            eprint!("\r\x1b[2K");
        }
    }
}

/// The implementations of `sc` that `selection` names (all of them for
/// `None`), in the scenario's order; an unknown name is an error.
pub fn select_impls<'a>(
    sc: &'a Scenario,
    selection: Option<&[String]>,
) -> Result<Vec<&'a str>, String> {
    let Some(sel) = selection else {
        return Ok(sc.impls.to_vec());
    };
    for s in sel {
        if !sc.impls.contains(&s.as_str()) {
            return Err(format!(
                "scenario {} has no implementation {s:?} (it has: {})",
                sc.name,
                sc.impls.join(", ")
            ));
        }
    }
    Ok(sc
        .impls
        .iter()
        .copied()
        .filter(|i| sel.iter().any(|s| s == i))
        .collect())
}

/// Runs every selected implementation of `sc` at every thread count,
/// interleaved run by run, and returns the rows plus the skip reasons.
pub fn run_scenario(sc: &Scenario, opts: &Options) -> Result<Outcomes, String> {
    let impls = select_impls(sc, opts.impls.as_deref())?;
    if !opts.lists.is_empty() && !impls.iter().any(|i| sc.lists.contains(i)) {
        return Err(format!(
            "scenario {} has no implementation that takes --lists",
            sc.name
        ));
    }
    let impls: Vec<String> = impls
        .into_iter()
        .flat_map(|imp| {
            let counts: Vec<String> = if sc.lists.contains(&imp) && !opts.lists.is_empty() {
                opts.lists.iter().map(|n| format!("{imp}@{n}")).collect()
            } else {
                vec![imp.to_string()]
            };
            counts
        })
        .collect();
    let mut results = run_plan(&[(sc, impls)], opts)?;
    Ok(results.remove(0))
}

/// Runs several scenarios (each with its implementations) in one
/// interleaved pass: every run goes through every scenario, thread count
/// and implementation before the next run starts, so a noisy moment
/// spreads over all of them. Returns, per scenario, its rows and skip
/// reasons. `opts.impls` is not used (the plan names the implementations).
pub fn run_plan<S: AsRef<str>>(
    plan: &[(&Scenario, Vec<S>)],
    opts: &Options,
) -> Result<Vec<Outcomes>, String> {
    let cpus = allowed_cpus();
    let per_run: usize = plan.iter().map(|(_, impls)| impls.len()).sum();
    let steps = opts.runs * opts.threads.len() * per_run;
    let mut progress = Progress {
        total: steps,
        done: 0,
        enabled: opts.duration.as_secs_f64() * steps as f64 > 3.0,
    };
    // Per scenario: (row name, threads) -> per-run totals, in first-seen
    // order; and the skip reasons.
    let mut samples: Vec<Samples> = plan.iter().map(|_| Vec::new()).collect();
    let mut skipped: Vec<Vec<String>> = plan.iter().map(|_| Vec::new()).collect();
    for _run in 0..opts.runs {
        for (i, (sc, impls)) in plan.iter().enumerate() {
            for &threads in &opts.threads {
                for imp in impls {
                    let imp = imp.as_ref();
                    progress.step(&format!("{}/{imp} ({threads} threads)", sc.name));
                    measure_one(sc, imp, threads, &cpus, opts.duration, &mut samples[i]).or_else(
                        |skip| match skip {
                            Outcome::Skipped(line) => {
                                if !skipped[i].contains(&line) {
                                    skipped[i].push(line);
                                }
                                Ok(())
                            }
                            Outcome::Failed(e) => Err(e),
                        },
                    )?;
                }
            }
        }
    }
    progress.finish();
    Ok(plan
        .iter()
        .zip(samples)
        .zip(skipped)
        .map(|(((sc, _), samples), skipped)| (rows_from(sc.name, &samples), skipped))
        .collect())
}

/// What a scenario produced: its rows, and the lines saying which
/// implementations were skipped and why.
pub type Outcomes = (Vec<Row>, Vec<String>);

/// Per-run totals of one row name at one thread count.
struct Series {
    name: String,
    threads: usize,
    workers: usize,
    cpus: usize,
    totals: Vec<f64>,
}

/// Per-run totals of one scenario's rows, in first-seen order.
type Samples = Vec<Series>;

/// Why a measurement produced no sample.
enum Outcome {
    /// The implementation cannot run here (the reason, as a line).
    Skipped(String),
    /// It ran and failed its check: the whole run fails.
    Failed(String),
}

/// Builds and measures one (implementation, thread count), adding its
/// rows' totals to `samples`.
fn measure_one(
    sc: &Scenario,
    imp: &str,
    threads: usize,
    cpus: &[usize],
    duration: Duration,
    samples: &mut Samples,
) -> Result<(), Outcome> {
    let w = (sc.build)(imp, threads).map_err(|why| {
        Outcome::Skipped(format!(
            "{}/{imp} ({threads} threads): skipped: {why}",
            sc.name
        ))
    })?;
    let results = measure(&*w, threads, cpus, duration);
    let workers = results.len();
    let op_counts: Vec<u64> = results.iter().map(|r| r.0).collect();
    w.verify(&op_counts).map_err(|e| {
        Outcome::Failed(format!(
            "{}/{imp} ({threads} threads) failed its check: {e}",
            sc.name
        ))
    })?;
    let mut per_role: Vec<(&'static str, f64)> = Vec::new();
    for (tid, (_, rate)) in results.iter().enumerate() {
        let role = w.role(tid);
        match per_role.iter_mut().find(|(r, _)| *r == role) {
            Some((_, total)) => *total += rate,
            None => per_role.push((role, *rate)),
        }
    }
    for (role, rate) in per_role {
        let name = if role.is_empty() {
            imp.to_string()
        } else {
            format!("{imp}:{role}")
        };
        match samples
            .iter_mut()
            .find(|s| s.name == name && s.threads == threads)
        {
            Some(s) => s.totals.push(rate / 1e6),
            None => samples.push(Series {
                name,
                threads,
                workers,
                cpus: threads.min(cpus.len()),
                totals: vec![rate / 1e6],
            }),
        }
    }
    Ok(())
}

/// Medians per (row, threads), grouped by row as the seeds' tables are.
fn rows_from(scenario: &str, samples: &[Series]) -> Vec<Row> {
    let mut order: Vec<&str> = Vec::new();
    for s in samples {
        if !order.contains(&s.name.as_str()) {
            order.push(&s.name);
        }
    }
    let mut rows = Vec::new();
    for name in order {
        for s in samples.iter().filter(|s| s.name == name) {
            let m = median(&s.totals);
            rows.push(Row {
                scenario: scenario.to_string(),
                imp: s.name.clone(),
                threads: s.threads,
                workers: s.workers,
                cpus: s.cpus,
                mops: m,
                stddev: stddev(&s.totals),
                mops_per_thread: m / s.threads as f64,
                runs: s.totals.len(),
                samples: s.totals.clone(),
            });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::{Columns, Row, median, stddev};

    fn row(imp: &str, threads: usize, workers: usize, cpus: usize) -> Row {
        Row {
            scenario: "counter".into(),
            imp: imp.into(),
            threads,
            workers,
            cpus,
            mops: 8.0,
            stddev: 0.5,
            mops_per_thread: 8.0 / threads as f64,
            runs: 1,
            samples: vec![8.0],
        }
    }

    #[test]
    fn labels_never_call_threads_cpus() {
        assert_eq!(row("pcpu", 1, 1, 1).label(), "(  1 thread)");
        assert_eq!(row("pcpu", 2, 2, 2).label(), "(  2 threads)");
        // More threads than allowed CPUs, and oversubscription by the
        // workload: the label says how many threads shared how many CPUs.
        assert_eq!(row("pcpu", 4, 4, 2).label(), "(  4 threads on 2 cpus)");
        assert_eq!(row("pcpu", 1, 4, 1).label(), "(  4 threads on 1 cpu)");
    }

    #[test]
    fn lines_line_up_and_report_per_cpu() {
        let rows = [row("pcpu", 2, 2, 2), row("atomic", 4, 4, 2)];
        let lines: Vec<String> = rows.iter().map(|r| r.line(Columns::fit(&rows))).collect();
        assert_eq!(
            lines[0],
            "counter/pcpu   (  2 threads):               8.000 ±   0.500M/s  (   4.000M/s/cpu)"
        );
        assert_eq!(
            lines[1],
            "counter/atomic (  4 threads on 2 cpus):     8.000 ±   0.500M/s  (   4.000M/s/cpu)"
        );
        assert_eq!(lines[0].find('±'), lines[1].find('±'));
    }

    #[test]
    fn median_and_stddev() {
        assert!((median(&[3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median(&[4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(stddev(&[5.0]).abs() < 1e-12);
        assert!((stddev(&[1.0, 3.0]) - 2f64.sqrt()).abs() < 1e-12);
    }
}
