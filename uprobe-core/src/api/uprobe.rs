//! `Uprobe`: a probe to attach (where, and what runs on each hit), and
//! attaching it.

use std::num::{NonZeroI32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::probe::Probe;

use crate::attach::{self, queries};
use crate::base::error::AttachError;
use crate::process::symbols::{self, Function};
use crate::site::consumer::Consumer;
use crate::site::context::{EntryContext, ReturnContext};
use crate::site::handler::{Handler, ReturnHandler};
use crate::site::returns::ReturnProbe;

/// A probe to attach: where, and what runs on each hit.
///
/// ```no_run
/// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
/// use uprobe_core::{Reg, Uprobe};
///
/// #[inline(never)]
/// extern "C" fn traced(x: u64) -> u64 { x + 1 }
///
/// static SEEN: AtomicU64 = AtomicU64::new(0);
/// // SAFETY: `traced` is a function: its address starts an instruction.
/// let probe = unsafe { Uprobe::address(traced as usize) }
///     .on_entry(|cx| SEEN.store(cx.arg(0).unwrap(), Relaxed))
///     .attach()?;
/// assert_eq!(traced(41), 42);
/// assert_eq!((SEEN.load(Relaxed), probe.hits()), (41, 1));
/// drop(probe); // detaches: the original byte is back
/// # Ok::<(), uprobe_core::AttachError>(())
/// ```
pub struct Uprobe {
    addr: usize,
    handler: Option<Handler>,
    ret_handler: Option<ReturnHandler>,
    max_active: Option<NonZeroUsize>,
    /// Returns pending at detach still run the return handler.
    after_detach: bool,
    only_thread: Option<i32>,
    /// The function the address was found in, for the boundary check at
    /// attach (`None`: unchecked, from [`Uprobe::address`]).
    function: Option<Function>,
    /// Why the builder already knows the probe cannot attach (a bad
    /// [`offset`](Self::offset)): returned by `attach`.
    invalid: Option<AttachError>,
    /// Attach even in code glibc runs with every signal blocked.
    allow_blocked: bool,
    /// Keep the probe on the trap path.
    trap_only: bool,
    /// The USDT probe it was made on: its arguments and semaphore.
    usdt: Option<(Arc<[crate::arch::usdt::UsdtArg]>, Option<usize>)>,
    /// Where its hits are counted, if not in the engine's own counters.
    cells: Option<&'static [crate::CountCell]>,
    /// Where a timing probe counts its calls and their times.
    timed: Option<&'static [crate::LatencyCell]>,
}

impl Uprobe {
    /// A probe on the instruction at `addr`.
    ///
    /// # Safety
    /// `addr` is the first byte of an instruction of this process's code
    /// (a function's address is). A probe in the middle of an instruction
    /// corrupts it for every thread that runs it. [`at`](Self::at),
    /// [`function`](Self::function) and [`file_offset`](Self::file_offset)
    /// check this against the symbol tables instead; this constructor is
    /// the explicit opt-in for code no symbol covers.
    #[must_use]
    pub unsafe fn address(addr: usize) -> Self {
        Self {
            addr,
            handler: None,
            ret_handler: None,
            max_active: None,
            after_detach: false,
            only_thread: None,
            function: None,
            invalid: None,
            cells: None,
            timed: None,
            allow_blocked: false,
            trap_only: false,
            usdt: None,
        }
    }

    /// A probe on the first instruction of function `name`, looked up in
    /// the executable and then in every loaded library (ELF `.symtab`,
    /// then `.dynsym`). A GNU IFUNC (`memcpy`, `strlen`, ...) resolves to
    /// the implementation the program actually calls. Not
    /// async-signal-safe (reads the object files).
    pub fn function(name: &str) -> Result<Self, AttachError> {
        Ok(Self::in_function(symbols::find_function(None, name)?))
    }

    /// Like [`function`](Self::function), in the loaded object `object`
    /// only (its file name, like `libc.so.6`, or its path).
    pub fn in_object(object: &str, name: &str) -> Result<Self, AttachError> {
        Ok(Self::in_function(symbols::find_function(
            Some(object),
            name,
        )?))
    }

    /// A probe on the instruction at byte `offset` of file `path`, as
    /// kernel uprobes take it; the file must be mapped in this process and
    /// the offset must start an instruction of a function its symbols
    /// know.
    pub fn file_offset(
        path: impl AsRef<std::path::Path>,
        offset: u64,
    ) -> Result<Self, AttachError> {
        let path = path.as_ref();
        let addr = crate::process::maps::address_of_file_offset(path, offset).ok_or_else(|| {
            AttachError::FileOffsetNotMapped {
                path: path.display().to_string(),
                offset,
            }
        })?;
        Self::at(addr)
    }

    /// A probe at `addr`, checked: a function symbol must cover it, and it
    /// must start one of that function's instructions (decoding from the
    /// function's start). [`address`](Self::address) skips the check.
    pub fn at(addr: usize) -> Result<Self, AttachError> {
        let function = symbols::covering_function(addr).ok_or(AttachError::NoSymbol { addr })?;
        let mut probe = Self::in_function(function);
        probe.addr = addr;
        Ok(probe)
    }

    /// Moves the probe `offset` bytes into the function it was made for
    /// (checked at attach to start an instruction). An offset at or past
    /// the function's end, or into a function whose symbol has no size,
    /// makes `attach` fail ([`AttachError::OffsetOutsideFunction`],
    /// [`AttachError::UnknownFunctionExtent`]); from
    /// [`address`](Self::address), the offset is added to the address
    /// (and must not overflow it).
    #[must_use]
    pub fn offset(mut self, offset: usize) -> Self {
        let outside = |function: &str, size| AttachError::OffsetOutsideFunction {
            function: function.to_string(),
            offset,
            size,
        };
        match &self.function {
            Some(f) if offset == 0 => self.addr = f.start,
            Some(f) if f.size == 0 => {
                self.invalid = Some(AttachError::UnknownFunctionExtent {
                    function: f.name.clone(),
                    offset,
                });
            }
            Some(f) if offset >= f.size => self.invalid = Some(outside(&f.name, f.size)),
            Some(f) => self.addr = f.start + offset,
            None => match self.addr.checked_add(offset) {
                Some(addr) => self.addr = addr,
                None => self.invalid = Some(outside("address", usize::MAX - self.addr)),
            },
        }
        self
    }

    pub(crate) fn in_function(function: Function) -> Self {
        // SAFETY: a function's start is the first byte of an instruction
        // (and `attach` checks the probe against the function's bounds).
        let probe = unsafe { Self::address(function.start) };
        Self {
            function: Some(function),
            ..probe
        }
    }

    /// Binds a USDT probe's arguments and semaphore to this probe.
    pub(crate) fn with_usdt(
        mut self,
        args: Arc<[crate::arch::usdt::UsdtArg]>,
        semaphore: Option<usize>,
    ) -> Self {
        self.usdt = Some((args, semaphore));
        self
    }

    /// The address the probe will be attached at.
    #[must_use]
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The boundary check for probes made from a symbol (and, for return
    /// probes, the entry check).
    fn check_boundary(&self) -> Result<(), AttachError> {
        if let Some(e) = &self.invalid {
            return Err(e.clone());
        }
        let Some(f) = &self.function else {
            return Ok(());
        };
        if self.addr == f.start {
            return Ok(());
        }
        if self.ret_handler.is_some() || self.timed.is_some() {
            return Err(AttachError::ReturnProbeNotAtEntry {
                addr: self.addr,
                function: f.name.clone(),
            });
        }
        let inside = self.addr > f.start && (f.size == 0 || self.addr < f.start + f.size);
        let end = crate::process::maps::code_end(f.start).unwrap_or(f.start);
        let code_end = if f.size == 0 {
            end
        } else {
            (f.start + f.size).min(end)
        };
        let on_boundary = inside && {
            // `[f.start, code_end)` lies in executable mappings; probes
            // there may have patched it.
            let code = queries::original_code(f.start, code_end - f.start);
            crate::arch::is_boundary(f.start, self.addr, &code)
        };
        if on_boundary {
            Ok(())
        } else {
            Err(AttachError::NotInstructionBoundary {
                addr: self.addr,
                function: f.name.clone(),
            })
        }
    }

    /// The handler run on each hit, before the probed instruction, in the
    /// SIGTRAP handler of the thread that hit it: see [`EntryContext`] for
    /// what it may do. A handler that panics aborts the process (unwinding
    /// through a signal frame is not possible). Without it (and without
    /// [`on_return`](Self::on_return)) the probe is a *counting probe*:
    /// [`Probe::hits`] counts its hits, which its trampoline counts itself
    /// where it can, at a few nanoseconds a hit.
    #[must_use]
    pub fn on_entry(mut self, f: impl Fn(&mut EntryContext<'_>) + Send + Sync + 'static) -> Self {
        self.handler = Some(Handler::new(f));
        self
    }

    /// The handler run when the probed function returns (a *return
    /// probe*, the kernel's uretprobe): see [`ReturnContext`]. The probe
    /// must be at the function's first instruction. With an
    /// [`on_entry`](Self::on_entry) handler too, the two form a session:
    /// the entry handler may [`set_cookie`](EntryContext::set_cookie) for
    /// its return handler, or [`skip_return`](EntryContext::skip_return).
    ///
    /// The return address is replaced at the entry trap by a plain-code
    /// trampoline's (no second trap); the thread returns to its caller with
    /// the registers the function returned with. Like entry handlers, the
    /// return handler must be async-signal-safe, and one that panics aborts
    /// the process.
    ///
    /// ```no_run
    /// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    /// use uprobe_core::Uprobe;
    ///
    /// static LAST: AtomicU64 = AtomicU64::new(0);
    /// let probe = Uprobe::in_object("libc.so.6", "getpid")?
    ///     .on_return(|cx| LAST.store(cx.return_value(), Relaxed))
    ///     .attach()?;
    /// let pid = std::process::id();
    /// // SAFETY: getpid has no preconditions.
    /// assert_eq!(unsafe { libc::getpid() } as u32, pid);
    /// assert_eq!(LAST.load(Relaxed), u64::from(pid));
    /// drop(probe);
    /// # Ok::<(), uprobe_core::AttachError>(())
    /// ```
    #[must_use]
    pub fn on_return(mut self, f: impl Fn(&mut ReturnContext<'_>) + Send + Sync + 'static) -> Self {
        self.ret_handler = Some(ReturnHandler::new(f));
        self
    }

    /// At most `n` returns of this probe pending at once, across threads
    /// (the kernel's kretprobe `maxactive`); a hit past it runs its entry
    /// handler but its return is not tracked: counted in
    /// [`Probe::missed_returns`], and the function returns normally.
    /// Without a limit, only the per-thread depth limit (64) applies.
    #[must_use]
    pub fn max_active(mut self, n: NonZeroUsize) -> Self {
        self.max_active = Some(n);
        self
    }

    /// Runs the return handler of a call pending when the probe is
    /// detached too, at that call's return, after
    /// [`Probe::detach`](crate::Probe::detach) has returned: for a return
    /// handler that must see every call its entry handler saw (one that
    /// frees what the entry handler handed it through the cookie).
    ///
    /// By default a return handler runs only while its probe is attached:
    /// a call pending at detach returns normally and runs nothing, and
    /// its pending return holds nothing of the probe (it names the probe,
    /// and finds it detached). With this option each pending return holds
    /// an SRCU lease on the handler instead (as the kernel's uretprobes
    /// since 2024, and as a probe with [`max_active`](Self::max_active)
    /// does): the handler lives until the last such call has returned,
    /// or its thread has exited, and that costs each call a lease.
    #[must_use]
    pub fn return_after_detach(mut self) -> Self {
        self.after_detach = true;
        self
    }

    /// Runs the handler only for hits of thread `tid` (a kernel thread id,
    /// as `gettid()` returns: positive; [`attach`](Self::attach) refuses
    /// any other with [`AttachError::InvalidThreadId`]).
    #[must_use]
    pub fn only_thread(mut self, tid: i32) -> Self {
        self.only_thread = Some(tid);
        self
    }

    /// Attaches even in a function glibc runs with every signal blocked
    /// on a breakpoint, where [`attach`](Self::attach) otherwise writes
    /// a one-byte jump (no breakpoint, ever) or, where none fits, refuses
    /// with [`AttachError::SignalsBlocked`].
    ///
    /// **The rule.** A breakpoint hit is a synchronous SIGTRAP; on a thread
    /// that blocks it, or whose handler is the default one, the kernel
    /// kills the process before any handler runs. glibc runs a few
    /// functions that way on every thread start and exit and in
    /// `posix_spawn` (which `std::process::Command` uses), and the child
    /// of `posix_spawn` runs everything with signals blocked and default
    /// handlers until it execs, including `strlen`, `getenv`, `dup2` and
    /// `execve`. In those functions (the list and how it was found are in
    /// the crate's source, `blocked_code.rs`) attach never writes a
    /// breakpoint: it writes a one-byte jump over the probed
    /// instruction's first byte (`E9`, whose displacement is the four
    /// bytes after it, left as they are; [`Tactic::Pun`](crate::Tactic::Pun)
    /// with one byte written), in one store, and takes it out the same
    /// way. Where the address those bytes choose is taken, it refuses
    /// with [`AttachError::SignalsBlocked`] (whose
    /// [`BlockedPath`](crate::BlockedPath) says which path). An attach
    /// that would write a breakpoint is refused while a thread is seen
    /// blocking SIGTRAP ([`AttachError::TrapBlocked`]); one whose probes
    /// all get one-byte jumps, or join sites already in the code, is
    /// not. Code of the program that blocks
    /// SIGTRAP around calls, or another C library's equivalents, is not
    /// known to the engine.
    ///
    /// With this option the probe attaches as anywhere else (a breakpoint
    /// first, then a jump where one fits): for a program known never to
    /// take the path (no thread exits while the probe is attached, no
    /// process is spawned). A hit of a breakpoint on the path kills it.
    #[must_use]
    pub fn allow_blocked_signal_paths(mut self) -> Self {
        self.allow_blocked = true;
        self
    }

    /// Counts this probe's hits in `cells` (memory the caller owns: a
    /// `MAP_SHARED` mapping another process reads, say) instead of the
    /// engine's own counters; [`Probe::hits`] sums them. For a counting
    /// probe (no handler, no thread filter) the trampoline adds to them
    /// itself, as to the engine's counters (see the crate docs' "Counting
    /// probes"); for a probe with a handler, the hits that ran it are
    /// counted there. Several probes may count into the same cells (their
    /// sum is then what each probe's `hits` reports). `cells` must hold at
    /// least [`count_cells()`](crate::count_cells) cells; with fewer,
    /// [`attach`](Self::attach) fails with
    /// [`AttachError::TooFewCountCells`].
    ///
    /// ```
    /// # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))] {
    /// use uprobe_core::{CountCell, Uprobe, count_cells};
    /// #[inline(never)]
    /// extern "C" fn tick(x: u64) -> u64 { std::hint::black_box(x + 1) }
    /// let cells: &'static [CountCell] =
    ///     Box::leak((0..count_cells()).map(|_| CountCell::new()).collect());
    /// // SAFETY: a function's address is an instruction's first byte.
    /// let probe = unsafe { Uprobe::address(tick as usize) }.count_into(cells).attach()?;
    /// for i in 0..10 { tick(i); }
    /// assert_eq!((CountCell::sum(cells), probe.hits()), (10, 10));
    /// # }
    /// # Ok::<(), uprobe_core::AttachError>(())
    /// ```
    #[must_use]
    pub fn count_into(mut self, cells: &'static [crate::CountCell]) -> Self {
        if self.invalid.is_none() && cells.len() < crate::count_cells() {
            self.invalid = Some(AttachError::TooFewCountCells {
                given: cells.len(),
                needed: crate::count_cells(),
            });
        }
        self.cells = Some(cells);
        self
    }

    /// Makes this a *timing probe*: it counts the calls of the function it
    /// is at the entry of, and how long each took to return, as a log2
    /// histogram of nanoseconds, in `cells` (memory the caller owns, a
    /// `MAP_SHARED` mapping another process reads, say; see
    /// [`LatencyCell`](crate::LatencyCell)). No handler runs. Where its
    /// site runs through a jump and it is the site's only probe, the
    /// entry and the return do this themselves, with no register frame
    /// and no call into Rust ([`docs::timing`](crate::docs::timing));
    /// elsewhere the engine does the same, at the cost of an ordinary
    /// return probe.
    ///
    /// Like a return probe's, the probe must be at the function's first
    /// instruction ([`AttachError::ReturnProbeNotAtEntry`]), and
    /// [`Probe::hits`] counts the calls (the sum of the cells' calls, so
    /// probes timing into the same cells share it); the histogram's total
    /// is the returns timed ([`Probe::returns`]). A call whose return the
    /// engine cannot track (32 timed calls pending on the thread, more
    /// than 16384 call sites, a `longjmp` over it) is counted but not
    /// timed. Once
    /// [`Probe::detach`] returns, nothing writes to `cells` any more, not
    /// even a call that was pending then (it returns normally, untimed):
    /// memory the caller maps may be unmapped then. Fewer than
    /// [`latency_cells()`](crate::latency_cells) cells:
    /// [`AttachError::TooFewLatencyCells`]; with
    /// [`count_into`](Self::count_into) too: [`AttachError::CountAndTime`].
    ///
    /// ```
    /// # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))] {
    /// use uprobe_core::{LatencyCell, Uprobe, latency_cells};
    /// #[inline(never)]
    /// extern "C" fn work(x: u64) -> u64 { std::hint::black_box(x + 1) }
    /// let cells: &'static [LatencyCell] =
    ///     Box::leak((0..latency_cells()).map(|_| LatencyCell::new()).collect());
    /// // SAFETY: a function's address is its first instruction.
    /// let probe = unsafe { Uprobe::address(work as usize) }.time_into(cells).attach()?;
    /// for i in 0..10 { work(i); }
    /// let returns: u64 = LatencyCell::histogram(cells).iter().sum();
    /// assert_eq!((probe.hits(), returns), (10, 10));
    /// # }
    /// # Ok::<(), uprobe_core::AttachError>(())
    /// ```
    #[must_use]
    pub fn time_into(mut self, cells: &'static [crate::LatencyCell]) -> Self {
        if self.invalid.is_none() && cells.len() < crate::latency_cells() {
            self.invalid = Some(AttachError::TooFewLatencyCells {
                given: cells.len(),
                needed: crate::latency_cells(),
            });
        }
        self.timed = Some(cells);
        self
    }

    /// Keeps the probe on the trap path (a breakpoint and the SIGTRAP
    /// handler) even where its site could take a jump. The mode is the
    /// address's: a trap-only probe joining an optimized address turns it
    /// back into a breakpoint, which it stays until every probe there is
    /// detached.
    #[must_use]
    pub fn trap_only(mut self) -> Self {
        self.trap_only = true;
        self
    }

    /// Patches the breakpoint in (the first consumer at an address) or adds
    /// this consumer to the probe already there. Not async-signal-safe.
    pub fn attach(self) -> Result<Probe, AttachError> {
        Self::attach_all([self]).map(|mut v| v.remove(0))
    }

    /// Attaches several probes, paying one SRCU grace period for the batch
    /// (an attach that adds a consumer to an address already probed waits
    /// for one before freeing the old consumer list). All or nothing: on an
    /// error, the probes attached so far are detached again. Not
    /// async-signal-safe.
    pub fn attach_all(probes: impl IntoIterator<Item = Self>) -> Result<Vec<Probe>, AttachError> {
        let probes: Vec<Self> = probes.into_iter().collect();
        let mut blocked = Vec::with_capacity(probes.len());
        for p in &probes {
            if p.cells.is_some() && p.timed.is_some() {
                return Err(AttachError::CountAndTime);
            }
            if let Some(tid) = p.only_thread.filter(|&t| t <= 0) {
                return Err(AttachError::InvalidThreadId { tid });
            }
            p.check_boundary()?;
            if queries::in_landing_pad(p.addr) {
                return Err(AttachError::Unsupported {
                    addr: p.addr,
                    insn: "(padding)".to_string(),
                    why: "the engine wrote a landing pad for a punned jump into this alignment \
                          padding: no code of the program runs here",
                });
            }
            blocked.push(if p.allow_blocked {
                None
            } else {
                crate::process::blocked_code::refuse(p.addr).err()
            });
        }
        let items: Vec<(usize, Arc<Consumer>)> = probes
            .into_iter()
            .zip(blocked)
            .map(|(p, blocked)| {
                // A probe with no handler only counts: its trampoline may
                // count for it (`crate::site::count`).
                let no_handler =
                    p.handler.is_none() && p.ret_handler.is_none() && p.only_thread.is_none();
                let counting = no_handler && p.timed.is_none();
                let returns = p.ret_handler.is_some() || p.timed.is_some();
                let only_times = no_handler && p.timed.is_some();
                let ret = p
                    .ret_handler
                    .map(|h| ReturnProbe::new(h, p.max_active, p.after_detach));
                // A return probe with nothing to run at the entry: the
                // return entry routine may track its calls (counting its
                // hits where trampolines count).
                let lean_return = ret.as_ref().and_then(ReturnProbe::switch).filter(|_| {
                    p.handler.is_none()
                        && p.only_thread.is_none()
                        && p.timed.is_none()
                        && p.cells.is_none()
                        && crate::site::count::enabled()
                });
                let consumer = Arc::new(Consumer {
                    handler: p.handler.unwrap_or_else(Handler::none),
                    ret,
                    only_thread: p.only_thread.and_then(NonZeroI32::new),
                    hits: pcpu::PerCpuCounter::new(),
                    removed: AtomicBool::new(false),
                    function: p.function.as_ref().map(Function::extent),
                    trap_only: p.trap_only,
                    blocked,
                    usdt_args: p.usdt.as_ref().map(|(args, _)| Arc::clone(args)),
                    semaphore: p.usdt.as_ref().and_then(|&(_, sem)| sem),
                    counting,
                    counter: match (p.cells, p.timed) {
                        // Checked by `count_into` (an invalid probe does
                        // not get here).
                        (Some(cells), _) => crate::site::count::TrampolineCounter::borrowed(cells),
                        (None, Some(cells)) => {
                            Some(crate::site::count::TrampolineCounter::latency(cells))
                        }
                        (None, None) => ((counting || lean_return.is_some())
                            && crate::site::count::enabled())
                        .then(crate::site::count::TrampolineCounter::new),
                    },
                    returns,
                    lean_return,
                    only_times,
                    switch: p.timed.map(crate::site::timing::Switch::timing),
                });
                (p.addr, consumer)
            })
            .collect();
        // SAFETY: `address`'s contract, or checked by `check_boundary`.
        if let Err((failed, e)) = unsafe { attach::attach_many(&items) } {
            let _ = attach::detach_many(&items[..failed]);
            return Err(e);
        }
        for (_, c) in &items {
            if let Some(sem) = c.semaphore {
                // SAFETY: a USDT semaphore of a loaded object, from its
                // notes.
                unsafe { crate::site::consumer::adjust_semaphore(sem, 1) };
            }
        }
        Ok(items
            .into_iter()
            .map(|(addr, consumer)| Probe::attached(addr, consumer))
            .collect())
    }
}

impl core::fmt::Debug for Uprobe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Uprobe")
            .field("addr", &format_args!("{:#x}", self.addr))
            .finish_non_exhaustive()
    }
}
