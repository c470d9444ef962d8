//! FileStore across processes sharing a directory.

use std::process::Command;

use rmacomm_window::{FileStore, Store};

#[test]
fn store_semantics_across_processes() {
    for n in [2, 3, 4] {
        let dir = std::env::temp_dir().join(format!("rmacomm-filestore-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(env!("CARGO_BIN_EXE_rmacomm-run"))
            .args(["--nproc-per-node", &n.to_string(), env!("CARGO_BIN_EXE_group-scenario"), "store-file"])
            .arg(&dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{n} ranks: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        for r in 0..n {
            assert!(stdout.contains(&format!("[{r}] rank {r} ok")), "{stdout}");
        }
        // Updates went through renames: no temporary file is left behind.
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_foreign_file_is_an_error_not_a_value() {
    let dir = std::env::temp_dir().join(format!("rmacomm-filestore-foreign-{}", std::process::id()));
    let store = FileStore::new(&dir).unwrap();
    std::fs::write(dir.join("k_x"), b"\xff").unwrap();
    let e = store.try_get("x").unwrap_err().to_string();
    assert!(e.contains("k_x") && e.contains("not a store record"), "{e}");
    // One longer than any record (a sparse file: it costs no disk) is
    // refused without being read whole.
    let f = std::fs::File::create(dir.join("k_y")).unwrap();
    f.set_len(1 << 40).unwrap();
    let e = store.try_get("y").unwrap_err().to_string();
    assert!(e.contains("k_y") && e.contains("not a store record"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
