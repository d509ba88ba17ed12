//! What the engine reads of the process it runs in, and how it writes to
//! its code: the memory map and code writes ([`maps`]; one mapping by
//! address: [`vma`]), the loaded
//! objects' symbols ([`symbols`]) and, for code no symbol covers, their
//! unwind information ([`frames`]), its threads and rseq critical
//! sections ([`threads`]), and the functions glibc runs with every signal
//! blocked ([`blocked_code`]); object files are read through a mapping
//! ([`file`]). Nothing here knows about probes; none of it runs on the
//! hit path.

pub(crate) mod blocked_code;
pub(crate) mod file;
pub(crate) mod frames;
pub(crate) mod maps;
pub(crate) mod safe_load;
pub(crate) mod symbols;
pub(crate) mod threads;
pub(crate) mod vma;
