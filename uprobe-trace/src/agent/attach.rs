//! Attaching: each probe asked for, the functions a pattern matches
//! (each in a slot of its own), and what waits for an object the program
//! loads later.

use std::collections::HashSet;
use std::sync::PoisonError;
use std::sync::atomic::Ordering::{Acquire, Relaxed};

use uprobe_core::functions::Function;
use uprobe_core::usdt::UsdtProbe;
use uprobe_core::{AttachError, Probe, Uprobe};

use super::Agent;
use super::threads::{mark_self, unmark_self};
use crate::names::{self, Name};
use crate::shared::{KEY_SEP, Slot};
use crate::spec::{self, ProbeSpec, Target};

/// Why a probe is not attached, and whether it may be once more objects
/// are loaded.
type NotYet = (String, bool);

/// Functions a pattern attaches at once.
const BATCH: usize = 64;

/// How reports label function `f`: its object's file name and its name,
/// demangled (`libc.so.6:malloc`, `w:ns::work(int)`).
pub(super) fn function_label(f: &Function) -> String {
    let file = f.object.file_name().unwrap_or(f.object.as_os_str());
    spec::function_label(Some(&file.to_string_lossy()), &names::display(&f.name))
}

/// The USDT probes `provider:name` in `object` (or in every loaded
/// object).
pub(super) fn usdt_sites(
    object: Option<&str>,
    provider: &str,
    name: &str,
) -> Result<Vec<UsdtProbe>, AttachError> {
    let sites = match object {
        Some(o) => uprobe_core::usdt::probes(o)?,
        None => uprobe_core::usdt::loaded_probes(),
    };
    Ok(sites
        .into_iter()
        .filter(|p| p.provider == provider && p.name == name)
        .collect())
}

impl Agent {
    /// Which symbols function spec `name` selects: a pattern, the
    /// functions it matches in any form that `-x` does not leave out; a
    /// demangled name, the functions that have it; a plain name, that
    /// symbol.
    pub(super) fn selects<'a>(&'a self, name: &'a str) -> impl FnMut(&str) -> bool + 'a {
        let pattern = spec::is_pattern(name);
        let demangled = names::is_demangled_form(name);
        move |symbol| {
            if !pattern && !demangled {
                return symbol == name;
            }
            let f = Name::new(symbol);
            if pattern {
                f.matches(name) && !self.plan.exclude.iter().any(|x| f.matches(x))
            } else {
                f.demangled.is_some() && f.matches(name)
            }
        }
    }

    fn slot(&'static self, i: usize) -> &'static Slot {
        self.report.slot(i).expect("the tool made a slot per probe")
    }

    /// `label` with this process's `--by` key, if it has one.
    fn keyed(&self, label: String) -> String {
        match &self.key {
            Some(key) => format!("{label}{KEY_SEP}{key}"),
            None => label,
        }
    }

    /// Where probe `i` (not a pattern) counts: its own slot, or with
    /// `--by` its slot for this process's key.
    fn probe_slot(&'static self, i: usize, spec: &ProbeSpec) -> Result<&'static Slot, NotYet> {
        if self.key.is_none() {
            return Ok(self.slot(i));
        }
        self.report
            .claim(i, &self.keyed(spec.label()))
            .map(|(_, slot)| slot)
            .ok_or_else(|| ("the report could not grow".to_string(), false))
    }

    /// Attaches every probe not attached yet; returns whether some are
    /// still waiting for an object to load.
    pub(super) fn attach_pending(&'static self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if self.stopping.load(Relaxed) {
            return false;
        }
        let mut waiting = false;
        for (i, spec) in self.plan.probes.iter().enumerate() {
            let (attached, done) = &mut state[i];
            if *done {
                continue;
            }
            if self.plan.list {
                *done = true;
                if let Err(why) = self.list(i, spec) {
                    self.slot(i).set_error(&why);
                }
                continue;
            }
            match self.attach(i, spec, attached) {
                Ok(()) => {
                    self.slot(i).set_error("");
                    // A function is one site; a USDT probe, or a pattern
                    // over every object, may gain sites in objects loaded
                    // later.
                    *done = match &spec.target {
                        Target::Function { object, name } => {
                            let many = spec.target.is_pattern() || names::is_demangled_form(name);
                            !many || object.is_some()
                        }
                        Target::Usdt { .. } => false,
                    };
                    waiting |= !*done;
                }
                Err((why, later)) => {
                    self.slot(i).set_error(&why);
                    *done = !later;
                    waiting |= later;
                }
            }
        }
        waiting
    }

    /// After the program loaded an object: attach what waits for one, on
    /// the program's thread (not counted meanwhile).
    pub(super) fn after_dlopen(&'static self) {
        if !self.ready.load(Acquire) {
            return; // the first round (the watcher catches up after it)
        }
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.iter().all(|(_, done)| *done) {
            return;
        }
        drop(state);
        let _serial = self.dlopens.lock().unwrap_or_else(PoisonError::into_inner);
        if self.stopping.load(Relaxed) {
            return;
        }
        let observed = mark_self(2);
        self.attach_pending();
        unmark_self(2, observed);
    }

    /// The agent's thread, after the first round: attaches waiting probes
    /// whenever the set of loaded objects changes; returns when the
    /// session is asked to stop.
    pub(super) fn watch(&'static self) {
        let mut seen = loaded_objects();
        let mut waiting = true;
        while !self.stop_asked() {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let now = loaded_objects();
            if now != seen {
                seen = now;
                if self.stacks {
                    uprobe_core::unwind::refresh();
                    self.list_objects();
                }
                if waiting {
                    waiting = self.attach_pending();
                }
            }
        }
    }

    /// `--stacks`: lists the objects loaded now in the report (those not
    /// listed yet), for the tool to symbolize the stacks.
    pub(super) fn list_objects(&self) {
        let mut listed = self.listed.lock().unwrap_or_else(PoisonError::into_inner);
        for o in uprobe_core::unwind::loaded_objects() {
            if listed.insert((o.path.clone(), o.bias)) {
                self.report.record_object(
                    self.id,
                    &o.path.to_string_lossy(),
                    o.start as u64,
                    o.end as u64,
                    o.bias as u64,
                );
            }
        }
    }

    /// Attaches probe `i`.
    fn attach(
        &'static self,
        i: usize,
        spec: &ProbeSpec,
        attached: &mut HashSet<usize>,
    ) -> Result<(), NotYet> {
        let later = |e: &AttachError| {
            matches!(
                e,
                AttachError::NoSuchObject { .. }
                    | AttachError::SymbolNotFound { .. }
                    | AttachError::UsdtNotFound { .. }
            )
        };
        let builders: Vec<Uprobe> = match &spec.target {
            Target::Function { object, name } if spec::is_pattern(name) => {
                return self.attach_pattern(i, spec, object.as_deref(), name, attached);
            }
            Target::Function { object, name } if names::is_demangled_form(name) => {
                // A demangled name: every function that has it (the
                // overloads of a C++ name), in this probe's slot.
                let found = uprobe_core::functions::matching(object.as_deref(), self.selects(name))
                    .map_err(|e| (e.to_string(), later(&e)))?;
                let fresh: Vec<Uprobe> = found
                    .iter()
                    .filter(|f| !attached.contains(&f.addr))
                    .map(uprobe_core::functions::Function::uprobe)
                    .collect();
                if fresh.is_empty() && attached.is_empty() {
                    return Err((
                        format!("no function is named {name:?} in the loaded objects"),
                        true,
                    ));
                }
                fresh
            }
            Target::Function { object, name } => {
                let found = match object {
                    Some(o) => Uprobe::in_object(o, name),
                    None => Uprobe::function(name),
                };
                vec![found.map_err(|e| (e.to_string(), later(&e)))?]
            }
            Target::Usdt {
                object,
                provider,
                name,
            } => {
                let sites: Vec<_> = usdt_sites(object.as_deref(), provider, name)
                    .map_err(|e| (e.to_string(), later(&e)))?
                    .into_iter()
                    .filter(|p| !attached.contains(&p.addr))
                    .collect();
                if sites.is_empty() && attached.is_empty() {
                    return Err((
                        format!("no USDT probe {provider}:{name} in the loaded objects"),
                        true,
                    ));
                }
                sites
                    .iter()
                    .map(uprobe_core::usdt::UsdtProbe::uprobe)
                    .collect::<Result<_, _>>()
                    .map_err(|e| (e.to_string(), false))?
            }
        };
        let slot = self.probe_slot(i, spec)?;
        for builder in builders {
            let addr = builder.addr();
            let probe = self.attach_one(slot, spec, builder)?;
            attached.insert(addr);
            self.keep(slot, probe);
        }
        Ok(())
    }

    /// Attaches the functions pattern `name` matches (in `object`, or in
    /// every loaded object) that are not attached yet, each counted in a
    /// slot of its own; the pattern's slot counts the functions attached.
    /// A function that cannot be probed says why in its slot.
    fn attach_pattern(
        &'static self,
        i: usize,
        spec: &ProbeSpec,
        object: Option<&str>,
        name: &str,
        attached: &mut HashSet<usize>,
    ) -> Result<(), NotYet> {
        let found = uprobe_core::functions::matching(object, self.selects(name)).map_err(|e| {
            let later = matches!(e, AttachError::NoSuchObject { .. });
            (e.to_string(), later)
        })?;
        let fresh: Vec<_> = found
            .into_iter()
            .filter(|f| self.own_object.as_ref() != Some(&f.object))
            .filter(|f| !attached.contains(&f.addr))
            .collect();
        if fresh.is_empty() && attached.is_empty() {
            return Err((
                format!("no function matches {name:?} in the loaded objects"),
                true,
            ));
        }
        let pattern = self.slot(i);
        let mut claimed = Vec::with_capacity(fresh.len());
        for f in fresh {
            attached.insert(f.addr);
            let label = function_label(&f);
            if let Some((_, slot)) = self.report.claim(i, &self.keyed(label)) {
                claimed.push((slot, f));
            } // else counted as lost
        }
        for batch in claimed.chunks(BATCH) {
            for (slot, result) in self.attach_batch(spec, batch) {
                match result {
                    Ok(probe) => {
                        pattern.sites.fetch_add(1, Relaxed);
                        self.keep(slot, probe);
                    }
                    Err((why, _)) => slot.set_error(&why),
                }
            }
        }
        Ok(())
    }

    /// Attaches `batch` at once (one read of the memory map and of the
    /// threads for all of them, one grace period), or, where one of them
    /// fails, each on its own (its error in its slot, the others
    /// attached).
    fn attach_batch(
        &'static self,
        spec: &ProbeSpec,
        batch: &[(&'static Slot, Function)],
    ) -> Vec<(&'static Slot, Result<Probe, NotYet>)> {
        let builders = batch.iter().map(|(slot, f)| {
            let builder = if spec.trap_only {
                f.uprobe().trap_only()
            } else {
                f.uprobe()
            };
            self.with_handlers(slot, spec, builder)
        });
        if let Ok(probes) = Uprobe::attach_all(builders) {
            let kept = self.tool.is_none()
                || probes
                    .iter()
                    .all(|p| matches!(p.mode(), uprobe_core::Mode::Jump(_)));
            if kept {
                return batch
                    .iter()
                    .map(|(slot, _)| *slot)
                    .zip(probes.into_iter().map(Ok))
                    .collect();
            }
            // Loaded into a running process, one stays on a breakpoint:
            // each again on its own, which says which and why.
            drop(probes);
        }
        batch
            .iter()
            .map(|(slot, f)| (*slot, self.attach_one(slot, spec, f.uprobe())))
            .collect()
    }

    /// Attaches one probe counting into `slot`. Loaded into a running
    /// process, a site that stays on a breakpoint is detached again (see
    /// [`super::signals`]).
    fn attach_one(
        &'static self,
        slot: &'static Slot,
        spec: &ProbeSpec,
        builder: Uprobe,
    ) -> Result<Probe, NotYet> {
        let addr = builder.addr();
        let builder = if spec.trap_only {
            builder.trap_only()
        } else {
            builder
        };
        let probe = match self.with_handlers(slot, spec, builder).attach() {
            Err(AttachError::SignalsBlocked { .. }) => self.attach_blocked(slot, spec, addr)?,
            other => other.map_err(|e| (e.to_string(), false))?,
        };
        if self.tool.is_some()
            && let uprobe_core::Mode::Trap(why) = probe.mode()
        {
            drop(probe);
            return Err((
                format!(
                    "it stays on a breakpoint ({why}), and in a running process the agent cannot keep SIGTRAP deliverable: a thread that blocks it would die there"
                ),
                false,
            ));
        }
        Ok(probe)
    }

    /// A function glibc runs with every signal blocked (`free`) where the
    /// engine's one-byte jump does not fit: safe to probe only through a
    /// jump over whole instructions (a breakpoint there kills the process
    /// at the next thread exit or spawn), written behind a breakpoint.
    /// Preloaded, the attach happens before `main`, while no other thread
    /// runs that path; loaded into a running process, it is refused.
    fn attach_blocked(
        &'static self,
        slot: &'static Slot,
        spec: &ProbeSpec,
        addr: usize,
    ) -> Result<Probe, NotYet> {
        if self.tool.is_some() {
            return Err((
                "glibc runs it with every signal blocked and its jump does not fit in one byte: in a running program, a breakpoint there could kill it".into(),
                false,
            ));
        }
        let builder = Uprobe::at(addr).map_err(|e| (e.to_string(), false))?;
        let probe = self
            .with_handlers(slot, spec, builder.allow_blocked_signal_paths())
            .attach()
            .map_err(|e| (e.to_string(), false))?;
        match probe.mode() {
            uprobe_core::Mode::Jump(_) => Ok(probe),
            uprobe_core::Mode::Trap(why) => {
                drop(probe);
                Err((
                    format!(
                        "glibc runs it with every signal blocked, and it cannot take a jump ({why}): a breakpoint there would kill the program"
                    ),
                    false,
                ))
            }
        }
    }

    /// Counts an attached site in `slot` and keeps its probe.
    fn keep(&self, slot: &Slot, probe: Probe) {
        slot.sites.fetch_add(1, Relaxed);
        if let uprobe_core::Mode::Trap(why) = probe.mode() {
            slot.set_trap_why(&why.to_string());
            slot.trap_sites.fetch_add(1, Relaxed);
        }
        self.probes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(probe);
    }
}

/// The number of loaded objects (changes when one is loaded or unloaded).
fn loaded_objects() -> usize {
    unsafe extern "C" fn count(
        _info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the counter passed below.
        unsafe { *data.cast::<usize>() += 1 };
        0
    }
    let mut n = 0usize;
    // SAFETY: the callback only counts.
    unsafe { libc::dl_iterate_phdr(Some(count), (&raw mut n).cast()) };
    n
}
