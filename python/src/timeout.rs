//! Timeout arguments: a `datetime.timedelta` or seconds (int or float).

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;

/// `None` stays `None` (the default applies); anything else must be a
/// non-negative, finite number of seconds or a timedelta.
pub(crate) fn duration(obj: Option<&Bound<'_, PyAny>>, arg: &str) -> PyResult<Option<Duration>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    let secs: f64 = match obj.extract::<f64>() {
        Ok(s) => s,
        Err(_) => match obj.getattr(intern!(obj.py(), "total_seconds")) {
            Ok(f) => f.call0()?.extract()?,
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{arg} must be a datetime.timedelta or a number of seconds, not {}",
                    obj.get_type().name()?
                )))
            }
        },
    };
    Duration::try_from_secs_f64(secs)
        .map(Some)
        .map_err(|_| PyValueError::new_err(format!("{arg} must be a finite, non-negative duration (got {secs} s)")))
}

/// A `datetime.timedelta` of `d`.
/// (`timedelta.max` for a longer one: how "forever" reads back; past it
/// the call raised OverflowError).
pub(crate) fn to_timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    let td = py.import(intern!(py, "datetime"))?.getattr(intern!(py, "timedelta"))?;
    const MAX_SECS: u64 = 999_999_999 * 86_400 + 86_399;
    if d.as_secs() > MAX_SECS {
        return td.getattr(intern!(py, "max"));
    }
    td.call1((0, d.as_secs(), d.subsec_micros()))
}
