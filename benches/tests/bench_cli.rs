//! The `bench` binary end to end, with tiny durations: every scenario runs,
//! rows have the seed format, JSON rows parse, bad input is refused with
//! exit code 2 and a reason before anything runs, help and version print.
//! (Behaviour only: no timing is asserted.)

use std::process::{Command, Output};

fn bench() -> Command {
    test_support::command(env!("CARGO_BIN_EXE_bench"))
}

fn run(args: &[&str]) -> Output {
    bench().args(args).output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The label a JSON row's line carries: `(  N thread(s))`, or
/// `(  N threads on C cpu(s))` when its threads shared CPUs.
fn label(row: &serde_json::Value) -> String {
    let n = |key: &str| {
        row[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {row}"))
    };
    let (workers, cpus) = (n("workers"), n("cpus"));
    let s = |n: u64| if n == 1 { "" } else { "s" };
    if workers > cpus {
        format!("({workers:>3} threads on {cpus} cpu{})", s(cpus))
    } else {
        format!("({workers:>3} thread{})", s(workers))
    }
}

#[test]
fn list_names_every_scenario_and_impl() {
    let out = bench().arg("--list").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for sc in benches::scenarios::all() {
        assert!(text.contains(sc.name), "--list misses {}", sc.name);
        assert!(text.contains(&sc.impls.join(", ")));
    }
}

#[test]
fn every_scenario_runs_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for sc in benches::scenarios::all() {
        let json = dir.join(format!("{}.json", sc.name));
        let out = bench()
            .args([
                sc.name,
                "--threads",
                "1,2",
                "--duration-ms",
                "5",
                "--runs",
                "2",
                "--json",
            ])
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {}{}",
            sc.name,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        for imp in sc.impls {
            let ran = rows.iter().any(|r| {
                r["impl"]
                    .as_str()
                    .is_some_and(|i| i.split(':').next() == Some(*imp))
            });
            let skipped =
                stdout.contains(&format!("{}/{imp} (", sc.name)) && stdout.contains("): skipped: ");
            assert!(
                ran || skipped,
                "{}/{imp} neither ran nor said why not",
                sc.name
            );
        }
        for r in &rows {
            for key in [
                "scenario",
                "impl",
                "threads",
                "workers",
                "cpus",
                "mops",
                "stddev",
                "mops_per_thread",
                "runs",
            ] {
                assert!(r.get(key).is_some(), "row lacks {key}: {r}");
            }
            assert_eq!(r["runs"], 2);
            let name = format!(
                "{}/{} ",
                r["scenario"].as_str().unwrap(),
                r["impl"].as_str().unwrap()
            );
            let label = label(r);
            let printed = stdout
                .lines()
                .find(|l| l.starts_with(&name) && l.contains(&format!("{label}: ")))
                .unwrap_or_else(|| panic!("{name}{label} not printed:\n{stdout}"));
            assert!(printed.contains("M/s/cpu)"), "format: {printed}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flags that make a run as short as it gets, should a refusal come late.
const TINY: [&str; 6] = ["--duration-ms", "1", "--runs", "1", "--threads", "1"];

/// Asserts that `args` is a usage error: exit code 2, nothing run or
/// printed on stdout, and stderr saying each of `needles`.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let out = run(args);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: {}\n{err}",
        out.status
    );
    assert!(
        stdout(&out).is_empty(),
        "{args:?} printed: {}",
        stdout(&out)
    );
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: no {needle:?} in\n{err}");
    }
}

#[test]
fn unknown_options_and_forms_are_refused() {
    assert_refused(&["--bogus"], &["unexpected argument '--bogus'"]);
    assert_refused(&["counter", "--bogus"], &["unexpected argument '--bogus'"]);
    assert_refused(&["seeds", "--bogus"], &["unexpected argument '--bogus'"]);
    assert_refused(&["counter", "1,2"], &["unexpected argument '1,2'"]);
    assert_refused(
        &["no-such-scenario"],
        &["unknown scenario 'no-such-scenario'", "bench --list"],
    );
    assert_refused(&["--list", "counter"], &["--list takes no scenario"]);
    assert_refused(
        &["--threads", "2", "counter"],
        &[
            "unexpected argument '--threads'",
            "options go after the form",
        ],
    );
}

#[test]
fn options_of_the_other_form_are_refused_with_why() {
    for args in [
        &["seeds", "--impl", "lease"][..],
        &["seeds", "--json", "x.json"],
        &["seeds", "--json=x.json"],
    ] {
        assert_refused(
            args,
            &["unexpected argument '--", "go with a single scenario"],
        );
    }
    assert_refused(
        &["counter", "--out", "x"],
        &[
            "unexpected argument '--out'",
            "--out goes with `bench seeds",
        ],
    );
}

#[test]
fn bad_values_are_refused() {
    for (args, needles) in [
        (
            &["counter", "--duration-ms", "0"][..],
            &["'--duration-ms <MS>'", "must be at least 1"][..],
        ),
        (
            &["seeds", "--duration-ms", "soon"],
            &["invalid value 'soon' for '--duration-ms"],
        ),
        (
            &["counter", "--runs", "0"],
            &["'--runs <N>'", "must be at least 1"],
        ),
        (
            &["seeds", "--runs", "-3"],
            &["'--runs <N>'", "must be at least 1"],
        ),
        (
            &["counter", "--threads", "0"],
            &["'--threads <N,...>'", "must be at least 1"],
        ),
        (
            &["counter", "--threads", "1,two"],
            &[
                "invalid value 'two' for '--threads",
                "positive whole number",
            ],
        ),
        (
            &["seeds", "--threads", "1,,2"],
            &["invalid value '' for '--threads"],
        ),
        (
            &["counter", "--runs"],
            &["a value is required for '--runs <N>'"],
        ),
    ] {
        assert_refused(args, needles);
    }
}

#[test]
fn unknown_impl_is_refused_with_the_scenarios_impls() {
    let counter = benches::scenarios::find("counter").unwrap();
    let valid = format!("[possible values: {}]", counter.impls.join(", "));
    for imps in ["nope", "rseq,nope"] {
        assert_refused(
            &["counter", "--impl", imps],
            &["invalid value 'nope' for '--impl", &valid],
        );
    }
    // An implementation of another scenario is no implementation of this one.
    assert_refused(&["counter", "--impl", "lease"], &["invalid value 'lease'"]);
}

#[test]
fn unwritable_outputs_are_refused_before_the_run() {
    let json = ["counter", "--json", "/nonexistent-dir/x.json"];
    assert_refused(
        &[&json[..], &TINY].concat(),
        &[
            "--json /nonexistent-dir/x.json: cannot be written",
            "Usage: bench counter",
        ],
    );
    // --out under a regular file: no directory can be made there (not even
    // by root).
    let file = std::env::temp_dir().join(format!("bench-cli-file-{}", std::process::id()));
    std::fs::write(&file, "").unwrap();
    let out = file.join("charts");
    let out = out.to_str().unwrap();
    assert_refused(
        &[&["seeds", "--out", out][..], &TINY].concat(),
        &[
            &format!("--out {out}: cannot create the directory"),
            "Usage: bench seeds",
        ],
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn no_arguments_print_the_help_as_an_error() {
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("Usage: bench seeds"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn help_explains_every_form() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let text = stdout(&out);
    for needle in [
        "Usage: bench seeds [--threads 1,2] [--duration-ms 250] [--runs 3] [--out DIR]",
        "bench SCENARIO [--threads 1,2] [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]",
        "bench --list",
        "`seeds` runs every seed's before/after comparison",
        "SCENARIO runs every implementation of one scenario",
        "--threads defaults to 1 up to the number of allowed CPUs",
        "--version",
    ] {
        assert!(text.contains(needle), "--help lacks {needle:?}:\n{text}");
    }
    let short = stdout(&run(&["-h"]));
    assert!(short.contains("Usage: bench seeds") && short.len() < text.len());

    let seeds = run(&["seeds", "--help"]);
    assert!(seeds.status.success());
    let text = stdout(&seeds);
    for needle in [
        "Usage: bench seeds [OPTIONS]",
        "`seeds` runs every seed's before/after comparison",
        "--out <DIR>",
        "[default: target/bench/seeds]",
        "[default: 250]",
        "[default: 3]",
    ] {
        assert!(
            text.contains(needle),
            "seeds --help lacks {needle:?}:\n{text}"
        );
    }
    assert!(!text.contains("--json"));
    assert_eq!(stdout(&run(&["help", "seeds"])), text);
}

#[test]
fn scenario_help_names_its_impls() {
    let counter = benches::scenarios::find("counter").unwrap();
    let out = run(&["counter", "--help"]);
    assert!(out.status.success());
    let text = stdout(&out);
    for needle in [
        "Usage: bench counter [OPTIONS]",
        counter.about,
        "SCENARIO runs every implementation of one scenario",
        &format!("[possible values: {}]", counter.impls.join(", ")),
        "--json <FILE>",
        "[default: 500]",
        "[default: 5]",
    ] {
        assert!(
            text.contains(needle),
            "counter --help lacks {needle:?}:\n{text}"
        );
    }
    assert!(!text.contains("--out"));
    assert_eq!(stdout(&run(&["help", "counter"])), text);
}

#[test]
fn version_prints_the_version() {
    let out = run(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        stdout(&out),
        format!("bench {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// More threads than allowed CPUs: the row says how many threads shared
/// how many CPUs, and never calls the threads CPUs.
#[test]
fn rows_past_the_cpus_say_threads_on_cpus() {
    let cpus = benches::harness::allowed_cpus().len();
    let threads = (cpus + 1).to_string();
    let out = run(&[
        "counter",
        "--impl",
        "shared",
        "--threads",
        &threads,
        "--duration-ms",
        "1",
        "--runs",
        "1",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    let cpu_word = if cpus == 1 { "cpu" } else { "cpus" };
    let label = format!("({:>3} threads on {cpus} {cpu_word}):", cpus + 1);
    assert!(
        text.lines()
            .any(|l| l.starts_with("counter/shared ") && l.contains(&label)),
        "no {label:?} in:\n{text}"
    );
    assert!(!text.contains(&format!("{} cpus)", cpus + 1)), "{text}");
}

/// `bench seeds` with tiny durations: every seed's table is printed (with
/// the before row marked and ratios on the others), the rows are written
/// as JSON and each seed gets a chart with its labels.
#[test]
fn seeds_prints_every_table_and_writes_rows_and_charts() {
    let dir = std::env::temp_dir().join(format!("bench-seeds-{}", std::process::id()));
    let out = bench()
        .args([
            "seeds",
            "--threads",
            "1",
            "--duration-ms",
            "5",
            "--runs",
            "1",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for seed in benches::seeds::SEEDS {
        let header = format!("## seed {}: {}", seed.id, seed.patch);
        assert!(stdout.contains(&header), "missing table {}", seed.id);
        let svg = std::fs::read_to_string(dir.join(format!("seed-{}.svg", seed.id)))
            .unwrap_or_else(|e| panic!("seed {} chart: {e}", seed.id));
        assert!(svg.starts_with("<svg"), "seed {}: not an SVG", seed.id);
        for label in [seed.id, "threads", "million ops/s", "CPUs", "(before)"] {
            assert!(
                svg.contains(label),
                "seed {} chart lacks {label:?}",
                seed.id
            );
        }
    }
    assert!(stdout.contains("(before)"));
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("M/s/cpu)") && l.contains("x "))
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("rows.json")).unwrap()).unwrap();
    assert!(!rows.is_empty());
    for seed in benches::seeds::SEEDS {
        for part in seed.parts {
            if benches::scenarios::find(part.scenario).is_some() {
                assert!(
                    rows.iter().any(|r| r["scenario"] == part.scenario),
                    "no rows for {}",
                    part.scenario
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
