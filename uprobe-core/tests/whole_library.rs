//! Probes on every exported function of real libraries: libm (loaded for
//! the test if the program does not link it), and libz, libsqlite3 and
//! libcrypto where the system has them. A workload through the probed functions gives bit-identical
//! results with entry probes and with return probes; what was refused is
//! printed with the reasons.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_void};
use std::fmt::Write as _;

use common::{exported_functions, modes};
use uprobe_core::{AttachError, Probe, Uprobe};

/// Loads `name` (or finds it loaded), with `known`, one of its functions,
/// to find its path by.
fn open(name: &str, known: &str) -> Option<(*mut c_void, String)> {
    let c = CString::new(name).unwrap();
    // SAFETY: dlopen of a system library by name.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return None;
    }
    // The path the dynamic linker loaded, from the address of one of its
    // functions.
    let known = CString::new(known).unwrap();
    // SAFETY: a symbol lookup on a live handle; dladdr fills `info`, whose
    // file name then lives as long as the object stays loaded.
    let path = unsafe {
        let any = libc::dlsym(handle, known.as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        if any.is_null() || libc::dladdr(any, &raw mut info) == 0 {
            return None;
        }
        CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned()
    };
    Some((handle, path))
}

/// Attaches `make(name)` for every name, in batches of 128 (one look at
/// the process and one grace period each; a batch with a refusal in it
/// one by one); returns the probes and the refusals, counted by reason.
fn attach_every(
    object: &str,
    names: &[String],
    make: impl Fn(Uprobe) -> Uprobe,
) -> (Vec<Probe>, BTreeMap<String, usize>) {
    let mut probes = Vec::new();
    let mut refused = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    let mut found = Vec::new();
    for name in names {
        match Uprobe::in_object(object, name) {
            // Aliases (`exp` and `__exp_finite`, versions) share an
            // address: one consumer each would do, but one is enough here.
            Ok(p) if !seen.insert(p.addr()) => {}
            Ok(p) => found.push((name, p)),
            Err(e) => *refused.entry(kind(&e)).or_insert(0) += 1,
        }
    }
    while !found.is_empty() {
        let batch: Vec<(&String, Uprobe)> = found.drain(..found.len().min(128)).collect();
        let names: Vec<&String> = batch.iter().map(|(n, _)| *n).collect();
        if let Ok(attached) = Uprobe::attach_all(batch.into_iter().map(|(_, p)| make(p))) {
            probes.extend(attached);
            continue;
        }
        for name in names {
            match make(Uprobe::in_object(object, name).unwrap()).attach() {
                Ok(p) => probes.push(p),
                Err(e) => *refused.entry(kind(&e)).or_insert(0) += 1,
            }
        }
    }
    (probes, refused)
}

fn kind(e: &AttachError) -> String {
    match e {
        AttachError::Unsupported { why, .. } => format!("unsupported: {why}"),
        other => format!("{other:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap_or("?")
            .to_string(),
    }
}

type F1 = unsafe extern "C" fn(f64) -> f64;
type F2 = unsafe extern "C" fn(f64, f64) -> f64;

/// Calls a spread of libm functions over a range of inputs; the results'
/// bits.
fn libm_workload(handle: *mut c_void) -> Vec<u64> {
    let get = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: a symbol lookup on a live handle.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        assert!(!p.is_null(), "no {name} in libm");
        p
    };
    let unary = [
        "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "exp", "exp2",
        "expm1", "log", "log2", "log10", "log1p", "sqrt", "cbrt", "floor", "ceil", "round",
        "trunc", "erf", "erfc", "lgamma", "tgamma", "rint", "fabs",
    ];
    let binary = [
        "pow",
        "atan2",
        "hypot",
        "fmod",
        "fmin",
        "fmax",
        "copysign",
        "remainder",
    ];
    let mut out = Vec::new();
    for i in 0..200 {
        let x = f64::from(i) * 0.037 - 2.5;
        let y = f64::from(i % 17) * 0.31 + 0.1;
        for name in unary {
            // SAFETY: these libm functions take and return one double.
            let f = unsafe { std::mem::transmute::<*mut c_void, F1>(get(name)) };
            // SAFETY: as above; any double is a valid argument.
            out.push(unsafe { f(x) }.to_bits());
        }
        for name in binary {
            // SAFETY: these take two doubles and return one.
            let f = unsafe { std::mem::transmute::<*mut c_void, F2>(get(name)) };
            // SAFETY: as above.
            out.push(unsafe { f(x, y) }.to_bits());
        }
    }
    out
}

/// Compresses and decompresses a generated buffer with libz; the
/// compressed bytes and the round trip.
fn libz_workload(handle: *mut c_void) -> Vec<u8> {
    common::libz_round_trip(handle, 200_000, 9)
}

fn check_library(lib: &str, known: &str, workload: fn(*mut c_void) -> Vec<u8>) {
    check_every(lib, known, workload, 1);
}

/// [`check_library`] on every `step`th exported function.
fn check_every(lib: &str, known: &str, workload: fn(*mut c_void) -> Vec<u8>, step: usize) {
    let Some((handle, path)) = open(lib, known) else {
        println!("{lib} is not on this system: skipped");
        return;
    };
    let object = std::path::Path::new(&path)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let names: Vec<String> = exported_functions(&path)
        .into_iter()
        .step_by(step)
        .collect();
    let plain = workload(handle);
    for returns in [false, true] {
        let (probes, refused) = attach_every(&object, &names, |p| {
            if returns {
                p.on_return(|_| {})
            } else {
                p.on_entry(|_| {})
            }
        });
        let under_probes = workload(handle);
        let hits: u64 = probes
            .iter()
            .map(|p| if returns { p.returns() } else { p.hits() })
            .sum();
        println!(
            "{object} ({} exported functions), {} probes: {} attached, {hits} {}, refused: {refused:?}",
            names.len(),
            if returns { "return" } else { "entry" },
            probes.len(),
            if returns { "returns" } else { "hits" },
        );
        let modes = modes(&probes);
        println!("  modes: {modes:?}");
        if cfg!(target_arch = "x86_64") {
            assert!(
                modes.keys().any(|k| k.starts_with("jump")),
                "no site took a jump"
            );
        }
        assert!(!probes.is_empty());
        assert!(hits > 0, "the workload reached no probe");
        assert!(
            under_probes == plain,
            "{object}: results changed under the probes"
        );
        Probe::detach_all(probes).unwrap();
        assert!(workload(handle) == plain);
    }
}

type SqlOpen = unsafe extern "C" fn(*const libc::c_char, *mut *mut c_void) -> i32;
type SqlRow =
    unsafe extern "C" fn(*mut c_void, i32, *mut *mut libc::c_char, *mut *mut libc::c_char) -> i32;
type SqlExec = unsafe extern "C" fn(
    *mut c_void,
    *const libc::c_char,
    Option<SqlRow>,
    *mut c_void,
    *mut *mut libc::c_char,
) -> i32;
type SqlClose = unsafe extern "C" fn(*mut c_void) -> i32;

/// An SQL workload in an in-memory database (tables, indexes, `ANALYZE`,
/// joins, aggregates, a window function, range and point queries, an
/// update, a delete, an integrity check); every row of every result, as
/// text.
fn sqlite_workload(handle: *mut c_void) -> Vec<u8> {
    unsafe extern "C" fn row(
        out: *mut c_void,
        n: i32,
        values: *mut *mut libc::c_char,
        _: *mut *mut libc::c_char,
    ) -> i32 {
        // SAFETY: `out` is the vector below; sqlite passes `n` values,
        // each a C string or null.
        unsafe {
            let out = &mut *out.cast::<Vec<u8>>();
            for i in 0..n as usize {
                let v = *values.add(i);
                if !v.is_null() {
                    out.extend_from_slice(CStr::from_ptr(v).to_bytes());
                }
                out.push(b'|');
            }
            out.push(b'\n');
        }
        0
    }
    let get = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: a symbol lookup on a live handle.
        unsafe { libc::dlsym(handle, c.as_ptr()) }
    };
    // SAFETY: sqlite3_open, sqlite3_exec and sqlite3_close's signatures.
    let (open, exec, close) = unsafe {
        (
            std::mem::transmute::<*mut c_void, SqlOpen>(get("sqlite3_open")),
            std::mem::transmute::<*mut c_void, SqlExec>(get("sqlite3_exec")),
            std::mem::transmute::<*mut c_void, SqlClose>(get("sqlite3_close")),
        )
    };
    let mut sql = String::from(
        "BEGIN; CREATE TABLE a(id INTEGER PRIMARY KEY, x INT, s TEXT); \
         CREATE TABLE b(id INTEGER PRIMARY KEY, a_id INT, y REAL); \
         CREATE TABLE c(k TEXT PRIMARY KEY, v INT);",
    );
    let rows = 150;
    for i in 0..rows {
        let _ = write!(
            sql,
            "INSERT INTO a VALUES({i},{},'s{}');INSERT INTO b VALUES({i},{},{}.5);\
             INSERT INTO c VALUES('k{i}',{});",
            i * 7 % 100,
            i % 97,
            (i * 13) % rows,
            i % 13,
            i % 31
        );
    }
    sql += "COMMIT; CREATE INDEX ax ON a(x); CREATE INDEX ba ON b(a_id); ANALYZE; \
        SELECT a.x, count(*), sum(b.y) FROM a JOIN b ON b.a_id = a.id GROUP BY a.x ORDER BY 2 DESC, 1 LIMIT 20; \
        SELECT id, x, rank() OVER (PARTITION BY x % 10 ORDER BY id) FROM a WHERE id < 100; \
        SELECT * FROM a WHERE x BETWEEN 10 AND 20 ORDER BY id; SELECT v FROM c WHERE k = 'k42'; \
        UPDATE a SET x = x + 1 WHERE id % 3 = 0; DELETE FROM b WHERE id % 5 = 0; \
        SELECT count(*), sum(x) FROM a; SELECT count(*) FROM b; PRAGMA integrity_check;";
    let memory = CString::new(":memory:").unwrap();
    let sql = CString::new(sql).unwrap();
    let mut out = Vec::new();
    let mut db = std::ptr::null_mut();
    // SAFETY: an in-memory database, a statement list and a callback
    // that only appends to `out`, which outlives the call.
    unsafe {
        assert_eq!(open(memory.as_ptr(), &raw mut db), 0, "sqlite3_open");
        let rc = exec(
            db,
            sql.as_ptr(),
            Some(row),
            (&raw mut out).cast(),
            std::ptr::null_mut(),
        );
        assert_eq!(rc, 0, "sqlite3_exec");
        close(db);
    }
    out
}

type Digest = unsafe extern "C" fn(*const u8, usize, *mut u8) -> *mut u8;

/// Digests of generated buffers with libcrypto's one-shot SHA-1, SHA-256
/// and SHA-512 (hand-written assembly inside, with several entry points).
fn libcrypto_workload(handle: *mut c_void) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, len) in [("SHA1", 20), ("SHA256", 32), ("SHA512", 64)] {
        let c = CString::new(name).unwrap();
        // SAFETY: a symbol lookup on a live handle; OpenSSL's one-shot
        // digest signature.
        let digest: Digest = unsafe { std::mem::transmute(libc::dlsym(handle, c.as_ptr())) };
        for size in [0usize, 1, 55, 64, 1000, 100_000] {
            let input: Vec<u8> = (0..size).map(|i| (i * 31 % 253) as u8).collect();
            let mut md = vec![0u8; len];
            // SAFETY: an input of `size` bytes, an output of the digest's size.
            unsafe { digest(input.as_ptr(), input.len(), md.as_mut_ptr()) };
            out.extend_from_slice(&md);
        }
    }
    out
}

fn bits(v: Vec<u64>) -> Vec<u8> {
    v.into_iter().flat_map(u64::to_le_bytes).collect()
}

#[test]
fn every_exported_function_of_libm() {
    check_library("libm.so.6", "cos", |h| bits(libm_workload(h)));
}

#[test]
fn every_exported_function_of_libsqlite3() {
    check_library("libsqlite3.so.0", "sqlite3_open", sqlite_workload);
}

#[test]
fn every_exported_function_of_libz() {
    check_library("libz.so.1", "crc32", libz_workload);
}

#[test]
fn every_exported_function_of_libcrypto() {
    // 5,000 functions: every one in release builds, every fourth in debug
    // builds and under an emulator (the release runs show them all).
    let step = if cfg!(debug_assertions) || common::emulated() {
        4
    } else {
        1
    };
    check_every("libcrypto.so.3", "SHA256", libcrypto_workload, step);
}
