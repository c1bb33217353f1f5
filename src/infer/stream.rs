//! Generation on a background thread, streamed over a channel, cancellable at any time.

use super::generator::{GenerationOutput, Generator, Prompt, TokenEvent};
use super::sampling::SamplingParams;
use crossbeam_channel::{unbounded, Receiver, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// One generation job.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// The loaded model (shared; several requests may run on it at once).
    pub generator: Arc<Generator>,
    /// What to answer.
    pub prompt: Prompt,
    /// How to generate.
    pub params: SamplingParams,
}

/// What the generation thread reports, in order: `Started`, any number of `Token`s, then
/// exactly one of `Done` or `Error` (after which the channel closes).
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// The prompt was tokenised; the prompt pass starts.
    Started {
        /// Tokens in the prompt.
        prompt_tokens: usize,
    },
    /// A generated token and the text it releases (may be empty; see [`TokenEvent`]).
    /// Appending every `text` gives exactly `Done`'s `output.text`.
    Token {
        /// The text released with this token.
        text: String,
        /// The token id.
        id: u32,
    },
    /// Generation ended normally or by cancellation.
    Done(GenerationOutput),
    /// Generation failed; the message names the cause and the fix.
    Error {
        /// A readable message.
        message: String,
    },
}

/// A running generation: its event stream and its cancel switch. Dropping the handle
/// cancels the generation.
#[derive(Debug)]
pub struct GenerationHandle {
    /// The events; closes after `Done` or `Error`.
    pub events: Receiver<GenEvent>,
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl GenerationHandle {
    /// Asks the generation to stop; it ends with `Done` (stop reason `Cancelled`) before
    /// the next token.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// The cancel flag (to cancel from elsewhere, e.g. a Ctrl-C handler).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// Whether the generation thread has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits for the generation thread to end (events stay readable).
    pub fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            // A panic in the thread was already reported as an Error event.
            let _ = t.join();
        }
    }
}

impl Drop for GenerationHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn run(request: GenerationRequest, cancel: &AtomicBool, tx: &Sender<GenEvent>) {
    let g = &request.generator;
    let ids = match request
        .params
        .validate()
        .and_then(|_| g.encode_prompt(&request.prompt))
    {
        Ok(ids) => ids,
        Err(e) => {
            let _ = tx.send(GenEvent::Error {
                message: e.to_string(),
            });
            return;
        }
    };
    if tx
        .send(GenEvent::Started {
            prompt_tokens: ids.len(),
        })
        .is_err()
    {
        return;
    }
    let mut on_token = |t: TokenEvent| {
        // A closed channel means nobody listens any more: stop.
        tx.send(GenEvent::Token {
            text: t.text,
            id: t.id,
        })
        .is_ok()
    };
    let event = match g.generate_ids(&ids, &request.params, cancel, &mut on_token) {
        Ok(out) => GenEvent::Done(out),
        Err(e) => GenEvent::Error {
            message: e.to_string(),
        },
    };
    let _ = tx.send(event);
}

/// Starts `request` on a background thread and returns its handle at once. Every failure
/// (bad settings, empty prompt, a panic) arrives as a [`GenEvent::Error`].
pub fn spawn_generation(request: GenerationRequest) -> GenerationHandle {
    let (tx, rx) = unbounded();
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    let err_tx = tx.clone();
    let spawned = std::thread::Builder::new()
        .name("tunestudio-generate".into())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(request, &flag, &tx);
            }));
            if result.is_err() {
                let _ = tx.send(GenEvent::Error {
                    message: "the generation thread crashed (internal error); please report it with the model and settings used".into(),
                });
            }
        });
    let thread = match spawned {
        Ok(t) => Some(t),
        Err(e) => {
            let _ = err_tx.send(GenEvent::Error {
                message: format!("cannot start the generation thread: {e} (the system is out of threads or memory)"),
            });
            None
        }
    };
    // Only the thread may hold a sender, so the channel closes when it ends.
    drop(err_tx);
    GenerationHandle {
        events: rx,
        cancel,
        thread,
    }
}
