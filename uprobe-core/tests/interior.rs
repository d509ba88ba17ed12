//! Probes at interior instruction boundaries of a real library: every
//! instruction of every exported function of libz (where the system has
//! it), each attached while its neighbours within 24 bytes are not (a
//! punned jump's fixed bytes are the code after its instruction, which
//! another probe there would change), many thousands at once, while a
//! compress / decompress workload runs through them: results identical to
//! unprobed runs, and how each site runs, by tactic, printed.
#![cfg(target_arch = "x86_64")]

mod common;

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_void};

use common::emulated;
use uprobe_core::{Probe, Uprobe};

/// Compresses and decompresses a generated buffer; the compressed bytes.
fn workload(handle: *mut c_void) -> Vec<u8> {
    common::libz_round_trip(handle, 20_000, 6)
}

/// Every exported function's instruction boundaries, as (name, offset,
/// address in the file), decoded from the file.
fn boundaries(path: &str) -> Vec<(String, usize, u64)> {
    uprobe_core::testing::objects::exported_instructions(&std::fs::read(path).unwrap())
}

/// Splits `sites` (sorted by address) into rounds in which any two are at
/// least `gap` bytes apart.
fn rounds<T>(
    sites: Vec<(String, usize, u64)>,
    gap: u64,
    mut f: impl FnMut(&[(String, usize, u64)]) -> T,
) -> Vec<T> {
    let mut rounds: Vec<Vec<(String, usize, u64)>> = Vec::new();
    for site in sites {
        let free = rounds
            .iter_mut()
            .find(|r| r.last().is_none_or(|l| site.2 >= l.2 + gap));
        match free {
            Some(r) => r.push(site),
            None => rounds.push(vec![site]),
        }
    }
    rounds.iter().map(|r| f(r)).collect()
}

/// Attaches a round: the entries by name (their extent known, as for
/// whole-library probes), interior sites by address (decoded from the
/// file as instruction boundaries; each `Uprobe::in_object` reads the
/// memory map, which thousands of stub pages lengthen); in one batch (one
/// look at the process, one grace period), one by one only if something
/// in it is refused. Returns the probes and their offsets.
fn attach_round(
    round: &[(String, usize, u64)],
    starts: &std::collections::HashMap<&str, usize>,
    refused: &mut BTreeMap<String, usize>,
) -> (Vec<Probe>, Vec<usize>) {
    let make = |(name, offset, _): &(String, usize, u64)| {
        if *offset == 0 {
            Uprobe::in_object("libz.so.1", name).unwrap()
        } else {
            common::probe_at(starts[name.as_str()] + offset)
        }
    };
    if let Ok(probes) = Uprobe::attach_all(round.iter().map(make)) {
        return (probes, round.iter().map(|r| r.1).collect());
    }
    let mut attached = (Vec::new(), Vec::new());
    for site in round {
        match make(site).attach() {
            Ok(p) => {
                attached.0.push(p);
                attached.1.push(site.1);
            }
            Err(e) => {
                let kind = format!("{e:?}");
                let kind = kind.split([' ', '{', '(']).next().unwrap_or("?");
                *refused.entry(kind.to_string()).or_default() += 1;
            }
        }
    }
    attached
}

/// libz, dlopened, and its file's path, with [`LIBZ`] held; `None`
/// (after saying why) under an emulator or where the system has no libz.
fn open_libz() -> Option<(std::sync::MutexGuard<'static, ()>, *mut c_void, String)> {
    let alone = LIBZ
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if emulated() {
        println!("skipped under an emulator (a trap costs tens of microseconds)");
        return None;
    }
    let c = CString::new("libz.so.1").unwrap();
    // SAFETY: dlopen of a system library by name.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        println!("libz.so.1 is not on this system: skipped");
        return None;
    }
    let known = CString::new("compress2").unwrap();
    // SAFETY: a symbol lookup on a live handle; dladdr fills `info`.
    let path = unsafe {
        let any = libc::dlsym(handle, known.as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        assert!(libc::dladdr(any, &raw mut info) != 0);
        CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned()
    };
    Some((alone, handle, path))
}

/// The shortest of nine runs of `f` (printed, never asserted): the
/// workload takes a fraction of a millisecond, which a shared host's
/// noise can double.
fn best_time(f: impl Fn() -> Vec<u8>) -> std::time::Duration {
    (0..9)
        .map(|_| {
            let start = std::time::Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .min()
        .expect("nine runs")
}

/// Held by each test while it probes libz: their probes would join each
/// other's sites, and each test reads its own probes' modes.
static LIBZ: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Each exported function's address in the process, by name.
fn starts(sites: &[(String, usize, u64)]) -> std::collections::HashMap<&str, usize> {
    sites
        .iter()
        .filter(|s| s.1 == 0)
        .map(|s| {
            let entry = Uprobe::in_object("libz.so.1", &s.0).unwrap();
            (s.0.as_str(), entry.addr())
        })
        .collect()
}

#[test]
fn every_interior_instruction_of_libz() {
    let Some((_alone, handle, path)) = open_libz() else {
        return;
    };
    let plain = workload(handle);
    let sites = boundaries(&path);
    let starts = starts(&sites);
    let total = sites.len();
    let mut modes: BTreeMap<String, usize> = BTreeMap::new();
    let mut refused: BTreeMap<String, usize> = BTreeMap::new();
    let mut interior = (0, 0);
    let hits: Vec<u64> = rounds(sites.clone(), 24, |round| {
        let (probes, offsets) = attach_round(round, &starts, &mut refused);
        for (p, offset) in probes.iter().zip(offsets) {
            if offset > 0 {
                interior.0 += 1;
                interior.1 += usize::from(p.mode().is_jump());
            }
            *modes.entry(common::mode_key(&p.mode())).or_default() += 1;
        }
        let under_probes = workload(handle);
        assert!(under_probes == plain, "results changed under the probes");
        let hits = probes.iter().map(Probe::hits).sum();
        Probe::detach_all(probes).unwrap();
        hits
    });
    assert!(workload(handle) == plain);
    let jumps: usize = modes
        .iter()
        .filter(|(k, _)| k.starts_with("jump"))
        .map(|(_, n)| n)
        .sum();
    println!(
        "libz: {total} instruction boundaries in {} rounds, {} hits; {jumps} through a jump; \
         interior: {} of {} through a jump; refused: {refused:?}",
        hits.len(),
        hits.iter().sum::<u64>(),
        interior.1,
        interior.0,
    );
    println!("  modes: {modes:?}");
    assert!(
        hits.iter().sum::<u64>() > 0,
        "the workload reached no probe"
    );
    assert!(jumps > total / 2, "only {jumps} of {total} took a jump");
}

/// Every instruction boundary of libz's functions probed at the same
/// time, neighbours included: attached in one batch, then (in release
/// builds) one by one (in address order, each later probe landing in the
/// bytes an earlier punned jump depends on), the modes read once every probe is attached,
/// the workload's results identical to unprobed runs, and everything
/// detached one by one (each detach changing the bytes a neighbour's jump
/// ends in).
#[test]
fn every_instruction_of_libz_at_once() {
    let Some((_alone, handle, path)) = open_libz() else {
        return;
    };
    let plain = workload(handle);
    let unprobed = best_time(|| workload(handle));
    let sites = boundaries(&path);
    let starts = starts(&sites);
    // One by one, each attach plans its neighbours again: in a debug
    // build that takes minutes, so it runs in release builds only.
    let ways: &[bool] = if cfg!(debug_assertions) {
        &[false]
    } else {
        &[false, true]
    };
    for &one_by_one in ways {
        let mut refused = BTreeMap::new();
        let started = std::time::Instant::now();
        let (probes, _) = if one_by_one {
            let mut attached = (Vec::new(), Vec::new());
            for site in &sites {
                let (p, o) = attach_round(std::slice::from_ref(site), &starts, &mut refused);
                attached.0.extend(p);
                attached.1.extend(o);
            }
            attached
        } else {
            attach_round(&sites, &starts, &mut refused)
        };
        let took = started.elapsed();
        let modes = common::modes(&probes);
        let jumps: usize = probes.iter().filter(|p| p.mode().is_jump()).count();
        assert!(
            workload(handle) == plain,
            "results changed under the probes"
        );
        let under_probes = best_time(|| workload(handle));
        let hits: u64 = probes.iter().map(Probe::hits).sum();
        let trap_hits: u64 = probes
            .iter()
            .filter(|p| !p.mode().is_jump())
            .map(Probe::hits)
            .sum();
        println!(
            "libz, {} boundaries attached {} in {took:?} ({:?} an attach): {jumps} through a \
             jump, {} on a breakpoint (modes read after the whole attach), {hits} hits \
             ({trap_hits} on breakpoints); refused: {refused:?}",
            probes.len(),
            if one_by_one {
                "one by one"
            } else {
                "in one batch"
            },
            took / u32::try_from(if one_by_one { probes.len() } else { 1 }).unwrap(),
            probes.len() - jumps,
        );
        println!(
            "  the workload: {under_probes:?} under the probes, {unprobed:?} without ({:.2}x); modes: \
             {modes:?}",
            under_probes.as_secs_f64() / unprobed.as_secs_f64()
        );
        for p in probes.iter().filter(|p| !p.mode().is_jump()).take(16) {
            let (name, start) = starts
                .iter()
                .filter(|s| *s.1 <= p.addr())
                .max_by_key(|s| *s.1)
                .expect("a function");
            let bytes: Vec<u8> = (0..8).map(|k| common::byte_at(p.addr() + k)).collect();
            println!(
                "  on a breakpoint: {name}+{:#x} (as it is now: {bytes:02x?}): {:?}",
                p.addr() - start,
                p.mode()
            );
        }
        assert!(hits > 0, "the workload reached no probe");
        for p in probes {
            p.detach().unwrap();
        }
        assert!(workload(handle) == plain);
    }
}
