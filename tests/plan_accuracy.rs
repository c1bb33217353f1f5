//! The planner against measured heap peaks of real training steps (SmolLM2-135M shape,
//! random init, counting allocator): every config of the grid within 3 %.

#[path = "plan_support/harness.rs"]
mod harness;

use std::time::Instant;
use tunestudio::mem::CountingAllocator;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

#[test]
fn planner_within_3_percent_of_measured_peak() {
    let t0 = Instant::now();
    let rows = harness::run_grid(&harness::grid());
    println!("grid: {} configs in {:.0} s", rows.len(), t0.elapsed().as_secs_f64());
    let mut worst = 0f64;
    for (c, m, p) in &rows {
        let err = (*p as f64 - m.peak as f64).abs() / m.peak as f64;
        worst = worst.max(err);
        assert!(
            err <= 0.03,
            "{c:?}: predicted {p} B, measured {} B ({:+.2} %)",
            m.peak,
            100.0 * (*p as f64 - m.peak as f64) / m.peak as f64
        );
    }
    println!("worst |error| {:.2} %", 100.0 * worst);
}
