//! USDT probes: the statically defined tracepoints that programs and
//! libraries declare with `<sys/sdt.h>` (`DTRACE_PROBE`, `STAP_PROBE`),
//! as `SystemTap`, `bpftrace` and `libbpf` read them.
//!
//! Each probe is a note in the object's `.note.stapsdt` section: the
//! address of a `nop` the compiler placed where the probe fires, the
//! address of `.stapsdt.base` at link time (to correct for prelinking),
//! the address of an optional *semaphore* (a `u16` the program reads to
//! decide whether to compute the probe's arguments at all: Python's
//! `function__entry` does), the provider and name, and a spec string
//! saying where each argument lives at the `nop` (`-4@%eax 8@-8(%rbp)
//! 4@$71` on x86-64, `-4@[sp, 96] -8@x4 4@5` on aarch64).
//!
//! [`probes`] lists the probes of a loaded object;
//! [`Uprobe::usdt`](crate::Uprobe::usdt) (or [`UsdtProbe::uprobe`]) makes
//! probes on them whose handlers read the arguments with
//! [`EntryContext::usdt_arg`](crate::EntryContext::usdt_arg). While such
//! a probe is attached, the probe's semaphore is incremented (atomically;
//! every attached probe counts once) and decremented again on detach.
//!
//! ```no_run
//! # fn main() -> Result<(), uprobe_core::AttachError> {
//! for p in uprobe_core::usdt::probes("libstdc++.so.6")? {
//!     println!("{}:{} at {:#x}: {}", p.provider, p.name, p.addr, p.spec);
//! }
//! # Ok(())
//! # }
//! ```

use std::path::{Path, PathBuf};

use object::{Object as _, ObjectSection as _};

pub use crate::arch::usdt::{UsdtArg, UsdtArgError, UsdtLocation};

use crate::{AttachError, Uprobe};

/// One USDT probe site of a loaded object (a probe used in several
/// places has one site each).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtProbe {
    /// The provider (`libstdcxx`, `python`, ...).
    pub provider: String,
    /// The probe's name (`throw`, `function__entry`, ...).
    pub name: String,
    /// Where the probe's instruction is in this process.
    pub addr: usize,
    /// Where its semaphore is in this process, if it has one.
    pub semaphore: Option<usize>,
    /// The argument spec, as the compiler wrote it.
    pub spec: String,
    /// The file of the object.
    pub object: PathBuf,
}

impl UsdtArg {
    /// Parses one argument of a spec (`-4@%eax`, `8@-8(%rbp)`, `4@$71` on
    /// x86-64; `-4@[sp, 96]`, `-8@x4`, `4@5` on aarch64).
    pub fn parse(text: &str) -> Result<Self, UsdtArgError> {
        let error = |why| UsdtArgError::new(text, why);
        let (size, location) = text
            .split_once('@')
            .ok_or_else(|| error("no `@` after the size"))?;
        let size: i8 = size
            .parse()
            .map_err(|_| error("the size is not a number"))?;
        let signed = size < 0;
        let size = size.unsigned_abs();
        if !matches!(size, 1 | 2 | 4 | 8) {
            return Err(error("the size is not 1, 2, 4 or 8 bytes"));
        }
        Ok(Self {
            size,
            signed,
            location: crate::arch::usdt::parse_location(location).map_err(error)?,
        })
    }
}

impl UsdtProbe {
    /// The arguments, parsed from [`spec`](Self::spec).
    pub fn args(&self) -> Result<Vec<UsdtArg>, AttachError> {
        self.spec
            .split_whitespace()
            .map(|a| {
                UsdtArg::parse(a).map_err(|e| AttachError::UsdtArgument {
                    probe: format!("{}:{}", self.provider, self.name),
                    arg: a.to_string(),
                    why: e.why(),
                })
            })
            .collect()
    }

    /// A probe on this site whose handlers can read the arguments
    /// ([`EntryContext::usdt_arg`](crate::EntryContext::usdt_arg)) and
    /// which holds the semaphore while attached. Fails if an argument's
    /// spec is one this crate does not know.
    pub fn uprobe(&self) -> Result<Uprobe, AttachError> {
        let args = self.args()?;
        // SAFETY: the note names the probe's own instruction (the `nop`
        // `<sys/sdt.h>` emits), in an object loaded now: an instruction
        // boundary, even where no symbol covers it (stripped programs).
        let uprobe = unsafe { Uprobe::address(self.addr) };
        Ok(uprobe.with_usdt(args.into(), self.semaphore))
    }
}

/// The USDT probes of the loaded object `object` (its file name, like
/// `libstdc++.so.6`, or its path), with their addresses in this process.
/// Not async-signal-safe (reads the file).
pub fn probes(object: &str) -> Result<Vec<UsdtProbe>, AttachError> {
    sites_of(&crate::process::symbols::loaded_object(object)?)
}

/// The USDT probes of every loaded object (objects whose file cannot be
/// read are skipped). Not async-signal-safe.
#[must_use]
pub fn loaded_probes() -> Vec<UsdtProbe> {
    crate::process::symbols::loaded_objects()
        .iter()
        .filter_map(|l| sites_of(l).ok())
        .flatten()
        .collect()
}

/// The probes of one loaded object, at their addresses in this process.
fn sites_of(loaded: &crate::process::symbols::Loaded) -> Result<Vec<UsdtProbe>, AttachError> {
    Ok(notes_in_file(&loaded.path)?
        .into_iter()
        .map(|n| UsdtProbe {
            provider: n.provider,
            name: n.name,
            addr: loaded.bias.wrapping_add(n.addr as usize),
            semaphore: (n.semaphore != 0).then(|| loaded.bias.wrapping_add(n.semaphore as usize)),
            spec: n.spec,
            object: loaded.path.clone(),
        })
        .collect())
}

/// A note as the file says it: addresses before the load bias.
pub(crate) struct Note {
    pub(crate) provider: String,
    pub(crate) name: String,
    pub(crate) addr: u64,
    pub(crate) semaphore: u64,
    pub(crate) spec: String,
}

/// `NT_STAPSDT`.
const NT_STAPSDT: u32 = 3;

/// The USDT notes of the ELF file at `path`, with the prelink correction
/// applied (`addr + sh_addr(.stapsdt.base) - base`).
fn notes_in_file(path: &Path) -> Result<Vec<Note>, AttachError> {
    let unreadable = |why: String| AttachError::ObjectUnreadable {
        path: path.display().to_string(),
        why,
    };
    let data = crate::process::file::Mapped::open(path).map_err(|e| unreadable(e.to_string()))?;
    notes_in(data.bytes()).map_err(unreadable)
}

/// The USDT notes of the ELF object `bytes` (see [`notes_in_file`]), or
/// why they cannot be read.
pub(crate) fn notes_in(bytes: &[u8]) -> Result<Vec<Note>, String> {
    let file = object::File::parse(bytes).map_err(|e| e.to_string())?;
    let little = file.is_little_endian();
    let word = if file.is_64() { 8 } else { 4 };
    let base_section = file.section_by_name(".stapsdt.base").map(|s| s.address());
    let Some(section) = file.section_by_name(".note.stapsdt") else {
        return Ok(Vec::new());
    };
    let bytes = section.data().map_err(|e| e.to_string())?;
    let u32_at = |b: &[u8]| {
        let a = [b[0], b[1], b[2], b[3]];
        if little {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let word_at = |b: &[u8]| -> u64 {
        if word == 8 {
            let a = core::array::from_fn(|i| b[i]);
            if little {
                u64::from_le_bytes(a)
            } else {
                u64::from_be_bytes(a)
            }
        } else {
            u64::from(u32_at(b))
        }
    };
    let mut notes = Vec::new();
    let mut at = 0;
    while at + 12 <= bytes.len() {
        let namesz = u32_at(&bytes[at..]) as usize;
        let descsz = u32_at(&bytes[at + 4..]) as usize;
        let kind = u32_at(&bytes[at + 8..]);
        let name_at = at + 12;
        let desc_at = name_at + namesz.next_multiple_of(4);
        let next = desc_at + descsz.next_multiple_of(4);
        if next > bytes.len() {
            return Err("a .note.stapsdt note runs past its section".into());
        }
        at = next;
        if kind != NT_STAPSDT || &bytes[name_at..name_at + namesz] != b"stapsdt\0" {
            continue;
        }
        let desc = &bytes[desc_at..desc_at + descsz];
        if desc.len() < 3 * word {
            return Err("a .note.stapsdt note is too short".into());
        }
        let (pc, base, semaphore) = (
            word_at(desc),
            word_at(&desc[word..]),
            word_at(&desc[2 * word..]),
        );
        let mut strings = desc[3 * word..].split(|&b| b == 0);
        let mut text = || String::from_utf8_lossy(strings.next().unwrap_or_default()).into_owned();
        let (provider, name, spec) = (text(), text(), text());
        let addr = match base_section {
            Some(actual) => pc.wrapping_add(actual).wrapping_sub(base),
            None => pc,
        };
        notes.push(Note {
            provider,
            name,
            addr,
            semaphore,
            spec,
        });
    }
    Ok(notes)
}

impl Uprobe {
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
        let sites: Vec<_> = probes(object)?
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
        sites.iter().map(UsdtProbe::uprobe).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_extend_as_the_sign_says() {
        let arg = |size, signed| UsdtArg {
            size,
            signed,
            location: UsdtLocation::Constant(0),
        };
        assert_eq!(arg(4, true).extend(0xffff_ffff), -1);
        assert_eq!(arg(4, false).extend(0x1_ffff_ffff), 0xffff_ffff);
        assert_eq!(arg(1, true).extend(0x80), -128);
        assert_eq!(arg(2, false).extend(0xdead_beef), 0xbeef);
        assert_eq!(arg(8, true).extend(u64::MAX), -1);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for bad in ["3@$1", "x@$1", "8", "16@$1"] {
            assert!(UsdtArg::parse(bad).is_err(), "{bad}");
        }
    }
}
