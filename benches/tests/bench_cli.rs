//! The `bench` binary end to end, with tiny durations: every scenario runs,
//! rows have the seed format, JSON rows parse, bad input is refused.
//! (Behaviour only: no timing is asserted.)

use std::process::Command;

fn bench() -> Command {
    test_support::command(env!("CARGO_BIN_EXE_bench"))
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
                "mops",
                "stddev",
                "mops_per_thread",
                "runs",
            ] {
                assert!(r.get(key).is_some(), "row lacks {key}: {r}");
            }
            assert_eq!(r["runs"], 2);
            let line = format!(
                "{}/{}",
                r["scenario"].as_str().unwrap(),
                r["impl"].as_str().unwrap()
            );
            let printed = stdout
                .lines()
                .find(|l| l.starts_with(&line))
                .expect("row printed");
            assert!(
                printed.contains(" cpus): ") && printed.contains("M/s/cpu)"),
                "format: {printed}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    for (args, needle) in [
        (&["no-such-scenario"][..], "unknown scenario"),
        (&["counter", "--threads", "0"][..], "--threads"),
        (
            &["counter", "--impl", "nope"][..],
            "no implementation \"nope\"",
        ),
        (&["counter", "--bogus"][..], "unknown option"),
        (
            &["seeds", "--impl", "lease"][..],
            "seeds: --impl and --json",
        ),
        (&["counter", "--out", "x"][..], "--out is for `seeds`"),
    ] {
        let out = bench().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(needle),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
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
        for label in [seed.id, "threads", "million ops/s", "CPUs"] {
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
