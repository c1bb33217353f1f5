//! Prints the planner-vs-measured table for the accuracy grid (same harness as
//! tests/plan_accuracy.rs). `PLAN_ACCURACY_FILTER=<substring of a case>` selects configs.
//!
//! cargo run --example plan_accuracy

// A developer's measuring tool that shares the test harness (tests/plan_support), which unwraps:
// a panic here stops a measurement, it never reaches a user.
#![allow(clippy::unwrap_used)]

#[path = "../tests/plan_support/harness.rs"]
mod harness;

use tunestudio::mem::CountingAllocator;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

fn main() {
    let t0 = std::time::Instant::now();
    harness::print_header();
    let rows = harness::run_grid(&harness::grid());
    // Which part of each prediction is off: component by component (definitions in
    // `tunestudio::plan::components`).
    for (c, m, d) in &rows {
        println!("\n{c:?}\n{}", harness::component_report(c, m, d).render());
    }
    let worst = rows
        .iter()
        .map(|(_, m, d)| harness::err_pct(d.peak_bytes, m.peak).abs())
        .fold(0.0, f64::max);
    println!(
        "{} configs in {:.0} s; worst |error| {:.2} %",
        rows.len(),
        t0.elapsed().as_secs_f64(),
        worst
    );
}
