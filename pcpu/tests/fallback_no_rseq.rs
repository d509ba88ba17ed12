//! With glibc's rseq registration turned off, every operation takes its
//! atomic or locked fallback and stays exact. The checks run in a child
//! process started with `GLIBC_TUNABLES=glibc.pthread.rseq=0`.

#[repr(C)]
struct Node {
    /// Written by the stack through raw pointers while it holds the node.
    next: std::cell::UnsafeCell<usize>,
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts a child process; .ci/miri runs the child's part (PCPU_CHILD=1)"
)]
fn fallbacks_are_exact_without_rseq() {
    if std::env::var_os("PCPU_CHILD").is_some() {
        child();
        return;
    }
    let out = test_support::rerun_in_child(
        "fallbacks_are_exact_without_rseq",
        &[
            ("PCPU_CHILD", "1"),
            ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
        ],
    );
    assert!(test_support::printed(
        &out,
        "child: rseq off, fallbacks exact"
    ));
}

fn child() {
    assert!(
        !pcpu::rseq::available(),
        "GLIBC_TUNABLES did not turn rseq off"
    );
    let counter = pcpu::PerCpuCounter::new();
    let threads = 8;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| (0..test_support::scaled(100_000)).for_each(|_| counter.add(1)));
        }
    });
    assert_eq!(counter.sum(), threads * test_support::scaled(100_000));
    assert!(pcpu::current_cpu() < pcpu::possible_cpus());

    let nodes: Vec<Node> = (0..16)
        .map(|_| Node {
            next: std::cell::UnsafeCell::new(0),
        })
        .collect();
    let stack = pcpu::PerCpuStack::new(0);
    assert!(!stack.uses_rseq());
    for n in &nodes {
        // SAFETY: each node pushed once; the vector outlives the stack's use.
        unsafe { stack.push(std::ptr::NonNull::from(n).cast()) };
    }
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..test_support::scaled(20_000) {
                    let slots = stack.slots();
                    if let Some(n) = stack
                        .pop()
                        .or_else(|| (0..slots).find_map(|i| stack.pop_slot(i)))
                    {
                        // SAFETY: we own the popped node.
                        unsafe { stack.push(n) };
                    }
                }
            });
        }
    });
    let back: usize = (0..stack.slots())
        .map(|s| std::iter::from_fn(|| stack.pop_slot(s)).count())
        .sum();
    assert_eq!(back, nodes.len());
    println!("child: rseq off, fallbacks exact");
}
