//! `Uprobe` (the builder) and `Probe` (the attached handle).

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::AttachError;
use crate::attach::{self, queries};
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
    only_tid: i32,
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
    usdt: Option<(Arc<[crate::api::usdt::UsdtArg]>, Option<usize>)>,
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
            only_tid: 0,
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
        Self {
            addr: function.start,
            handler: None,
            ret_handler: None,
            max_active: None,
            only_tid: 0,
            function: Some(function),
            invalid: None,
            cells: None,
            timed: None,
            allow_blocked: false,
            trap_only: false,
            usdt: None,
        }
    }

    /// Probes on every site of the USDT probe `provider:name` of the
    /// loaded object `object` (a probe used in several places has several
    /// sites), each holding the probe's semaphore while attached and
    /// reading its arguments with
    /// [`EntryContext::usdt_arg`](crate::EntryContext::usdt_arg). Give
    /// each the same handler (an `Arc` captured by each closure) and
    /// attach them together with [`attach_all`](Self::attach_all). Not
    /// async-signal-safe (reads the object file).
    ///
    /// ```no_run
    /// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    /// use uprobe_core::Uprobe;
    ///
    /// static THROWS: AtomicU64 = AtomicU64::new(0);
    /// let probes = Uprobe::attach_all(
    ///     Uprobe::usdt("libstdc++.so.6", "libstdcxx", "throw")?
    ///         .into_iter()
    ///         .map(|u| u.on_entry(|_| { THROWS.fetch_add(1, Relaxed); })),
    /// )?;
    /// # drop(probes);
    /// # Ok::<(), uprobe_core::AttachError>(())
    /// ```
    pub fn usdt(object: &str, provider: &str, name: &str) -> Result<Vec<Self>, AttachError> {
        let sites: Vec<_> = crate::api::usdt::probes(object)?
            .into_iter()
            .filter(|p| p.provider == provider && p.name == name)
            .collect();
        if sites.is_empty() {
            return Err(AttachError::UsdtNotFound {
                object: object.to_string(),
                provider: provider.to_string(),
                name: name.to_string(),
            });
        }
        sites
            .iter()
            .map(crate::api::usdt::UsdtProbe::uprobe)
            .collect()
    }

    /// Binds a USDT probe's arguments and semaphore to this probe.
    pub(crate) fn with_usdt(
        mut self,
        args: Arc<[crate::api::usdt::UsdtArg]>,
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

    /// Runs the handler only for hits of thread `tid` (a kernel thread id,
    /// as `gettid()` returns).
    #[must_use]
    pub fn only_thread(mut self, tid: i32) -> Self {
        self.only_tid = tid;
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
            p.check_boundary()?;
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
                let no_handler = p.handler.is_none() && p.ret_handler.is_none() && p.only_tid == 0;
                let counting = no_handler && p.timed.is_none();
                let returns = p.ret_handler.is_some() || p.timed.is_some();
                let only_times = no_handler && p.timed.is_some();
                let consumer = Arc::new(Consumer {
                    handler: p.handler.unwrap_or_else(Handler::none),
                    ret: p.ret_handler.map(|h| ReturnProbe::new(h, p.max_active)),
                    only_tid: p.only_tid,
                    hits: pcpu::PerCpuCounter::new(),
                    removed: AtomicBool::new(false),
                    function: p.function.as_ref().map(Function::extent),
                    trap_only: p.trap_only,
                    blocked,
                    usdt_args: p.usdt.as_ref().map(|(args, _)| Arc::clone(args)),
                    semaphore: p.usdt.as_ref().and_then(|&(_, sem)| sem),
                    counting,
                    fast: match (p.cells, p.timed) {
                        // Checked by `count_into` (an invalid probe does
                        // not get here).
                        (Some(cells), _) => crate::site::count::FastCount::borrowed(cells),
                        (None, Some(cells)) => Some(crate::site::count::FastCount::latency(cells)),
                        (None, None) => (counting && crate::site::count::enabled())
                            .then(crate::site::count::FastCount::new),
                    },
                    returns,
                    only_times,
                    switch: p.timed.map(crate::site::timing::Switch::on),
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
                unsafe { crate::api::usdt::adjust_semaphore(sem, 1) };
            }
        }
        Ok(items
            .into_iter()
            .map(|(addr, consumer)| Probe {
                addr,
                consumer,
                attached: true,
            })
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

/// An attached probe; dropping it detaches (see [`detach`](Self::detach)).
pub struct Probe {
    addr: usize,
    consumer: Arc<Consumer>,
    attached: bool,
}

impl Probe {
    /// The probed address.
    #[must_use]
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Hits that ran this probe's handler; for a probe with no handler (a
    /// *counting probe*), every hit, counted by the trampoline itself where
    /// it can (see the crate docs' "Counting probes"). Exact, a sum over
    /// per-CPU counters. Async-signal-safe.
    #[must_use]
    pub fn hits(&self) -> u64 {
        self.consumer.hits()
    }

    /// How hits of this probe reach the engine: through a jump into a
    /// trampoline ([`Mode::Jump`](crate::Mode::Jump), no signal), or a breakpoint and the
    /// SIGTRAP handler, with the reason ([`Mode::Trap`](crate::Mode::Trap)). The mode belongs
    /// to the address (every probe there shares it). Not
    /// async-signal-safe.
    #[must_use]
    pub fn mode(&self) -> crate::Mode {
        queries::mode(self.addr).unwrap_or(crate::Mode::Trap(crate::NotOptimized::CodeChanged))
    }

    /// Return handlers of this probe run so far; for a timing probe
    /// ([`Uprobe::time_into`]), the returns timed into its cells (their
    /// histogram's total). Async-signal-safe.
    #[must_use]
    pub fn returns(&self) -> u64 {
        if let Some(cells) = self
            .consumer
            .fast
            .as_ref()
            .and_then(crate::site::count::FastCount::latency_cells)
        {
            return crate::LatencyCell::histogram(cells).iter().sum();
        }
        self.consumer
            .ret
            .as_ref()
            .map_or(0, |r| r.counters.returns.sum())
    }

    /// Returns of this probe that ran no return handler: not tracked (the
    /// thread's 64 pending returns, [`Uprobe::max_active`], a thread that
    /// found the pool of per-thread stacks empty, more than 16384 call
    /// sites) or left
    /// without returning (`longjmp`, unwinding). The program ran correctly
    /// in every case.
    #[must_use]
    pub fn missed_returns(&self) -> u64 {
        self.consumer
            .ret
            .as_ref()
            .map_or(0, |r| r.counters.missed.load(Ordering::Relaxed))
    }

    /// Returns of this probe pending now, across threads, if it has a
    /// [`max_active`](Uprobe::max_active) limit (`None` otherwise: without
    /// a limit nothing shared counts them).
    #[must_use]
    pub fn in_flight(&self) -> Option<usize> {
        self.consumer
            .ret
            .as_ref()?
            .in_flight
            .as_ref()
            .map(|a| a.charged())
    }

    /// Whether the probe's breakpoint is in the code. False once the
    /// engine disarmed every probe because the program replaced the
    /// SIGTRAP handler (see [`AttachError::TrapHandlerReplaced`]), or
    /// the code was unloaded. Not async-signal-safe.
    #[must_use]
    pub fn is_armed(&self) -> bool {
        queries::armed(self.addr)
    }

    /// Hits at this address that ran no handler because the thread was
    /// already inside the engine (a probed function called from a
    /// handler), shared by every probe on the address. A counting probe
    /// (no handler) counts these hits in [`hits`](Self::hits) too.
    #[must_use]
    pub fn missed(&self) -> u64 {
        queries::missed(self.addr)
    }

    /// Removes the probe; the last one at an address restores the original
    /// byte. Returns once no handler of this probe, entry or return, runs
    /// or will run (one SRCU grace period). It does not wait for pending
    /// returns: a thread still inside the function returns normally later,
    /// without running the return handler. The handlers themselves (the
    /// closures) are dropped on a background thread once no pending return
    /// of this probe remains (a call that never returns keeps them alive,
    /// but never blocks the detach). Not async-signal-safe;
    /// must not be called from a probe handler.
    pub fn detach(self) -> Result<(), AttachError> {
        Self::detach_all([self])
    }

    /// Detaches several probes with one SRCU grace period for the batch;
    /// returns once none of their handlers runs or will run. Reports the
    /// first error (the others are detached regardless). Not
    /// async-signal-safe.
    pub fn detach_all(probes: impl IntoIterator<Item = Self>) -> Result<(), AttachError> {
        let items: Vec<(usize, Arc<Consumer>)> = probes
            .into_iter()
            .map(|mut p| {
                p.attached = false;
                (p.addr, Arc::clone(&p.consumer))
            })
            .collect();
        let result = attach::detach_many(&items);
        for (_, c) in &items {
            release_semaphore(c);
        }
        result
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if self.attached {
            let _ = attach::detach_many(&[(self.addr, Arc::clone(&self.consumer))]);
            release_semaphore(&self.consumer);
        }
    }
}

/// Gives back the USDT semaphore a detached consumer held.
fn release_semaphore(consumer: &Consumer) {
    // An object unloaded meanwhile (`dlclose`) took its semaphore along.
    if let Some(sem) = consumer
        .semaphore
        .filter(|&s| crate::process::maps::path_of(s).is_some())
    {
        // SAFETY: the semaphore incremented at attach, still mapped.
        unsafe { crate::api::usdt::adjust_semaphore(sem, -1) };
    }
}

impl core::fmt::Debug for Probe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Probe")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("hits", &self.hits())
            .finish_non_exhaustive()
    }
}
