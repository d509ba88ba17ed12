//! Functions glibc runs with every signal blocked, where a breakpoint
//! would kill the process (or the child it is starting).
//!
//! A breakpoint trap is a synchronous SIGTRAP. When the trapping thread
//! blocks SIGTRAP, or its handler is the default one, the kernel cannot
//! deliver it to a handler and applies the default action: the process
//! dies with a core dump. Nothing in userspace runs first, so the engine
//! cannot rescue such a hit; it can only refuse, at attach, the functions
//! glibc is known to run that way. They were found by attaching to every
//! exported function of glibc 2.36 and taking each path below until none
//! died, then completed from glibc's sources for the options of those
//! paths a program may use (the file actions and attributes of
//! `posix_spawn`):
//!
//! - **thread start**: `pthread_create` blocks every signal around
//!   `clone`, and the new thread runs with them blocked until it has set
//!   itself up (`__ctype_init`, `_setjmp`);
//! - **thread exit**: a thread blocks every signal before it gives its
//!   stack back (`getpagesize`, `madvise`, the stack cache's lock and, when
//!   the cache is full, `free` and `munmap` of cached stacks);
//! - **`posix_spawn`**, which `std::process::Command`, `system` and
//!   `popen` use: the parent blocks every signal around `clone` and the
//!   `munmap` of the child's stack; the child runs with every signal
//!   blocked and every handler reset to the default until `execve`
//!   (signal dispositions and mask, file actions, the `PATH` search).
//!
//! The list is resolved by name at attach, so it follows the
//! implementation an IFUNC selected on this CPU (`strlen` is
//! `__strlen_avx2` or `__strlen_evex`) and a `free` the program
//! interposes (glibc calls `free` through its PLT). It does not know
//! other C libraries, or code of the program's own that blocks signals
//! around calls: a thread that blocks SIGTRAP while an attach runs is
//! refused separately (`AttachError::TrapBlocked`), but one that blocks
//! it later is not seen. A caller that knows its program never takes a
//! path (no threads exit, no processes are spawned) may attach anyway
//! with `Uprobe::allow_blocked_signal_paths`.

use std::sync::Mutex;

use crate::AttachError;
use crate::base::error::BlockedPath;
use crate::process::symbols::Symbols;

/// Where to look a name up.
#[derive(Clone, Copy)]
enum Lookup {
    /// glibc's own definition (glibc calls it through a hidden alias).
    Libc,
    /// glibc's and whatever the program's calls reach (`free`, which
    /// glibc calls through its PLT, so an interposed allocator's runs).
    Interposable,
}

/// The functions, by path. Names that share an address (`index` and
/// `strchr`) need only one entry.
const FUNCTIONS: &[(&str, Lookup, BlockedPath)] = &[
    ("__ctype_init", Lookup::Libc, BlockedPath::ThreadStart),
    ("_setjmp", Lookup::Libc, BlockedPath::ThreadStart),
    ("__sigsetjmp", Lookup::Libc, BlockedPath::ThreadStart),
    // pthread_create's fallback where clone3 is refused (old kernels,
    // some seccomp filters); posix_spawn's too.
    ("clone", Lookup::Libc, BlockedPath::ThreadStart),
    ("getpagesize", Lookup::Libc, BlockedPath::ThreadExit),
    ("madvise", Lookup::Libc, BlockedPath::ThreadExit),
    (
        "__lll_lock_wait_private",
        Lookup::Libc,
        BlockedPath::ThreadExit,
    ),
    (
        "__lll_lock_wake_private",
        Lookup::Libc,
        BlockedPath::ThreadExit,
    ),
    ("free", Lookup::Interposable, BlockedPath::ThreadExit),
    ("munmap", Lookup::Libc, BlockedPath::SpawnParent),
    ("__libc_sigaction", Lookup::Libc, BlockedPath::SpawnChild),
    ("sigprocmask", Lookup::Libc, BlockedPath::SpawnChild),
    ("pthread_sigmask", Lookup::Libc, BlockedPath::SpawnChild),
    ("dup2", Lookup::Libc, BlockedPath::SpawnChild),
    ("close", Lookup::Libc, BlockedPath::SpawnChild),
    ("close_range", Lookup::Libc, BlockedPath::SpawnChild),
    ("open", Lookup::Libc, BlockedPath::SpawnChild),
    ("openat", Lookup::Libc, BlockedPath::SpawnChild),
    ("fcntl", Lookup::Libc, BlockedPath::SpawnChild),
    ("chdir", Lookup::Libc, BlockedPath::SpawnChild),
    ("fchdir", Lookup::Libc, BlockedPath::SpawnChild),
    ("setsid", Lookup::Libc, BlockedPath::SpawnChild),
    ("setpgid", Lookup::Libc, BlockedPath::SpawnChild),
    ("tcsetpgrp", Lookup::Libc, BlockedPath::SpawnChild),
    ("getuid", Lookup::Libc, BlockedPath::SpawnChild),
    ("getgid", Lookup::Libc, BlockedPath::SpawnChild),
    ("setuid", Lookup::Libc, BlockedPath::SpawnChild),
    ("setgid", Lookup::Libc, BlockedPath::SpawnChild),
    ("sched_setparam", Lookup::Libc, BlockedPath::SpawnChild),
    ("sched_setscheduler", Lookup::Libc, BlockedPath::SpawnChild),
    ("getenv", Lookup::Libc, BlockedPath::SpawnChild),
    ("strlen", Lookup::Libc, BlockedPath::SpawnChild),
    ("strnlen", Lookup::Libc, BlockedPath::SpawnChild),
    ("strchr", Lookup::Libc, BlockedPath::SpawnChild),
    ("strchrnul", Lookup::Libc, BlockedPath::SpawnChild),
    ("strncmp", Lookup::Libc, BlockedPath::SpawnChild),
    ("mempcpy", Lookup::Libc, BlockedPath::SpawnChild),
    // The fallback for a file without an interpreter line (ENOEXEC).
    ("memcpy", Lookup::Libc, BlockedPath::SpawnChild),
    (
        "__libc_alloca_cutoff",
        Lookup::Libc,
        BlockedPath::SpawnChild,
    ),
    ("execve", Lookup::Libc, BlockedPath::SpawnChild),
    ("_exit", Lookup::Libc, BlockedPath::SpawnChild),
];

/// One resolved function: `[start, start + size)` (`size` 0: its extent
/// is unknown, only `start` is refused).
#[derive(Clone)]
struct Resolved {
    start: usize,
    size: usize,
    name: &'static str,
    path: BlockedPath,
}

/// The resolved list for one set of loaded objects (the dynamic linker's
/// load generation).
type Cache = Option<(Option<(u64, u64)>, std::sync::Arc<[Resolved]>)>;

static CACHE: Mutex<Cache> = Mutex::new(None);

/// Refuses `addr` if it lies in one of the functions above. Resolved once
/// per set of loaded objects. Not async-signal-safe.
///
/// The cache is only ever tried, never waited for: another thread that
/// holds it (or held it at a `fork`, which leaves it locked forever in
/// the child) makes this call resolve the list itself.
pub(crate) fn refuse(addr: usize) -> Result<(), AttachError> {
    let generation = crate::process::symbols::load_generation();
    let cached = CACHE.try_lock().ok().and_then(|cache| match &*cache {
        Some((g, functions)) if g.is_some() && *g == generation => Some(functions.clone()),
        _ => None,
    });
    let functions = cached.unwrap_or_else(|| {
        let functions = resolve_all();
        if let Ok(mut cache) = CACHE.try_lock() {
            *cache = Some((generation, functions.clone()));
        }
        functions
    });
    let hit = functions
        .iter()
        .find(|f| (f.start..f.start + f.size.max(1)).contains(&addr));
    match hit {
        Some(f) => Err(AttachError::SignalsBlocked {
            addr,
            function: f.name,
            path: f.path,
        }),
        None => Ok(()),
    }
}

fn resolve_all() -> std::sync::Arc<[Resolved]> {
    let mut found: Vec<Resolved> = Vec::new();
    let symbols = Symbols::now();
    for &(name, lookup, path) in FUNCTIONS {
        let own = symbols.find_function(Some("libc.so.6"), name).ok();
        let reached = match lookup {
            Lookup::Libc => None,
            Lookup::Interposable => symbols.find_function(None, name).ok(),
        };
        for f in own.into_iter().chain(reached) {
            if !found.iter().any(|r| r.start == f.start) {
                found.push(Resolved {
                    start: f.start,
                    size: f.size,
                    name,
                    path,
                });
            }
        }
    }
    found.into()
}
