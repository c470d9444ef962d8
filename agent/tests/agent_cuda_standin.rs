//! KV-cache blocks in CUDA device memory (the CUDA stand-in's, loaded
//! through `RMACOMM_CUDA_LIB`): scattered blocks written and read between
//! a prefill and a decode agent of one process, device memory on either
//! side or both, with one notification each; same host over shared memory
//! (the peer's device memory opened through its IPC export, and a host
//! peer region mapped while the local blocks are device memory) and tcp.

mod common;

use common::{contents, next_notification, pattern};
use rmacomm_agent::{Op, RemoteBlock, TransferAgent};

/// Points the driver loader at the stand-in; false (printed why) where it
/// is not built.
fn use_standin() -> bool {
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return false };
    std::env::set_var("RMACOMM_CUDA_LIB", &lib);
    true
}

async fn device_blocks(link: &str) {
    if !use_standin() {
        return;
    }
    common::link(link);
    const B: usize = 64 << 10;
    // (decode's cache on the device, prefill's blocks on the device)
    for (cache_dev, kv_dev) in [(true, true), (true, false), (false, true)] {
        let decode = TransferAgent::new("decode", common::config()).unwrap();
        let prefill = TransferAgent::new("prefill", common::config()).unwrap();
        let alloc = |a: &TransferAgent, len: usize, dev: bool| if dev { a.alloc_cuda(len, 0) } else { a.alloc(len) };
        let cache = alloc(&decode, 32 * B, cache_dev).unwrap();
        let region = decode.register(&cache).unwrap();
        prefill.add_peer(&decode.metadata()).unwrap();
        let kv = alloc(&prefill, 16 * B, kv_dev).unwrap();
        prefill.register(&kv).unwrap();
        assert_eq!((cache.device().is_some(), kv.device().is_some()), (cache_dev, kv_dev));
        let what = format!("{link}: cache on the device {cache_dev}, blocks on the device {kv_dev}");
        kv.write_from(0, &pattern(16 * B, 3)).unwrap();
        let slots: Vec<usize> = (0..16).map(|i| (i * 7 + 3) % 32).collect();
        let pieces: Vec<_> = slots
            .iter()
            .enumerate()
            .map(|(b, &s)| (kv.view(b * B, B).unwrap(), RemoteBlock::new(region, (s * B) as u64, B as u64)))
            .collect();
        prefill.transfer(Op::Write, "decode", &pieces, Some(b"blocks")).unwrap().await.unwrap();
        assert_eq!(next_notification(&decode).await.message, b"blocks", "{what}");
        let want = pattern(16 * B, 3);
        for (b, &s) in slots.iter().enumerate() {
            assert!(contents(&cache, s * B, B) == want[b * B..(b + 1) * B], "{what}: block {b} in slot {s}");
        }
        // Read them back, reversed, over what was sent.
        kv.write_from(0, &vec![0u8; 16 * B]).unwrap();
        let back: Vec<_> = slots
            .iter()
            .rev()
            .enumerate()
            .map(|(b, &s)| (kv.view_mut(b * B, B).unwrap(), RemoteBlock::new(region, (s * B) as u64, B as u64)))
            .collect();
        prefill.transfer(Op::Read, "decode", &back, None).unwrap().await.unwrap();
        for (b, &s) in slots.iter().rev().enumerate() {
            let i = slots.iter().position(|&x| x == s).unwrap();
            assert!(contents(&kv, b * B, B) == want[i * B..(i + 1) * B], "{what}: read of slot {s}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_blocks_shm() {
    device_blocks("shm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_blocks_tcp() {
    device_blocks("tcp").await;
}
