//! The functions of the loaded objects, listed by name: for tools that
//! probe many functions at once (every `sqlite3_*` of `libsqlite3.so.0`,
//! every `str*` of libc), as `bpftrace`'s `uprobe:libc:str*` and
//! `frida-trace -i` do.
//!
//! [`matching`] lists the functions whose names a filter accepts, from the
//! same symbol tables (and, for a GNU IFUNC, the same resolution) as
//! [`Uprobe::function`]; [`Function::uprobe`] makes a probe on one of them.
//!
//! ```no_run
//! # fn main() -> Result<(), uprobe_core::AttachError> {
//! use uprobe_core::functions;
//!
//! let found = functions::matching(Some("libc.so.6"), |name| name.starts_with("str"))?;
//! let probes = uprobe_core::Uprobe::attach_all(found.iter().map(functions::Function::uprobe))?;
//! for (f, p) in found.iter().zip(&probes) {
//!     println!("{} at {:#x}: {:?}", f.name, f.addr, p.mode());
//! }
//! # Ok(())
//! # }
//! ```

use std::path::PathBuf;

use crate::process::symbols::{self, Symbols};
use crate::{AttachError, Uprobe};

/// A function of a loaded object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Function {
    /// Its name (of several for the same code, the one with the fewest
    /// leading underscores, then the shortest: `malloc`, not
    /// `__libc_malloc`).
    pub name: String,
    /// The file of the object it is in.
    pub object: PathBuf,
    /// Where its code starts in this process (for a GNU IFUNC, the
    /// implementation the program's calls reach).
    pub addr: usize,
    /// Its length in bytes (0: unknown).
    pub size: usize,
    found: symbols::Function,
}

impl Function {
    /// A probe on the function's first instruction, as
    /// [`Uprobe::in_object`] makes it.
    #[must_use]
    pub fn uprobe(&self) -> Uprobe {
        Uprobe::in_function(self.found.clone())
    }
}

/// The functions of the loaded object `object` (its file name, like
/// `libc.so.6`, or its path), or with `None` of the executable and every
/// loaded library in load order, whose names `filter` accepts; the same
/// code under several names is listed once. An object without symbols
/// lists nothing. Not async-signal-safe (reads the object files).
///
/// # Errors
/// [`AttachError::NoSuchObject`] when `object` is not loaded.
pub fn matching(
    object: Option<&str>,
    filter: impl FnMut(&str) -> bool,
) -> Result<Vec<Function>, AttachError> {
    Ok(Symbols::now()
        .matching(object, filter)?
        .into_iter()
        .map(|(object, found)| Function {
            name: found.name.clone(),
            object,
            addr: found.start,
            size: found.size,
            found,
        })
        .collect())
}
