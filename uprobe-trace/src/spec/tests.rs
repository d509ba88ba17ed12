//! The specs' parsers and the plan's encoding.

use super::*;

fn function(text: &str) -> ProbeSpec {
    let (target, args) = parse_function(text).unwrap();
    ProbeSpec {
        args,
        ..ProbeSpec::counting(target)
    }
}

#[test]
fn names_with_control_characters_or_an_empty_object_are_refused() {
    // Found by fuzzing (`trace_spec`): the plan's encoding separates
    // fields with U+001F and records with U+001E, so a name with
    // either came back from the agent as another plan, or none; and
    // `:provider:name` came back without its empty object.
    for bad in ["f\u{1f}oo", "a\u{1e}b", "x\ny", "tab\tbed"] {
        assert!(parse_function(bad).is_err(), "{bad:?}");
        assert!(parse_usdt(&format!("p:{bad}")).is_err(), "{bad:?}");
        assert!(parse_exclude(bad).is_err(), "{bad:?}");
    }
    assert!(parse_usdt(":provider:name").is_err());
    assert_eq!(parse_exclude("*_v2").as_deref(), Ok("*_v2"));
}

#[test]
fn plans_round_trip() {
    let mut usdt = ProbeSpec::counting(parse_usdt("python:function__entry").unwrap().0);
    usdt.args = parse_usdt("p:n(str,str,int)").unwrap().1;
    usdt.print = true;
    let plan = Plan {
        probes: vec![
            ProbeSpec {
                latency: true,
                ..function("malloc(size_t)")
            },
            ProbeSpec {
                print: true,
                stacks: true,
                ..function("libz.so.1:deflate(ptr,int)")
            },
            ProbeSpec {
                hist: Some(Drawn::Arg(2)),
                ..function("libsqlite3.so.0:sqlite3_*")
            },
            ProbeSpec {
                hist: Some(Drawn::Ret),
                trap_only: true,
                ..function("read(int,void *,size_t)")
            },
            usdt,
            ProbeSpec::counting(parse_usdt("libstdc++.so.6:libstdcxx:throw").unwrap().0),
        ],
        exclude: vec!["sqlite3_str*".into(), "*_v2".into()],
        list: false,
        by: None,
    };
    assert_eq!(decode(&encode(&plan)).unwrap(), plan);
    let listing = Plan {
        list: true,
        by: Some(By::Comm),
        ..plan.clone()
    };
    assert_eq!(decode(&encode(&listing)).unwrap(), listing);
    assert_eq!(plan.probes[1].label(), "libz.so.1:deflate");
    assert_eq!(
        plan.probes[3].args,
        [ArgType::I32, ArgType::Hex, ArgType::U64]
    );
    assert_eq!(plan.probes[5].label(), "libstdc++.so.6:libstdcxx:throw");
    assert!(plan.probes[2].target.is_pattern());
    assert!(plan.excludes("sqlite3_str_new") && !plan.excludes("sqlite3_open"));
    assert!(plan.probes[3].wants_return() && !plan.probes[2].wants_return());
}

#[test]
fn globs_match_as_the_shell_does() {
    assert!(glob("str*", "strlen") && glob("str*", "str"));
    assert!(!glob("str*", "memstr"));
    assert!(glob("*cpy", "memcpy") && glob("*", ""));
    assert!(glob("s?r*n", "strlen") && !glob("s?r", "strlen"));
    assert!(glob("*_*_*", "a_b_c") && !glob("*_*_*", "a_b"));
    assert!(glob("sqlite3_*_v2", "sqlite3_prepare_v2"));
}

#[test]
fn values_as_their_types_read_them() {
    assert_eq!(ArgType::I32.value(0xffff_ffff), Value::Signed(-1));
    assert_eq!(ArgType::I64.value(u64::MAX), Value::Signed(-1));
    assert_eq!(ArgType::U32.value(0x1_0000_0005), Value::Unsigned(5));
    assert_eq!(ArgType::parse("const char *").unwrap(), ArgType::Str);
    assert_eq!(ArgType::parse("struct stat *").unwrap(), ArgType::Hex);
}

#[test]
fn bad_specs_say_why() {
    assert!(parse_function("").is_err());
    assert!(parse_function(":malloc").is_err());
    assert!(parse_usdt("justaname").is_err());
    assert!(parse_usdt("p:n(float)").unwrap_err().contains("float"));
    assert!(parse_usdt("p:n(int").is_err());
    assert!(parse_hist("malloc").is_err());
    assert!(parse_hist("malloc:arg9").unwrap_err().contains("arg9"));
    assert!(parse_hist("str*:ret").is_err());
    assert_eq!(
        parse_hist("libc.so.6:read:ret").unwrap(),
        (
            Target::Function {
                object: Some("libc.so.6".into()),
                name: "read".into()
            },
            Drawn::Ret
        )
    );
}

#[test]
fn object_splits_at_a_lone_colon_not_inside_a_path_of_names() {
    let target = |text: &str| parse_function(text).unwrap().0;
    let function = |object: Option<&str>, name: &str| Target::Function {
        object: object.map(str::to_string),
        name: name.to_string(),
    };
    assert_eq!(
        target("libc.so.6:malloc"),
        function(Some("libc.so.6"), "malloc")
    );
    assert_eq!(target("myapp::parse*"), function(None, "myapp::parse*"));
    assert_eq!(
        target("libfoo.so:ns::Widget::draw"),
        function(Some("libfoo.so"), "ns::Widget::draw")
    );
    assert_eq!(
        target("std::vector<*>::push_back"),
        function(None, "std::vector<*>::push_back")
    );
    assert!(parse_function(":f").is_err());
}
