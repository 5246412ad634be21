//! Request and response bodies of the store benches.

use bytes::Bytes;

/// A JSON body of exactly `n` bytes (at least 8) of incompressible text: the same body
/// for the same size.
pub fn blob_body(n: usize) -> Bytes {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = Vec::with_capacity(n.max(8));
    out.extend_from_slice(br#"{"d":""#);
    // xorshift32, seeded by the size.
    let mut x: u32 = 0x9e37_79b9 ^ u32::try_from(n).unwrap_or(u32::MAX);
    while out.len() + 2 < n {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.push(ALNUM[(x % 62) as usize]);
    }
    out.extend_from_slice(br#""}"#);
    Bytes::from(out)
}
