//! USDT probes: real `.note.stapsdt` notes from a fixture built with
//! `<sys/sdt.h>` (when a C compiler and the header are here; CI installs
//! them), and from system libraries that have some (libstdc++, libpython).
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

use uprobe_core::usdt;
use uprobe_core::{AttachError, Probe, Uprobe};

/// The fixture library, built once per process (tests running beside
/// each other would otherwise rewrite it while another loads it); `None`
/// (with the reason printed) where it cannot be built here, unless
/// `UPROBE_USDT_FIXTURE=required` (CI, which installs the compiler and the
/// header): then that is a failure.
fn fixture() -> Option<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(build_fixture);
    if let Err(why) = built {
        println!("skipped: {why}");
    }
    assert!(
        built.is_ok() || std::env::var("UPROBE_USDT_FIXTURE").as_deref() != Ok("required"),
        "the USDT fixture is required (UPROBE_USDT_FIXTURE=required) but could not be built"
    );
    built.as_ref().ok().cloned()
}

fn build_fixture() -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("uprobe-usdt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let out = dir.join("libusdt_fixture.so");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/usdt.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| {
        if cfg!(target_arch = "aarch64") && std::env::consts::ARCH != "x86_64" {
            "aarch64-linux-gnu-gcc".into()
        } else {
            "cc".into()
        }
    });
    let built = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-g0", "-o"])
        .arg(&out)
        .arg(source)
        .output();
    match built {
        Ok(o) if o.status.success() => Ok(out),
        Ok(o) => Err(format!(
            "{cc} could not build the fixture (is <sys/sdt.h> installed?): {}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("no C compiler ({cc}): {e}")),
    }
}

/// `dlopen`s `path` (kept loaded).
fn load(path: &str) -> Option<*mut libc::c_void> {
    let c = CString::new(path).unwrap();
    // SAFETY: loading a library with plain constructors.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
    (!h.is_null()).then_some(h)
}

fn symbol(h: *mut libc::c_void, name: &str) -> usize {
    let c = CString::new(name).unwrap();
    // SAFETY: looking a symbol up in a handle of ours.
    let f = unsafe { libc::dlsym(h, c.as_ptr()) };
    assert!(!f.is_null(), "{name} not found");
    f as usize
}

#[repr(C)]
struct Item {
    key: i64,
    parts: [i32; 4],
}

type Fire = unsafe extern "C" fn(i32, i64, *const libc::c_char, *mut Item, i64) -> i64;
type FireO0 = unsafe extern "C" fn(i32, i64, i16) -> i64;

/// Attaches a probe on every site of `provider:name` that records the
/// arguments into `seen`.
fn record(object: &str, name: &str, seen: &Arc<[AtomicI64; 8]>) -> Vec<Probe> {
    let sites = Uprobe::usdt(object, "fixture", name).unwrap();
    Uprobe::attach_all(sites.into_iter().map(|u| {
        let seen = Arc::clone(seen);
        u.on_entry(move |cx| {
            for (i, slot) in seen.iter().enumerate().take(cx.usdt_arg_count()) {
                slot.store(cx.usdt_arg(i).unwrap(), SeqCst);
            }
        })
    }))
    .unwrap()
}

#[test]
fn arguments_of_every_form_are_read_as_the_program_passed_them() {
    let Some(path) = fixture() else { return };
    let object = path.to_str().unwrap();
    let h = load(object).expect("dlopen the fixture");
    let probes = usdt::probes(object).unwrap();
    for p in &probes {
        println!(
            "{}:{} at {:#x} sem {:?}: {}",
            p.provider, p.name, p.addr, p.semaphore, p.spec
        );
        p.args()
            .unwrap_or_else(|e| panic!("{}:{}: {e}", p.provider, p.name));
    }
    assert!(probes.iter().any(|p| p.name == "args"));
    assert!(probes.iter().any(|p| p.name == "frame"));

    let seen: Arc<[AtomicI64; 8]> = Arc::new(Default::default());
    let args = record(object, "args", &seen);
    // SAFETY: the fixture's function, with its C signature.
    let fire: Fire = unsafe { core::mem::transmute(symbol(h, "fixture_fire")) };
    let text = CString::new("hello").unwrap();
    let mut item = Item {
        key: 1,
        parts: [10, -20, 30, 40],
    };
    // SAFETY: valid pointers, as the C function expects.
    let result = unsafe { fire(-7, 1 << 40, text.as_ptr(), &raw mut item, 1) };
    assert_eq!(result, (1 << 40) - 7);
    let got: Vec<i64> = seen.iter().map(|a| a.load(SeqCst)).collect();
    assert_eq!(got[0], -7, "int in a register");
    assert_eq!(got[1], 1 << 40, "long");
    assert_eq!(
        got[2] as usize,
        text.as_ptr() as usize,
        "a string is its address"
    );
    assert_eq!(got[3], -20, "an array element (base + index * scale)");
    assert_eq!(got[4], 42, "a constant");
    assert_eq!(got[5], -3, "a signed byte");
    assert!(args.iter().map(Probe::hits).sum::<u64>() >= 1);

    let frame = record(object, "frame", &seen);
    // SAFETY: as above.
    let fire_o0: FireO0 = unsafe { core::mem::transmute(symbol(h, "fixture_fire_o0")) };
    // SAFETY: as above.
    assert_eq!(unsafe { fire_o0(5, 99, -300) }, 100);
    let got: Vec<i64> = seen.iter().take(4).map(|a| a.load(SeqCst)).collect();
    assert_eq!(got, [5, 100, -300, 200], "frame slots (-N(%rbp) / [sp, N])");
    drop((args, frame));
}

#[test]
fn a_semaphore_is_held_while_a_probe_is_attached() {
    // Its own process: another test probes fixture_fire and calls it (hits
    // and arguments are exact here and there).
    test_support::in_own_process("a_semaphore_is_held_while_a_probe_is_attached", || {
        let Some(path) = fixture() else { return };
        let object = path.to_str().unwrap();
        let h = load(object).expect("dlopen the fixture");
        let guarded = usdt::probes(object)
            .unwrap()
            .into_iter()
            .find(|p| p.name == "guarded")
            .expect("the guarded probe");
        let sem = guarded.semaphore.expect("a semaphore");
        let value = || {
            // SAFETY: the fixture's semaphore, a u16.
            unsafe { (sem as *const u16).read_volatile() }
        };
        assert_eq!(value(), 0);
        // SAFETY: the fixture's function, with its C signature.
        let fire: Fire = unsafe { core::mem::transmute(symbol(h, "fixture_fire")) };
        let mut item = Item {
            key: 0,
            parts: [0; 4],
        };
        let doubled = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&doubled);
        let probe = guarded
            .uprobe()
            .unwrap()
            .on_entry(move |cx| seen.store(cx.usdt_arg(0).unwrap() as u64, SeqCst))
            .attach()
            .unwrap();
        assert_eq!(value(), 1, "held while attached");
        // SAFETY: valid pointers.
        unsafe { fire(1, 21, c"x".as_ptr(), &raw mut item, 0) };
        assert_eq!((probe.hits(), doubled.load(SeqCst)), (1, 42));
        let second = guarded.uprobe().unwrap().attach().unwrap();
        assert_eq!(value(), 2, "each attached probe counts");
        drop(second);
        probe.detach().unwrap();
        assert_eq!(value(), 0, "given back on detach");
    });
}

#[test]
fn unknown_probes_and_objects_are_errors() {
    assert!(matches!(
        Uprobe::usdt("no-such-object.so", "p", "n"),
        Err(AttachError::NoSuchObject { .. })
    ));
    let Some(path) = fixture() else { return };
    let object = path.to_str().unwrap();
    load(object).expect("dlopen the fixture");
    let err = Uprobe::usdt(object, "fixture", "nope").unwrap_err();
    assert!(matches!(err, AttachError::UsdtNotFound { .. }), "{err}");
}

/// System libraries that carry notes: every argument spec parses.
#[test]
fn notes_of_system_libraries_parse() {
    let mut checked = 0;
    for lib in [
        "libstdc++.so.6",
        "libpython3.11.so.1.0",
        "libpython3.12.so.1.0",
    ] {
        if load(lib).is_none() {
            println!("{lib}: not here");
            continue;
        }
        let probes = usdt::probes(lib).unwrap();
        for p in &probes {
            p.args()
                .unwrap_or_else(|e| panic!("{lib} {}:{}: {e}", p.provider, p.name));
        }
        let names: Vec<String> = probes
            .iter()
            .map(|p| format!("{}:{}", p.provider, p.name))
            .collect();
        println!("{lib}: {} probes: {names:?}", probes.len());
        if lib.starts_with("libstdc++") && !probes.is_empty() {
            assert!(names.contains(&"libstdcxx:throw".to_string()));
        }
        checked += probes.len();
    }
    println!("{checked} probe sites parsed");
}

/// Python's USDT sites (Debian's `<sys/sdt.h>` makes each a 1-byte
/// `nop`) take a jump punned over the bytes after the `nop` (x86-64),
/// where libpython is here: each attached (nothing runs them), its mode
/// printed.
#[cfg(target_arch = "x86_64")]
#[test]
fn python_usdt_sites_take_jumps() {
    // Its own process: it attaches probes in libpython (loaded for it).
    test_support::in_own_process("python_usdt_sites_take_jumps", || {
        let lib = "libpython3.11.so.1.0";
        if load(lib).is_none() {
            println!("{lib}: not here");
            return;
        }
        let probes = usdt::probes(lib).unwrap();
        let mut jumps = 0;
        for p in &probes {
            let probe = p.uprobe().unwrap().attach().unwrap();
            println!("{}:{}: {:?}", p.provider, p.name, probe.mode());
            jumps += usize::from(probe.mode().is_jump());
        }
        println!("{jumps} of {} USDT sites take a jump", probes.len());
        assert!(probes.is_empty() || jumps > 0, "no USDT site took a jump");
    });
}
