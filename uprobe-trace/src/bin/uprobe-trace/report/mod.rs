//! The report: the shared file the agents count into, read back as rows
//! (a probe asked for, with the functions its pattern matched under it),
//! printed as text in `bpftrace`'s style ([`text`]), written as JSON and
//! served as `OpenMetrics` ([`json`]).

mod json;
mod text;

pub use json::openmetrics;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;

use uprobe_trace::shared::{BUCKETS, Flow, Report, Slot, split_key};

/// Calls and returns `--flow` keeps, the first ones (a sparse file: 16
/// bytes each, 128 MiB when full).
const FLOW_RECORDS: usize = 1 << 23;
use uprobe_trace::spec::{By, Plan, ProbeSpec};

use crate::stacks::Symbolizer;
use crate::{Args, End, Failure};
use json::json;
use text::{listing, text};

/// A report file and its path, in a directory of the session's own.
pub struct Session {
    pub report: Report,
    /// `--flow`'s records (in the directory too).
    pub flow: Option<Flow>,
    pub path: PathBuf,
    /// The session's directory (mode 0700: no other user reaches the
    /// report or the `--print` FIFO in it).
    pub dir: PathBuf,
}

impl Session {
    /// A fresh report for `plan`, in a new private directory of the
    /// temporary directory.
    pub fn create(plan: &Plan) -> Result<Self, Failure> {
        let dir = private_dir()?;
        let path = dir.join("report");
        let labels: Vec<String> = plan.probes.iter().map(ProbeSpec::label).collect();
        let report = Report::create(&path, &labels).map_err(|e| {
            let _ = std::fs::remove_dir(&dir);
            Failure::Run(format!("cannot create {}: {e}", path.display()))
        })?;
        let flow = if plan.probes.iter().any(|p| p.flow) {
            let at = dir.join("flow");
            Some(Flow::create(&at, FLOW_RECORDS).map_err(|e| {
                let _ = std::fs::remove_dir_all(&dir);
                Failure::Run(format!("cannot create {}: {e}", at.display()))
            })?)
        } else {
            None
        };
        Ok(Self {
            report,
            flow,
            path,
            dir,
        })
    }

    /// Hands the directory and what is in it to user `uid` (a process of
    /// another user traced by root must open them).
    pub fn give_to(&self, uid: u32) -> Result<(), Failure> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| Failure::Run(format!("{}: {e}", self.dir.display())))?;
        for p in entries
            .flatten()
            .map(|e| e.path())
            .chain([self.dir.clone()])
        {
            std::os::unix::fs::chown(&p, Some(uid), None)
                .map_err(|e| Failure::Run(format!("chown {}: {e}", p.display())))?;
        }
        Ok(())
    }

    /// Removes the directory and what is in it (the mappings stay).
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Prints the report to standard error.
    pub fn print(&self, plan: &Plan, end: Option<End>) {
        eprint!("{}", text(&self.report, plan, end));
    }

    /// Whether not one probe attached a site, in any process.
    pub fn nothing_attached(&self, plan: &Plan) -> bool {
        rows(&self.report, plan)
            .iter()
            .all(|r| r.sites == 0 && r.matched.values().all(|m| m.sites == 0))
    }

    /// The final report: printed, and written as JSON where asked; with
    /// `--list`, the listing, on standard output.
    pub fn finish(&self, args: &Args, plan: &Plan, end: Option<End>) -> Result<(), Failure> {
        if plan.list {
            print!("{}", listing(&self.report, plan));
            return Ok(());
        }
        self.print(plan, end);
        if let Some(path) = &args.stacks {
            crate::stacks::write(&self.report, path)?;
        }
        if let (Some(path), Some(flow)) = (&args.flow, &self.flow) {
            crate::flow::write(&self.report, flow, path)?;
        }
        let Some(path) = &args.json else {
            return Ok(());
        };
        let text = serde_json::to_string_pretty(&json(&self.report, plan))
            .map_err(|e| Failure::Run(format!("json: {e}")))?;
        crate::write_output(path, &(text + "\n"))
    }
}

/// A new directory `uprobe-trace-XXXXXX` of the temporary directory, mode
/// 0700, its name chosen by `mkdtemp`.
fn private_dir() -> Result<PathBuf, Failure> {
    let template = std::env::temp_dir().join("uprobe-trace-XXXXXX");
    let mut bytes = template.into_os_string().into_encoded_bytes();
    bytes.push(0);
    // SAFETY: a NUL-terminated template that mkdtemp rewrites in place.
    let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(Failure::Run(format!(
            "cannot make a directory in {}: {}",
            std::env::temp_dir().display(),
            std::io::Error::last_os_error()
        )));
    }
    bytes.pop();
    // SAFETY: the bytes came from an OsString and mkdtemp only replaced
    // the X's with ASCII.
    Ok(PathBuf::from(unsafe {
        std::ffi::OsString::from_encoded_bytes_unchecked(bytes)
    }))
}

/// One probe asked for, or one function its pattern matched, summed over
/// every slot (every process) that counted it.
#[derive(Default)]
pub(super) struct Row {
    label: String,
    sites: u64,
    trap_sites: u64,
    hits: u64,
    returns: u64,
    latency: Vec<u64>,
    values: Vec<u64>,
    negative: u64,
    error: Option<String>,
    /// Why a site stays on a breakpoint.
    trap_why: Option<String>,
    /// The functions a pattern matched, by label.
    matched: BTreeMap<String, Row>,
    /// `--by`: calls by key.
    by: BTreeMap<String, u64>,
}

impl Row {
    /// Adds slot `slot`, which has `calls` calls and `latencies` (returns,
    /// their histogram).
    fn add(&mut self, slot: &Slot, calls: u64, latencies: &(u64, [u64; BUCKETS])) {
        self.sites += slot.sites.load(Relaxed);
        self.trap_sites += slot.trap_sites.load(Relaxed);
        self.hits += calls;
        self.returns += latencies.0;
        self.negative += slot.negative.load(Relaxed);
        self.latency.resize(BUCKETS, 0);
        for (a, b) in self.latency.iter_mut().zip(&latencies.1) {
            *a += b;
        }
        self.values.resize(BUCKETS, 0);
        for (a, b) in self.values.iter_mut().zip(&slot.values) {
            *a += b.load(Relaxed);
        }
        if let Some(why) = slot.trap_why() {
            self.trap_why = Some(why);
        }
        // An error from one process, unless another attached it.
        match slot.error() {
            Some(e) if self.error.is_none() && self.sites == 0 => self.error = Some(e),
            None if self.sites > 0 => self.error = None,
            _ => {}
        }
    }
}

/// The rows of the report, one per probe asked for.
pub(super) fn rows(report: &Report, plan: &Plan) -> Vec<Row> {
    let mut rows: Vec<Row> = plan
        .probes
        .iter()
        .map(|p| Row {
            label: p.label(),
            ..Row::default()
        })
        .collect();
    // Where each slot's counts went: its probe, and the label of the
    // function a pattern matched (`None`: the probe's own row).
    let mut placed: HashMap<usize, (usize, Option<String>)> = HashMap::new();
    for (i, slot) in report.slots() {
        let probe = slot.probe.load(Relaxed) as usize;
        let Some(row) = rows.get_mut(probe) else {
            continue;
        };
        let (calls, latencies) = (report.calls(i), report.latencies(i));
        let label = slot.label();
        // A slot of `--by`'s: `label KEY_SEP key`; the probe's own (a
        // function or USDT probe asked for) or a matched function's.
        let (base, key) = split_key(&label);
        let own = i == probe || (key.is_some() && base == row.label);
        placed.insert(i, (probe, (!own).then(|| base.to_string())));
        let row = if own {
            row
        } else {
            row.matched.entry(base.to_string()).or_insert_with(|| Row {
                label: base.to_string(),
                ..Row::default()
            })
        };
        row.add(slot, calls, &latencies);
        if let Some(key) = key.filter(|_| calls > 0) {
            *row.by.entry(key.to_string()).or_default() += calls;
        }
    }
    // `--by` keys read in the hit, from the report's key table.
    if let Some(by) = plan.by.filter(|b| b.in_hit()) {
        let mut symbolizer = (by == By::Caller).then(|| Symbolizer::new(report));
        for (slot, agent, key, count) in report.keys() {
            let Some((probe, matched)) = placed.get(&(slot as usize)) else {
                continue;
            };
            let row = &mut rows[*probe];
            let row = match matched {
                Some(label) => row.matched.get_mut(label).expect("placed"),
                None => row,
            };
            let key = match symbolizer.as_mut() {
                Some(s) => s.name(agent, key, true),
                None => (key as i64).to_string(),
            };
            *row.by.entry(key).or_default() += count;
        }
    }
    rows
}
