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
