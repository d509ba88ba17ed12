//! The loaded objects' unwind sections, for the walk: a table made in
//! ordinary context and published for hits to read without a lock.
//!
//! Each object's `.eh_frame_hdr` (found through its `PT_GNU_EH_FRAME`
//! program header) and `.eh_frame` are **copied** when the object first
//! appears, into memory that is never freed: an object unloaded after the
//! table was made leaves the walk stale data to read (wrong frames at
//! worst), never an unmapped page. Tables are never freed either (a hit
//! may still read the one it loaded); a new one is made only when the
//! dynamic linker's load counts changed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, PoisonError};

use gimli::{BaseAddresses, EhFrameHdr, NativeEndian, Pointer};

use crate::process::symbols::Loaded;

/// One object's code range and unwind sections.
pub(super) struct Object {
    /// Its mapped range (every `PT_LOAD`).
    start: usize,
    end: usize,
    /// Where `.eh_frame_hdr` and `.eh_frame` are mapped (their addresses,
    /// which their encoded pointers are relative to).
    pub(super) eh_frame_hdr: usize,
    pub(super) eh_frame: usize,
    /// The copies.
    hdr_copy: &'static [u8],
    eh_frame_copy: &'static [u8],
}

impl Object {
    /// The copies of `.eh_frame_hdr` and `.eh_frame`.
    pub(super) fn sections(&self) -> (&'static [u8], &'static [u8]) {
        (self.hdr_copy, self.eh_frame_copy)
    }
}

/// The objects at one moment, sorted by start.
pub(super) struct Table {
    generation: Option<(u64, u64)>,
    objects: Vec<Object>,
}

impl Table {
    /// The object whose range holds `pc`. Async-signal-safe.
    pub(super) fn find(&self, pc: usize) -> Option<&Object> {
        let after = self.objects.partition_point(|o| o.start <= pc);
        let o = self.objects.get(after.checked_sub(1)?)?;
        (pc < o.end).then_some(o)
    }
}

static CURRENT: AtomicPtr<Table> = AtomicPtr::new(core::ptr::null_mut());

/// [`refresh`], where a table was made before (someone unwinds); returns
/// whether one was.
pub(crate) fn keep_current() -> bool {
    let unwinds = current().is_some();
    if unwinds {
        refresh();
    }
    unwinds
}

/// The table hits read (`None` before the first [`refresh`]).
/// Async-signal-safe.
pub(super) fn current() -> Option<&'static Table> {
    // SAFETY: tables are leaked once published.
    unsafe { CURRENT.load(Ordering::Acquire).as_ref() }
}

/// A loaded object, as a stack's addresses are symbolized later (in this
/// process or another): which file, where it is mapped, its load bias
/// (an address minus the bias is the address in the file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedObject {
    /// Its file (the executable's real path for the executable).
    pub path: PathBuf,
    /// Its mapped range, every segment included.
    pub start: usize,
    /// See `start`.
    pub end: usize,
    /// Its load bias.
    pub bias: usize,
}

/// The objects loaded now (the vDSO included), for symbolizing stacks
/// after the fact. Not async-signal-safe.
#[must_use]
pub fn loaded_objects() -> Vec<LoadedObject> {
    crate::process::symbols::all_loaded()
        .into_iter()
        .filter_map(|l| {
            let (start, end) = l.range()?;
            Some(LoadedObject {
                start,
                end,
                bias: l.bias,
                path: l.path,
            })
        })
        .collect()
}

/// Copies of each object's sections, by path and load bias.
type Copies = HashMap<(PathBuf, usize), (&'static [u8], &'static [u8], usize, usize)>;

/// Makes the table of the objects loaded now, if they changed since the
/// last one. Call it once before attaching probes whose handlers call
/// [`EntryContext::user_stack`](crate::EntryContext::user_stack) (before
/// the first call, stacks are empty); from then on every attach calls it
/// too, and so should a tool after the program loads a library whose
/// frames stacks should cross. Not async-signal-safe.
pub fn refresh() {
    static BUILD: Mutex<Option<Copies>> = Mutex::new(None);
    let mut copies = BUILD.lock().unwrap_or_else(PoisonError::into_inner);
    let generation = crate::process::symbols::load_generation();
    if generation.is_some()
        && let Some(t) = current()
        && t.generation == generation
    {
        return;
    }
    let copies = copies.get_or_insert_with(HashMap::new);
    let mut objects: Vec<Object> = crate::process::symbols::all_loaded()
        .into_iter()
        .filter_map(|l| {
            let key = (l.path.clone(), l.bias);
            let &mut (hdr_copy, eh_frame_copy, eh_frame_hdr, eh_frame) = match copies.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(copy(&l)?),
            };
            let (start, end) = l.range()?;
            Some(Object {
                start,
                end,
                eh_frame_hdr,
                eh_frame,
                hdr_copy,
                eh_frame_copy,
            })
        })
        .collect();
    objects.sort_by_key(|o| o.start);
    let table = Box::into_raw(Box::new(Table {
        generation,
        objects,
    }));
    CURRENT.store(table, Ordering::Release);
    // Addresses may now hold other code.
    super::rules::clear();
}

/// Copies an object's `.eh_frame_hdr` and `.eh_frame` (from its header to
/// the end of the segment it lies in): `(hdr, eh_frame, hdr address,
/// eh_frame address)`. `None` without them.
fn copy(l: &Loaded) -> Option<(&'static [u8], &'static [u8], usize, usize)> {
    let (hdr_at, hdr_len) = l.eh_frame_hdr?;
    // SAFETY: the dynamic linker mapped the header where its program
    // header says, for as long as the object is loaded (now).
    let hdr = unsafe { core::slice::from_raw_parts(hdr_at as *const u8, hdr_len) };
    let bases = BaseAddresses::default().set_eh_frame_hdr(hdr_at as u64);
    let parsed = EhFrameHdr::new(hdr, NativeEndian).parse(&bases, 8).ok()?;
    let Pointer::Direct(eh_frame_at) = parsed.eh_frame_ptr() else {
        return None;
    };
    let eh_frame_at = eh_frame_at as usize;
    let (_, segment_end) = l
        .loads
        .iter()
        .find(|(s, e)| (*s..*e).contains(&eh_frame_at))?;
    // SAFETY: inside a loaded segment, mapped readable (the unwinder of
    // the C++ runtime reads it the same way).
    let eh_frame =
        unsafe { core::slice::from_raw_parts(eh_frame_at as *const u8, segment_end - eh_frame_at) };
    let hdr: &'static [u8] = Box::leak(hdr.to_vec().into_boxed_slice());
    let eh_frame: &'static [u8] = Box::leak(eh_frame.to_vec().into_boxed_slice());
    Some((hdr, eh_frame, hdr_at, eh_frame_at))
}
