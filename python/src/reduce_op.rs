//! `ReduceOp`: torchcomms' reduction ops as Python values
//! (`ReduceOp.SUM`, `ReduceOp.PREMUL_SUM(factor)`).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use rmacomm_collectives::ReduceOp;

/// A reduction op: `ReduceOp.SUM`, `PRODUCT`, `MIN`, `MAX`, `BAND`, `BOR`,
/// `BXOR` (integers only), `AVG` (integers truncate, as torch), and
/// `ReduceOp.PREMUL_SUM(factor)` (each input multiplied by `factor` before
/// the sum).
#[pyclass(frozen, from_py_object, module = "rmacomm", name = "ReduceOp")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PyReduceOp {
    pub(crate) op: ReduceOp,
}

const fn op(op: ReduceOp) -> PyReduceOp {
    PyReduceOp { op }
}

#[pymethods]
impl PyReduceOp {
    #[classattr]
    const SUM: PyReduceOp = op(ReduceOp::Sum);
    #[classattr]
    const PRODUCT: PyReduceOp = op(ReduceOp::Product);
    #[classattr]
    const MIN: PyReduceOp = op(ReduceOp::Min);
    #[classattr]
    const MAX: PyReduceOp = op(ReduceOp::Max);
    #[classattr]
    const BAND: PyReduceOp = op(ReduceOp::Band);
    #[classattr]
    const BOR: PyReduceOp = op(ReduceOp::Bor);
    #[classattr]
    const BXOR: PyReduceOp = op(ReduceOp::Bxor);
    #[classattr]
    const AVG: PyReduceOp = op(ReduceOp::Avg);

    /// The sum of every input multiplied by `factor` first (a number, or a
    /// one-element tensor).
    #[staticmethod]
    #[allow(non_snake_case)]
    fn PREMUL_SUM(factor: &Bound<'_, PyAny>) -> PyResult<PyReduceOp> {
        let f: f64 = match factor.extract() {
            Ok(f) => f,
            Err(_) => factor
                .call_method0("item")
                .and_then(|v| v.extract())
                .map_err(|_| PyTypeError::new_err("PREMUL_SUM: factor must be a number or a one-element tensor"))?,
        };
        Ok(op(ReduceOp::PremulSum(f)))
    }

    /// The op's name: "sum", "product", ..., "premul_sum".
    #[getter]
    fn name(&self) -> &'static str {
        self.op.name()
    }

    /// PREMUL_SUM's factor; None for the other ops.
    #[getter]
    fn factor(&self) -> Option<f64> {
        match self.op {
            ReduceOp::PremulSum(f) => Some(f),
            _ => None,
        }
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.extract::<PyRef<'_, PyReduceOp>>().is_ok_and(|o| o.op == self.op)
    }

    fn __hash__(&self) -> u64 {
        let f = match self.op {
            ReduceOp::PremulSum(f) => f.to_bits(),
            _ => 0,
        };
        f ^ self.op.name().bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
    }

    fn __repr__(&self) -> String {
        match self.op {
            ReduceOp::PremulSum(f) => format!("ReduceOp.PREMUL_SUM({f})"),
            o => format!("ReduceOp.{}", o.name().to_ascii_uppercase()),
        }
    }
}
