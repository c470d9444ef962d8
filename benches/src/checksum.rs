//! The per-size data check: a fast streaming hash of a memory region,
//! computed by each side over its own memory and compared over the
//! bootstrap connection.

/// A streaming 64-bit hash (four multiply-rotate lanes over 32-byte
/// blocks). Not cryptographic: it catches lost, misplaced or torn writes.
/// The result depends only on the bytes, not on how they were split into
/// `update` calls.
#[derive(Debug, Clone)]
pub struct Checksum {
    lanes: [u64; 4],
    tail: [u8; 32],
    tail_len: usize,
    total: u64,
}

const PRIME: u64 = 0x9e37_79b9_7f4a_7c15;

impl Default for Checksum {
    fn default() -> Self {
        Checksum { lanes: [1, 2, 3, 4].map(|i: u64| i.wrapping_mul(PRIME)), tail: [0; 32], tail_len: 0, total: 0 }
    }
}

impl Checksum {
    /// A new hash.
    pub fn new() -> Self {
        Self::default()
    }

    fn block(&mut self, b: &[u8]) {
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            *lane = (*lane ^ w).wrapping_mul(PRIME).rotate_left(29);
        }
    }

    /// Adds bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.tail_len > 0 {
            let take = (32 - self.tail_len).min(data.len());
            self.tail[self.tail_len..self.tail_len + take].copy_from_slice(&data[..take]);
            self.tail_len += take;
            data = &data[take..];
            if self.tail_len < 32 {
                return;
            }
            let t = self.tail;
            self.block(&t);
            self.tail_len = 0;
        }
        let mut blocks = data.chunks_exact(32);
        for b in &mut blocks {
            self.block(b);
        }
        let rest = blocks.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.tail_len = rest.len();
    }

    /// The hash of everything added.
    pub fn finish(&self) -> u64 {
        let mut me = self.clone();
        if me.tail_len > 0 {
            let mut t = [0u8; 32];
            t[..me.tail_len].copy_from_slice(&me.tail[..me.tail_len]);
            me.block(&t);
        }
        let mut h = me.total.wrapping_mul(PRIME);
        for l in me.lanes {
            h = (h ^ l).wrapping_mul(PRIME).rotate_left(31);
        }
        h ^ (h >> 29)
    }

    /// The hash of one slice.
    pub fn of(data: &[u8]) -> u64 {
        let mut c = Checksum::new();
        c.update(data);
        c.finish()
    }
}

/// Deterministic test data: byte `i` of the pattern of `seed` (xorshift
/// words), so that both sides can fill and check large regions chunk by
/// chunk.
pub fn pattern_chunk(seed: u64, offset: u64, out: &mut [u8]) {
    let word = |w: u64| {
        let mut x = w.wrapping_add(seed.wrapping_mul(PRIME)) | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x.to_le_bytes()
    };
    let mut pos = offset;
    let mut i = 0;
    while i < out.len() {
        let bytes = word(pos / 8);
        let k = (pos % 8) as usize;
        let n = (8 - k).min(out.len() - i);
        out[i..i + n].copy_from_slice(&bytes[k..k + n]);
        i += n;
        pos += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_independent() {
        let mut data = vec![0u8; 1000];
        pattern_chunk(7, 0, &mut data);
        let whole = Checksum::of(&data);
        for split in [0, 1, 31, 32, 33, 500, 999, 1000] {
            let mut c = Checksum::new();
            c.update(&data[..split]);
            c.update(&data[split..]);
            assert_eq!(c.finish(), whole, "split at {split}");
        }
        let mut c = Checksum::new();
        for b in data.chunks(7) {
            c.update(b);
        }
        assert_eq!(c.finish(), whole);
    }

    #[test]
    fn detects_changes() {
        let mut data = vec![0u8; 4096];
        pattern_chunk(1, 0, &mut data);
        let h = Checksum::of(&data);
        for pos in [0, 1, 31, 32, 4000, 4095] {
            let mut d = data.clone();
            d[pos] ^= 1;
            assert_ne!(Checksum::of(&d), h, "flip at {pos}");
        }
        assert_ne!(Checksum::of(&data[..4095]), h);
        assert_ne!(Checksum::of(&[0u8; 64]), Checksum::of(&[0u8; 65]));
        // Swapped blocks differ too.
        let mut d = data.clone();
        d[..32].copy_from_slice(&data[32..64]);
        d[32..64].copy_from_slice(&data[..32]);
        assert_ne!(Checksum::of(&d), h);
    }

    #[test]
    fn pattern_is_chunkable_and_seeded() {
        let mut whole = vec![0u8; 100];
        pattern_chunk(3, 0, &mut whole);
        let mut part = vec![0u8; 37];
        pattern_chunk(3, 50, &mut part);
        assert_eq!(&whole[50..87], &part[..]);
        let mut other = vec![0u8; 100];
        pattern_chunk(4, 0, &mut other);
        assert_ne!(whole, other);
        assert!(whole.iter().any(|&b| b != whole[0]));
    }
}
