//! The module's tokio runtime: it drives the transports' completions and
//! runs the asyncio variants' operations (one worker thread; created on
//! first use).

use std::sync::OnceLock;

use tokio::runtime::Runtime;

/// The runtime (panics only if the OS refuses a thread at first use).
pub(crate) fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rmacomm-transport")
            .enable_all()
            .build()
            .expect("cannot start the transport's runtime thread")
    })
}

/// Runs `end` (an end that waits: for the device, for peers up to the
/// timeout) with the GIL released when this thread holds it (a Python
/// object's deallocation), so other Python threads run meanwhile; where
/// the interpreter cannot be attached (it is ending), runs it as it is.
pub(crate) fn end_without_gil(end: impl FnOnce() + Send) {
    let mut end = Some(end);
    // Attached already: `try_attach` only hands out the token, and
    // `detach` releases the GIL.
    let _ = pyo3::Python::try_attach(|py| end.take().map(|f| py.detach(f)));
    if let Some(f) = end {
        f();
    }
}
