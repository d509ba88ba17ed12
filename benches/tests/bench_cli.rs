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
