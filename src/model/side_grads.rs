//! The side table: parameter gradients produced outside candle's graph (by native layers, the
//! native embedding, the fused loss's head gradient and checkpointed layers), by HF name,
//! merged into the gradients by [`super::CausalLm::backward`].
//!
//! A layer's gradients reach the table as soon as its backward is done, while candle's backward
//! is still walking the layers below: the one place a gradient is known final before the
//! whole backward ends. A [`GradientSink`] installed on the table takes them from there
//! (sharded data parallel reduce-scatters each layer's gradient then, so no rank holds the
//! whole gradient, issue #57).

use candle_core::{Result, Tensor};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use super::ops::lock;

/// Takes parameter gradients out of a backward as they are produced (see the module's doc).
pub trait GradientSink: Send + Sync {
    /// Whether the gradient of `name` goes to the sink rather than into the backward's result.
    fn takes(&self, name: &str) -> bool;

    /// Takes one finished contribution to `name`'s gradient of this backward (a tensor used
    /// twice may contribute twice; the sink sums them).
    fn take(&self, name: &str, grad: Tensor) -> Result<()>;
}

/// Parameter gradients produced outside candle's graph, by HF name, and where they go.
pub(crate) struct SideTable {
    grads: Mutex<HashMap<String, Tensor>>,
    sink: Mutex<Option<Arc<dyn GradientSink>>>,
    /// The names whose gradients went to the sink since the last [`SideTable::begin_backward`].
    streamed: Mutex<HashSet<String>>,
}

/// The side table a model and its ops share.
pub(crate) type SideGrads = Arc<SideTable>;

impl SideTable {
    /// An empty table without a sink.
    pub(crate) fn new() -> SideGrads {
        Self::with(HashMap::new())
    }

    /// A table holding `grads` (tests).
    pub(crate) fn with(grads: HashMap<String, Tensor>) -> SideGrads {
        Arc::new(SideTable {
            grads: Mutex::new(grads),
            sink: Mutex::new(None),
            streamed: Mutex::new(HashSet::new()),
        })
    }

    /// The gradients held (for the ops that add into an entry in place).
    pub(crate) fn grads(&self) -> MutexGuard<'_, HashMap<String, Tensor>> {
        lock(&self.grads)
    }

    /// Adds `g` to `name`'s gradient: hands it to the sink when the sink takes `name`, else
    /// into the table (inserted when there is none yet).
    pub(crate) fn add(&self, name: &str, g: Tensor) -> Result<()> {
        let sink = lock(&self.sink).clone();
        if let Some(sink) = sink.filter(|s| s.takes(name)) {
            lock(&self.streamed).insert(name.to_string());
            return sink.take(name, g);
        }
        let mut grads = self.grads();
        let g = match grads.remove(name) {
            Some(prev) => (prev + g)?,
            None => g,
        };
        grads.insert(name.to_string(), g);
        Ok(())
    }

    /// Installs (or, with `None`, removes) the sink.
    pub(crate) fn set_sink(&self, sink: Option<Arc<dyn GradientSink>>) {
        *lock(&self.sink) = sink;
    }

    /// Starts a backward: forgets which names went to the sink.
    pub(crate) fn begin_backward(&self) {
        lock(&self.streamed).clear();
    }

    /// Whether `name`'s gradient went to the sink in this backward.
    pub(crate) fn streamed(&self, name: &str) -> bool {
        lock(&self.streamed).contains(name)
    }
}
