//! rmacomm Python bindings (pyo3): torchcomms' window API on rmacomm.
//!
//! It will hold the `rmacomm` extension module (`new_comm(...).new_window()`), its `.pyi` stubs and the `python -m rmacomm.run` launcher. Nothing is implemented yet.

#![forbid(unsafe_code)]
