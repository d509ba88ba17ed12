//! `--stacks FILE`: the stacks the agents counted, symbolized and written
//! folded (`outer;caller;function count` per line, outermost first), the
//! input of `flamegraph.pl` and `inferno-flamegraph`.
//!
//! An address is symbolized in the object its agent listed it in: the
//! function symbol (`.symtab`, then `.dynsym`) that covers it, or the
//! nearest one before it in an object without sizes, demangled, with
//! ` (file:line)` where the object has DWARF line tables; without a
//! symbol, `object:file:line` or else `object+0xoffset`. A return address is looked up one byte back (in its
//! call), so that a call ending a function is not named after the next.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed};

use object::{Object as _, ObjectSymbol as _, SymbolKind};
use uprobe_trace::shared::{KEY_BIT, Report};

use crate::Failure;
use crate::lines::Lines;

/// One object of an agent's process.
struct Mapped {
    agent: u32,
    start: u64,
    end: u64,
    bias: u64,
    path: PathBuf,
}

/// An object file's function symbols, by address, and its line tables.
struct Symbols {
    /// `(start, size, name)`, sorted by start; the names demangled.
    by_addr: Vec<(u64, u64, String)>,
    lines: Option<Lines>,
}

impl Symbols {
    fn read(path: &Path) -> Option<Self> {
        let data = std::fs::read(path).ok()?;
        let file = object::File::parse(&*data).ok()?;
        let mut by_addr: Vec<(u64, u64, String)> = file
            .symbols()
            .chain(file.dynamic_symbols())
            .filter(|s| s.kind() == SymbolKind::Text && !s.is_undefined() && s.address() != 0)
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .collect();
        // Of several names for one address, the plainest: the fewest
        // leading underscores, then the shortest (`malloc`, not
        // `__libc_malloc`).
        by_addr.sort_by_cached_key(|(addr, _, name)| {
            let underscores = name.len() - name.trim_start_matches('_').len();
            (*addr, underscores, name.len(), name.clone())
        });
        by_addr.dedup_by_key(|s| s.0);
        for (_, _, name) in &mut by_addr {
            if let Some(d) = uprobe_trace::names::demangle(name) {
                *name = d;
            }
        }
        let lines = Lines::read(&file);
        Some(Self { by_addr, lines })
    }

    fn name(&self, addr: u64) -> Option<&str> {
        let after = self.by_addr.partition_point(|s| s.0 <= addr);
        let (start, size, name) = self.by_addr.get(after.checked_sub(1)?)?;
        (*size == 0 || addr < start + size).then_some(name.as_str())
    }
}

/// Symbolizes addresses of the agents' processes.
pub struct Symbolizer {
    objects: Vec<Mapped>,
    files: HashMap<PathBuf, Option<Symbols>>,
}

impl Symbolizer {
    pub fn new(report: &Report) -> Self {
        let used = report.header().objects_used.load(Relaxed) as usize;
        let objects = report
            .objects()
            .iter()
            .take(used)
            .filter_map(|e| {
                Some(Mapped {
                    path: PathBuf::from(e.path()?),
                    agent: e.agent.load(Relaxed),
                    start: e.start.load(Relaxed),
                    end: e.end.load(Relaxed),
                    bias: e.bias.load(Relaxed),
                })
            })
            .collect();
        Self {
            objects,
            files: HashMap::new(),
        }
    }

    /// The name of the code at `addr` in agent `agent`'s process
    /// (`inside`: look up `addr - 1`, for a return address).
    pub fn name(&mut self, agent: u32, addr: u64, inside: bool) -> String {
        let at = if inside { addr.wrapping_sub(1) } else { addr };
        let Some(o) = self
            .objects
            .iter()
            .find(|o| o.agent == agent && (o.start..o.end).contains(&at))
        else {
            return format!("{addr:#x}");
        };
        let file_addr = at - o.bias;
        let symbols = self
            .files
            .entry(o.path.clone())
            .or_insert_with(|| Symbols::read(&o.path));
        let object = o.path.file_name().map_or_else(
            || o.path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        let name = symbols.as_ref().and_then(|s| s.name(file_addr));
        let line = symbols
            .as_ref()
            .and_then(|s| s.lines.as_ref()?.at(file_addr));
        match (name, line) {
            (Some(name), Some(line)) => format!("{name} ({line})"),
            (Some(name), None) => name.to_string(),
            (None, Some(line)) => format!("{object}:{line}"),
            (None, None) => format!("{object}+{file_addr:#x}"),
        }
    }
}

/// Writes the folded stacks to `path` (`-`: standard output).
pub fn write(report: &Report, path: &Path) -> Result<(), Failure> {
    let mut symbolizer = Symbolizer::new(report);
    let mut folded: BTreeMap<String, u64> = BTreeMap::new();
    for e in report.stacks() {
        let depth = e.depth.load(Acquire) as usize;
        let count = e.count.sum();
        // `--by` keys share the table: not stacks.
        if depth == 0 || count == 0 || e.slot.load(Relaxed) & KEY_BIT != 0 {
            continue;
        }
        let agent = e.agent.load(Relaxed);
        let names: Vec<String> = e.frames[..depth.min(e.frames.len())]
            .iter()
            .enumerate()
            .map(|(k, f)| symbolizer.name(agent, f.load(Relaxed), k > 0))
            // `;` separates frames; a space is a frame's own (the count
            // follows the last one: C++ names keep theirs, as perf's
            // folded stacks do).
            .map(|n| n.replace(';', "_"))
            .collect();
        let line = names.iter().rev().cloned().collect::<Vec<_>>().join(";");
        *folded.entry(line).or_default() += count;
    }
    let mut text = String::new();
    for (stack, count) in &folded {
        let _ = writeln!(text, "{stack} {count}");
    }
    let lost = report.header().lost_stacks.load(Relaxed);
    if lost > 0 {
        eprintln!("uprobe-trace: {lost} hits' stacks not kept (the table is full)");
    }
    crate::write_output(path, &text)
}
