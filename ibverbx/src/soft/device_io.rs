//! Device memory on the soft provider: its bytes move between the
//! connection and the device through host chunks, and its atomics are
//! read-modify-writes under one lock per process.
//!
//! The chunk is the staging unit: a payload for device memory is received
//! into a host chunk and copied to the device (the [`DeviceMemory`]
//! implementation pipelines its own copies, e.g. through pinned buffers),
//! and a payload from device memory is copied into a host buffer before it
//! is sent.

use std::io;
use std::sync::Mutex;

use super::mr::Target;
use super::raw_io::{recv_exact, recv_exact_while, HasSock};
use crate::DeviceMemory;

/// Bytes staged per copy: several of the device's own staging chunks
/// (rmacomm-cuda's are 1 MiB), so that its pipeline (one chunk's DMA beside
/// the next one's CPU copy) has something to overlap.
pub(crate) const CHUNK: usize = 4 << 20;

/// Why a device transfer stopped.
#[derive(Debug)]
pub(crate) enum Failed {
    /// The connection failed.
    Io(io::Error),
    /// The device copy failed (its error, with the memory named).
    Copy(String),
}

impl From<io::Error> for Failed {
    fn from(e: io::Error) -> Failed {
        Failed::Io(e)
    }
}

fn copy_failed(dev: &dyn DeviceMemory, e: String) -> Failed {
    Failed::Copy(format!("{}: {e}", dev.describe()))
}

/// Receives `len` bytes from `r` into device memory at `addr`, with
/// `enter` around each copy to the device, as in [`recv_exact_while`].
///
/// # Safety
/// `addr..addr + len` lies in a region registered on `dev` (checked), live
/// for as long as `enter` returns guards.
async unsafe fn recv_to_device<R, G, F>(
    r: &mut R,
    dev: &dyn DeviceMemory,
    addr: u64,
    len: usize,
    enter: F,
) -> Result<(), Failed>
where
    R: HasSock + ?Sized,
    F: Fn() -> Option<G>,
{
    let mut chunk = vec![0u8; len.min(CHUNK)];
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        // SAFETY: the chunk is this function's own buffer of at least n bytes.
        unsafe { recv_exact(r, chunk.as_mut_ptr() as usize, n).await? };
        let Some(_registered) = enter() else { return Err(deregistered().into()) };
        // SAFETY: within the checked target (the caller's contract), still
        // registered while the guard is held.
        unsafe { dev.write(addr + done as u64, &chunk[..n]) }.map_err(|e| copy_failed(dev, e))?;
        done += n;
    }
    Ok(())
}

/// Receives `len` bytes from `r` into a checked target.
///
/// # Safety
/// The target must be `len` bytes of a live registration (host: writable)
/// held by the caller until this returns.
pub(crate) async unsafe fn recv_to<R: HasSock + ?Sized>(r: &mut R, t: &Target, len: usize) -> Result<(), Failed> {
    // SAFETY: the caller's promise.
    unsafe { recv_to_while(r, t, len, || Some(())).await }
}

/// [`recv_to`] into a region that its owner may deregister meanwhile (a
/// peer's RDMA WRITE): `enter` is called before each write into the
/// target, its guard held for that write only; `None` (deregistered) ends
/// it with [`deregistered`]'s error, nothing more written.
///
/// # Safety
/// As [`recv_to`], for as long as `enter` returns guards.
pub(crate) async unsafe fn recv_to_while<R, G, F>(r: &mut R, t: &Target, len: usize, enter: F) -> Result<(), Failed>
where
    R: HasSock + ?Sized,
    F: Fn() -> Option<G>,
{
    match t {
        Target::Host(p) => {
            // SAFETY: the caller's promise.
            unsafe { recv_exact_while(r, *p, len, enter).await? };
            Ok(())
        }
        // SAFETY: the caller's checked target.
        Target::Device(dev, a) => unsafe { recv_to_device(r, &**dev, *a, len, enter).await },
    }
}

/// The error of a write stopped because its region was deregistered.
pub(crate) fn deregistered() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "the memory was deregistered")
}

/// The `len` device bytes at `addr`, copied to the host.
///
/// # Safety
/// `addr..addr + len` lies in a live region registered on `dev` (checked).
pub(crate) unsafe fn read_device(dev: &dyn DeviceMemory, addr: u64, len: usize) -> Result<Vec<u8>, Failed> {
    let mut v = vec![0u8; len];
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        // SAFETY: within the checked range (the caller's contract).
        unsafe { dev.read(addr + done as u64, &mut v[done..done + n]) }.map_err(|e| copy_failed(dev, e))?;
        done += n;
    }
    Ok(v)
}

/// Writes `src` to device memory at `addr`.
///
/// # Safety
/// As for [`read_device`], for `addr..addr + src.len()`.
pub(crate) unsafe fn write_device(dev: &dyn DeviceMemory, addr: u64, src: &[u8]) -> Result<(), Failed> {
    for (i, c) in src.chunks(CHUNK).enumerate() {
        // SAFETY: within the checked range (the caller's contract).
        unsafe { dev.write(addr + (i * CHUNK) as u64, c) }.map_err(|e| copy_failed(dev, e))?;
    }
    Ok(())
}

/// Serializes this process's atomics on device memory (each one a read and
/// a write through the driver): atomic with respect to every other RDMA
/// atomic on the region, which all go through its owner (device memory is
/// staged), not to the device's own kernels (as on hardware without PCIe
/// atomics).
static DEVICE_ATOMICS: Mutex<()> = Mutex::new(());

/// A fetch-and-add (`cmp_swap` false: adds `a`) or compare-and-swap
/// (compares with `a`, swaps in `b`) on the 8-byte word at `addr`; returns
/// the original value.
///
/// # Safety
/// `addr..addr + 8` lies in a live region registered on `dev` (checked).
pub(crate) unsafe fn device_atomic(
    dev: &dyn DeviceMemory,
    addr: u64,
    cmp_swap: bool,
    a: u64,
    b: u64,
) -> Result<u64, Failed> {
    let _g = DEVICE_ATOMICS.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = [0u8; 8];
    // SAFETY: a checked 8-byte word (the caller's contract).
    unsafe { dev.read(addr, &mut w) }.map_err(|e| copy_failed(dev, e))?;
    let orig = u64::from_ne_bytes(w);
    let new = if cmp_swap { (orig == a).then_some(b) } else { Some(orig.wrapping_add(a)) };
    if let Some(v) = new {
        // SAFETY: as above.
        unsafe { dev.write(addr, &v.to_ne_bytes()) }.map_err(|e| copy_failed(dev, e))?;
    }
    Ok(orig)
}
