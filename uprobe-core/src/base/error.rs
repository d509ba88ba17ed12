//! Why an attach or detach failed.

/// Why [`Uprobe::attach`](crate::Uprobe::attach) refused a probe. Nothing
/// was patched when it returns one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttachError {
    /// The address is not inside an executable mapping of this process.
    NotCode {
        /// The address asked for.
        addr: usize,
    },
    /// The instruction there cannot be probed (yet, or ever).
    Unsupported {
        /// The address.
        addr: usize,
        /// The instruction, disassembled.
        insn: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// An `int3` is already at the address, and it is not ours (a
    /// debugger's, or the program's own).
    ForeignBreakpoint {
        /// The address.
        addr: usize,
    },
    /// No loaded object is called that.
    NoSuchObject {
        /// The object asked for.
        object: String,
    },
    /// No function of that name in the object(s) searched.
    SymbolNotFound {
        /// Where it was looked for.
        object: String,
        /// The name asked for.
        name: String,
    },
    /// No function symbol covers the address (use the `unsafe`
    /// [`Uprobe::address`](crate::Uprobe::address) to probe it anyway).
    NoSymbol {
        /// The address.
        addr: usize,
    },
    /// The address is inside an instruction of `function` (decoding from
    /// the function's start never lands on it).
    NotInstructionBoundary {
        /// The address.
        addr: usize,
        /// The function it lies in.
        function: String,
    },
    /// No USDT probe `provider:name` in the object.
    UsdtNotFound {
        /// The object searched.
        object: String,
        /// The provider asked for.
        provider: String,
        /// The probe's name asked for.
        name: String,
    },
    /// An argument of a USDT probe's spec is in a form this crate does
    /// not read.
    UsdtArgument {
        /// The probe (`provider:name`).
        probe: String,
        /// The argument's spec (`8@counter(%rip)`, say).
        arg: String,
        /// What is not understood.
        why: &'static str,
    },
    /// An object file could not be read or parsed.
    ObjectUnreadable {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// That byte of that file is not mapped in this process.
    FileOffsetNotMapped {
        /// The file.
        path: String,
        /// The offset asked for.
        offset: u64,
    },
    /// The address is inside a restartable sequence's critical section
    /// `[start, end)`: the kernel would move a trapping thread to the
    /// section's abort handler before the trap could be handled.
    RseqCriticalSection {
        /// The address.
        addr: usize,
        /// The section's first byte.
        start: usize,
        /// One past its commit.
        end: usize,
    },
    /// These threads block SIGTRAP: a breakpoint hit on one of them would
    /// kill the process (the kernel forces the default action), so an
    /// attach that writes one is refused (one that writes only one-byte
    /// jumps is not).
    TrapBlocked {
        /// Their thread ids.
        tids: Vec<i32>,
    },
    /// A return handler, or a timing probe, needs the probe at a
    /// function's first instruction (where the return address is known); `addr` is inside `function`.
    ReturnProbeNotAtEntry {
        /// The address.
        addr: usize,
        /// The function it lies in.
        function: String,
    },
    /// The thread runs with a shadow stack (x86 CET): a hijacked return
    /// address would fault, so return probes are refused.
    ShadowStack,
    /// [`Uprobe::offset`](crate::Uprobe::offset) asked for a byte past the
    /// end of the function the probe was made for (or past the end of the
    /// address space).
    OffsetOutsideFunction {
        /// The function (or `"address"` for a probe made from one).
        function: String,
        /// The offset asked for.
        offset: usize,
        /// The function's size in bytes.
        size: usize,
    },
    /// The function's symbol has no size, so nothing says where it ends:
    /// an offset into it could land in the next function.
    UnknownFunctionExtent {
        /// The function.
        function: String,
        /// The offset asked for.
        offset: usize,
    },
    /// SIGTRAP's handler is no longer the engine's: the program replaced it
    /// (`sigaction`, `signal`) after probes were attached. A hit would
    /// reach the program's handler and resume in the middle of the probed
    /// instruction, so every probe was disarmed (its original bytes
    /// restored) and no probe attaches until the engine's handler is back.
    TrapHandlerReplaced {
        /// Probes disarmed by this check.
        disarmed: usize,
    },
    /// glibc runs `function` with every signal blocked on `path`: a
    /// breakpoint hit there cannot reach the engine's handler, and the
    /// kernel kills the process (or, for [`BlockedPath::SpawnChild`], the
    /// child being started). Attach writes a one-byte jump there instead
    /// (no breakpoint, ever: see [`Tactic::Pun`](crate::Tactic::Pun)); this
    /// error says that none fits (the address the jump would land on is
    /// taken, or another probe's bytes are in the way). See
    /// [`Uprobe::allow_blocked_signal_paths`](crate::Uprobe::allow_blocked_signal_paths)
    /// for the rule and the opt-out.
    SignalsBlocked {
        /// The address asked for.
        addr: usize,
        /// The function it lies in.
        function: &'static str,
        /// Where glibc runs it with signals blocked.
        path: BlockedPath,
    },
    /// The bytes at `addr` are part of the one-byte jump of the probe at
    /// `site`, written where glibc runs with every signal blocked: that
    /// probe can neither go back to a breakpoint nor keep its jump if
    /// those bytes change, so nothing else may be attached there (nor a
    /// trap-only probe at `site`) while it is.
    OneBytePatch {
        /// The address asked for.
        addr: usize,
        /// The probe whose jump depends on it.
        site: usize,
    },
    /// [`Uprobe::count_into`](crate::Uprobe::count_into) was given fewer
    /// cells than a counter needs on this machine
    /// ([`count_cells`](crate::count_cells)).
    TooFewCountCells {
        /// Cells given.
        given: usize,
        /// Cells needed.
        needed: usize,
    },
    /// [`Uprobe::time_into`](crate::Uprobe::time_into) was given fewer
    /// cells than a timing probe needs on this machine
    /// ([`latency_cells`](crate::latency_cells)).
    TooFewLatencyCells {
        /// Cells given.
        given: usize,
        /// Cells needed.
        needed: usize,
    },
    /// A probe was given both [`count_into`](crate::Uprobe::count_into)
    /// and [`time_into`](crate::Uprobe::time_into): a timing probe counts
    /// its calls in its latency cells.
    CountAndTime,
    /// A thread filter ([`only_thread`](crate::Uprobe::only_thread))
    /// names no thread: kernel thread ids are positive.
    InvalidThreadId {
        /// The id given.
        tid: i32,
    },
    /// This architecture has no engine yet.
    UnsupportedArch,
    /// A system call failed while installing the handler or patching
    /// ([`source`](std::error::Error::source) is the [`Errno`]).
    Os {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        errno: Errno,
    },
}

/// Why [`Probe::detach`](crate::Probe::detach) (or
/// [`detach_all`](crate::Probe::detach_all)) could not put a probed
/// instruction back. The probe is detached all the same: none of its
/// handlers runs or will run once the call returns.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DetachError {
    /// The original code at `addr` could not be written back (`source`
    /// says why): its breakpoint stays, and a hit there runs the
    /// instruction with no handler.
    CodeNotRestored {
        /// The probed address.
        addr: usize,
        /// Why the write failed.
        source: AttachError,
    },
}

impl core::fmt::Display for DetachError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::CodeNotRestored { addr, source } => write!(
                f,
                "the code at {addr:#x} could not be restored ({source}): its breakpoint stays, \
                 with no handler"
            ),
        }
    }
}

impl std::error::Error for DetachError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::CodeNotRestored { source, .. } => Some(source),
        }
    }
}

/// An `errno` value: why a system call failed. Prints as the system's
/// message for it; converts into [`std::io::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Errno(i32);

impl Errno {
    /// The error `errno` (`libc::ENOMEM`, say).
    #[must_use]
    pub const fn new(errno: i32) -> Self {
        Self(errno)
    }

    /// The raw `errno` value.
    #[must_use]
    pub const fn raw(self) -> i32 {
        self.0
    }

    /// The calling thread's `errno` now. Async-signal-safe.
    #[must_use]
    pub fn last() -> Self {
        Self(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    /// The `errno` of an I/O error (`fallback` if it has none).
    #[must_use]
    pub fn of(e: &std::io::Error, fallback: i32) -> Self {
        Self(e.raw_os_error().unwrap_or(fallback))
    }
}

impl core::fmt::Display for Errno {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        std::io::Error::from_raw_os_error(self.0).fmt(f)
    }
}

impl std::error::Error for Errno {}

impl From<Errno> for std::io::Error {
    fn from(e: Errno) -> Self {
        Self::from_raw_os_error(e.0)
    }
}

impl core::fmt::Display for AttachError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotCode { addr } => {
                write!(
                    f,
                    "{addr:#x} is not in an executable mapping of this process"
                )
            }
            Self::Unsupported { addr, insn, why } => {
                write!(f, "cannot probe `{insn}` at {addr:#x}: {why}")
            }
            Self::ForeignBreakpoint { addr } => write!(
                f,
                "{addr:#x} already holds a breakpoint that is not ours (a debugger's?)"
            ),
            Self::NoSuchObject { object } => write!(f, "no loaded object is called {object:?}"),
            Self::SymbolNotFound { object, name } => {
                write!(f, "no function {name:?} in {object}")
            }
            Self::NoSymbol { addr } => write!(
                f,
                "no function symbol covers {addr:#x} (Uprobe::address probes it unchecked)"
            ),
            Self::NotInstructionBoundary { addr, function } => write!(
                f,
                "{addr:#x} is inside an instruction of {function}, not at its start"
            ),
            Self::UsdtNotFound {
                object,
                provider,
                name,
            } => write!(f, "no USDT probe {provider}:{name} in {object}"),
            Self::UsdtArgument { probe, arg, why } => {
                write!(f, "USDT probe {probe}: argument {arg:?} is not read: {why}")
            }
            Self::ObjectUnreadable { path, why } => write!(f, "cannot read {path}: {why}"),
            Self::FileOffsetNotMapped { path, offset } => {
                write!(
                    f,
                    "offset {offset:#x} of {path} is not mapped in this process"
                )
            }
            Self::RseqCriticalSection { addr, start, end } => write!(
                f,
                "{addr:#x} is inside the rseq critical section {start:#x}..{end:#x}; a trap there is never delivered in place"
            ),
            Self::TrapBlocked { tids } => write!(
                f,
                "threads {tids:?} block SIGTRAP: a probe hit there would kill the process"
            ),
            Self::ReturnProbeNotAtEntry { addr, function } => write!(
                f,
                "{addr:#x} is not the first instruction of {function}: a return probe needs the function's entry"
            ),
            Self::ShadowStack => f.write_str(
                "this thread runs with a shadow stack: a hijacked return address would fault, so return probes are refused"
            ),
            Self::OffsetOutsideFunction {
                function,
                offset,
                size,
            } => write!(
                f,
                "offset {offset:#x} is outside {function}, which is {size:#x} bytes long"
            ),
            Self::UnknownFunctionExtent { function, offset } => write!(
                f,
                "offset {offset:#x} into {function}: its symbol has no size, so the offset could lie in another function"
            ),
            Self::TrapHandlerReplaced { disarmed } => write!(
                f,
                "the program replaced the SIGTRAP handler the probes need: {disarmed} probe(s) disarmed, and none can attach until it is restored"
            ),
            Self::SignalsBlocked {
                addr,
                function,
                path,
            } => write!(
                f,
                "{addr:#x} is in {function}, which glibc runs with every signal blocked ({path}): \
                 a breakpoint hit there would kill {}, and no one-byte jump fits there",
                if *path == BlockedPath::SpawnChild {
                    "the child"
                } else {
                    "the process"
                }
            ),
            Self::OneBytePatch { addr, site } => write!(
                f,
                "{addr:#x} is part of the one-byte jump of the probe at {site:#x}, in code that runs with signals blocked: it cannot change while that probe is attached"
            ),
            Self::TooFewCountCells { .. }
            | Self::TooFewLatencyCells { .. }
            | Self::CountAndTime => self.fmt_cells(f),
            Self::UnsupportedArch => f.write_str("no probe engine for this architecture yet"),
            Self::InvalidThreadId { tid } => {
                write!(f, "no thread has id {tid}: kernel thread ids are positive")
            }
            Self::Os { what, errno } => write!(f, "{what} failed: {errno}"),
        }
    }
}

impl AttachError {
    /// [`Display`](core::fmt::Display) for the errors about a probe's
    /// count or latency cells.
    fn fmt_cells(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::TooFewCountCells { given, needed }
            | Self::TooFewLatencyCells { given, needed } => {
                let (cells, work) = if matches!(self, Self::TooFewCountCells { .. }) {
                    ("count", "counting")
                } else {
                    ("latency", "timing")
                };
                write!(f, "{given} {cells} cells given, but {work} needs {needed} here (a CPU's each, and one)")
            }
            Self::CountAndTime => f.write_str(
                "a probe cannot both count into count cells and time into latency cells: its latency cells count its calls",
            ),
            _ => Ok(()),
        }
    }
}

impl std::error::Error for AttachError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Os { errno, .. } => Some(errno),
            _ => None,
        }
    }
}

/// The calling thread's `errno`, as an [`AttachError::Os`].
#[cfg_attr(not(uprobe_engine), allow(dead_code))]
pub(crate) fn os_error(what: &'static str) -> AttachError {
    AttachError::Os {
        what,
        errno: Errno::last(),
    }
}

/// Where glibc runs a function with every signal blocked (see
/// [`AttachError::SignalsBlocked`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum BlockedPath {
    /// A new thread, from `clone` until it has set itself up
    /// (`pthread_create` blocks every signal around `clone`).
    ThreadStart,
    /// A thread's last steps, after it has blocked every signal to give
    /// its stack back (a detached thread also frees cached stacks).
    ThreadExit,
    /// `posix_spawn` (`std::process::Command`, `system`, `popen`) in the
    /// calling process, which blocks every signal around `clone` and the
    /// `munmap` of the child's stack.
    SpawnParent,
    /// The child of `posix_spawn` (`std::process::Command`, `system`,
    /// `popen`), which runs with every signal blocked and every handler
    /// reset to the default until it calls `execve`.
    SpawnChild,
}

impl core::fmt::Display for BlockedPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::ThreadStart => "when a thread starts",
            Self::ThreadExit => "when a thread exits",
            Self::SpawnParent => "in posix_spawn, around clone",
            Self::SpawnChild => "in the child of posix_spawn, until it execs",
        })
    }
}
