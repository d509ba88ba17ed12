//! `in_own_process` runs a test's body in a process of its own: the body's
//! changes to process-wide state stay there.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

use test_support::{OWN_PROCESS_VAR, in_own_process};

static TOUCHED: AtomicBool = AtomicBool::new(false);

/// Whether this process already runs one test only (nextest, or the child
/// `in_own_process` starts).
fn alone() -> bool {
    std::env::var_os(OWN_PROCESS_VAR).is_some()
        || std::env::var("NEXTEST_EXECUTION_MODE").as_deref() == Ok("process-per-test")
}

#[test]
fn the_body_runs_where_the_test_is_alone() {
    in_own_process("the_body_runs_where_the_test_is_alone", || {
        assert!(alone(), "the body ran beside other tests");
        if std::env::var_os(OWN_PROCESS_VAR).is_some() {
            assert_eq!(
                std::env::var(OWN_PROCESS_VAR).unwrap(),
                "the_body_runs_where_the_test_is_alone"
            );
        }
        TOUCHED.store(true, SeqCst);
    });
    // Here the body ran only if this process was already alone.
    assert_eq!(TOUCHED.load(SeqCst), alone());
}

mod nested {
    #[test]
    fn a_test_in_a_module_is_named_by_its_path() {
        test_support::in_own_process("nested::a_test_in_a_module_is_named_by_its_path", || {
            assert!(super::alone());
        });
    }
}
