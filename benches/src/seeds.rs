//! `bench seeds`: every seed's before/after, side by side with the peers
//! and the kernel's own uprobes, in one interleaved pass, one table per
//! seed with each row's ratio to the seed's "before".

use crate::harness::{Columns, Options, Row, Scenario, run_plan};
use crate::scenarios;

/// One scenario of a seed's table: which implementations, and which of
/// them is the seed's "before" (the ratio's denominator).
#[derive(Debug)]
pub struct Part {
    pub scenario: &'static str,
    pub impls: &'static [&'static str],
    pub before: &'static str,
}

/// One seed: the patch, its scenarios, and a note on how the table reads.
#[derive(Debug)]
pub struct Seed {
    pub id: &'static str,
    pub patch: &'static str,
    pub parts: &'static [Part],
    pub note: &'static str,
}

/// The five seeds, in order.
pub const SEEDS: &[Seed] = &[
    Seed {
        id: "000",
        patch: "uprobes: remove siglock in uprobe_deny_signal / handle_singlestep (2025)",
        parts: &[
            Part {
                scenario: "taskflag-deny",
                impls: &["lockfree", "locked"],
                before: "locked",
            },
            Part {
                scenario: "uprobe-riprel",
                impls: &[
                    "uprobe-core+twotrap",
                    "uprobe-core+twotrap+locked",
                    "uprobe-core",
                    "kernel",
                ],
                before: "uprobe-core+twotrap+locked",
            },
        ],
        note: "the deferral runs on the two-trap out-of-line path only (+twotrap rows; on its own the engine runs this 7-byte load through a jump into a trampoline: no trap at all)",
    },
    Seed {
        id: "001",
        patch: "uprobes: switch uprobes_treelock to per-CPU RW semaphore (2024)",
        parts: &[
            Part {
                scenario: "rwsem-read",
                impls: &["percpu-rwsem", "std", "parking_lot", "sharded"],
                before: "std",
            },
            Part {
                scenario: "uprobe-nop",
                impls: &[
                    "uprobe-core+percpu-rwsem",
                    "uprobe-core+rwlock",
                    "uprobe-core",
                    "kernel",
                ],
                before: "uprobe-core+rwlock",
            },
        ],
        note: "+percpu-rwsem is the seed's after, +rwlock its before, both on the breakpoint (the trap path's table lookup); uprobe-core on its own runs a jump punned over the nop into a trampoline that names its probe: no trap and no lookup at all",
    },
    Seed {
        id: "002",
        patch: "uprobes: SRCU-protect uretprobe lifetime (with timeout) (2024)",
        parts: &[
            Part {
                scenario: "srcu-read",
                impls: &[
                    "srcu",
                    "urcu-memb",
                    "refcount",
                    "epoch",
                    "seize",
                    "arc-swap",
                ],
                before: "refcount",
            },
            Part {
                scenario: "uretprobe-lifetime",
                impls: &["lease", "refcount"],
                before: "refcount",
            },
        ],
        note: "urcu-memb: liburcu's default flavour, where liburcu-dev was installed at build time; lease: a pending return holds an SRCU lease on its probe; refcount: a reference per pending return",
    },
    Seed {
        id: "003",
        patch: "signal: take the user reference only on the 0 -> 1 sigpending transition (2020)",
        parts: &[
            Part {
                scenario: "sigpending-signal1",
                impls: &["pending-ref", "get-put"],
                before: "get-put",
            },
            Part {
                scenario: "uretprobe-nop",
                impls: &["uprobe-core", "uprobe-core+get-put", "kernel"],
                before: "uprobe-core+get-put",
            },
        ],
        note: "uretprobe-nop charges each pending return to the probe's in-flight account: pinned on 0 -> 1 (uprobe-core) or per return (+get-put)",
    },
    Seed {
        id: "004",
        patch: "bpf: avoid grabbing the spin locks of all CPUs when no free elements (2022)",
        parts: &[Part {
            scenario: "freelist-pop-empty",
            impls: &["hint", "flag", "head", "nohint", "arrayqueue"],
            before: "nohint",
        }],
        note: "uprobe-core takes pcpu-freelist elements at attach (out-of-line slots) and once per thread (return stacks), never per hit: the primitive's own scenario stands for it",
    },
];

/// The rows of one seed's table, per part, with the part's "before".
#[derive(Debug)]
pub struct SeedResult {
    pub seed: &'static Seed,
    pub parts: Vec<(&'static Part, Vec<Row>, Vec<String>)>,
}

/// The parts whose scenario exists on this architecture (the uprobe
/// scenarios are x86-64 only).
fn available(seed: &'static Seed) -> Vec<(&'static Part, Scenario)> {
    seed.parts
        .iter()
        .filter_map(|p| scenarios::find(p.scenario).map(|sc| (p, sc)))
        .collect()
}

/// Runs every seed's scenarios in one interleaved pass.
pub fn run(opts: &Options) -> Result<Vec<SeedResult>, String> {
    let chosen: Vec<(&'static Seed, Vec<(&'static Part, Scenario)>)> =
        SEEDS.iter().map(|s| (s, available(s))).collect();
    let plan: Vec<(&Scenario, Vec<&str>)> = chosen
        .iter()
        .flat_map(|(_, parts)| parts.iter().map(|(p, sc)| (sc, p.impls.to_vec())))
        .collect();
    let mut results = run_plan(&plan, opts)?.into_iter();
    Ok(chosen
        .iter()
        .map(|(seed, parts)| SeedResult {
            seed,
            parts: parts
                .iter()
                .map(|(p, _)| {
                    let (rows, skipped) = results.next().expect("one result per part");
                    (*p, rows, skipped)
                })
                .collect(),
        })
        .collect())
}

/// The ratio of `row` to the part's "before" row at the same thread count.
#[must_use]
pub fn ratio(row: &Row, rows: &[Row], before: &str) -> Option<f64> {
    let b = rows
        .iter()
        .find(|r| r.imp == before && r.threads == row.threads)?;
    (b.mops > 0.0).then(|| row.mops / b.mops)
}

impl SeedResult {
    /// The table as printed: a header, the rows in the seed format with
    /// each one's ratio to the "before", the skipped rows, the note.
    #[must_use]
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(out, "## seed {}: {}", self.seed.id, self.seed.patch);
        let cols = Columns::fit(self.rows());
        for (part, rows, skipped) in &self.parts {
            for r in rows {
                let tail = if r.imp == part.before {
                    "  (before)".to_string()
                } else {
                    ratio(r, rows, part.before)
                        .map_or_else(String::new, |x| format!("  {x:>6.2}x {}", part.before))
                };
                let _ = writeln!(out, "{}{tail}", r.line(cols));
            }
            for s in skipped {
                let _ = writeln!(out, "{s}");
            }
        }
        let _ = writeln!(out, "({})", self.seed.note);
        out
    }

    /// Every row of the seed's table.
    pub fn rows(&self) -> impl Iterator<Item = &Row> {
        self.parts.iter().flat_map(|(_, rows, _)| rows)
    }
}
