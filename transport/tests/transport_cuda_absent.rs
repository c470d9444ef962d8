//! Without a CUDA driver, device memory is an error that names the driver
//! and the call (never a panic): `RMACOMM_CUDA_LIB` points at a file that
//! does not exist, as on a machine without NVIDIA's driver.

use rmacomm_transport::{RdmaMemory, TransportError};

#[test]
fn no_driver_is_an_error_naming_it() {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    std::env::set_var("RMACOMM_CUDA_LIB", "/nonexistent/libcuda.so.1");
    let e = RdmaMemory::alloc_cuda(4096, 0).unwrap_err();
    assert!(matches!(e, TransportError::Unsupported(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("RdmaMemory::alloc_cuda") && msg.contains("libcuda"), "{msg}");
    // SAFETY: refused before anything is registered.
    let e = unsafe { RdmaMemory::register_cuda(0x1000, 4096, 0) }.unwrap_err();
    assert!(e.to_string().contains("register_cuda"), "{e}");
}
