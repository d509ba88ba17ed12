//! `uprobe-trace`'s command-line specs (`-f`, `-u`, `--hist`, `-x`, and
//! the filters after ` if `) and
//! the plan the tool hands its agent: any text parses into a probe or an
//! error, and every plan made of parsed probes decodes, from its
//! encoding, into the same plan.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The module itself, not the crate: `uprobe-trace`'s library is the agent
// the tool preloads, and linking it interposes `pthread_create`,
// `dlopen` and `sigaction` (which the fuzzer's sanitizer intercepts too).
#[path = "../../uprobe-trace/src/by.rs"]
#[allow(dead_code)]
mod by;
#[path = "../../uprobe-trace/src/filter.rs"]
#[allow(dead_code)]
mod filter;
#[path = "../../uprobe-trace/src/spec.rs"]
#[allow(dead_code)]
mod spec;

use spec::{Plan, ProbeSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut plan = Plan::default();
    for (i, item) in text.split('\n').enumerate() {
        let flags = item.len() as u8;
        let parsed = match i % 4 {
            0 => spec::parse_function(item).map(|(target, args)| (target, args, None)),
            1 => spec::parse_usdt(item).map(|(target, args)| (target, args, None)),
            2 => spec::parse_hist(item).map(|(target, drawn)| (target, Vec::new(), Some(drawn))),
            _ => {
                match spec::parse_exclude(item) {
                    Ok(x) => plan.exclude.push(x),
                    Err(e) => assert!(!e.is_empty()),
                }
                let _ = plan.excludes(item);
                continue;
            }
        };
        match parsed {
            Ok((target, args, hist)) => {
                let _ = target.is_pattern();
                let mut probe = ProbeSpec::counting(target);
                probe.args = args;
                probe.hist = hist;
                probe.latency = flags & 1 != 0;
                probe.print = flags & 2 != 0;
                probe.stacks = flags & 4 != 0;
                probe.trap_only = flags & 8 != 0;
                // A filter after ` if `: parsed, it survives the encoding too.
                probe.filter = spec::split_filter(item).ok().and_then(|(_, f)| f);
                let _ = probe.label();
                plan.probes.push(probe);
            }
            Err(e) => assert!(!e.is_empty()),
        }
    }
    let encoded = spec::encode(&plan);
    assert_eq!(
        spec::decode(&encoded).as_ref(),
        Ok(&plan),
        "the plan does not survive its encoding {encoded:?}"
    );
    // Patterns match what they are made of.
    for x in &plan.exclude {
        if !x.contains(['*', '?']) {
            assert!(spec::glob(x, x), "{x:?}");
        }
    }
});
