//! The side table: parameter gradients produced outside candle's graph (by native layers, the
//! native embedding, the fused loss's head gradient and checkpointed layers), by HF name,
//! merged into the gradients by [`super::CausalLm::backward`].

use candle_core::{Result, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Parameter gradients produced outside candle's graph, by HF name (merged by
/// [`super::CausalLm::backward`]).
pub(crate) type SideGrads = Arc<Mutex<HashMap<String, Tensor>>>;

/// Adds `g` to the side-table gradient of `name` (inserts it when there is none yet).
pub(crate) fn add_side_grad(
    side: &mut HashMap<String, Tensor>,
    name: &str,
    g: Tensor,
) -> Result<()> {
    let g = match side.remove(name) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    side.insert(name.to_string(), g);
    Ok(())
}
