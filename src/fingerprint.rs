//! What makes two requests "the same request" for one key.

use sha2::{Digest, Sha256};

/// A SHA-256 digest of the parts of a request that must match for a retry to be replayed.
///
/// The HTTP layer fingerprints the method, authority (or `Host`), path and query, `Content-Type`
/// and body. Queue
/// consumers fingerprint whatever identifies their message, usually its payload.
///
/// ```
/// use tower_idempotency::Fingerprint;
///
/// let a = Fingerprint::new([b"POST".as_slice(), b"/payments", b"{\"amount\":1}"]);
/// let b = Fingerprint::new([b"POST".as_slice(), b"/payments", b"{\"amount\":2}"]);
/// assert_ne!(a, b);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Digests the parts in order. Each part is length-prefixed, so moving bytes from one part
    /// to the next changes the fingerprint.
    pub fn new<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut builder = FingerprintBuilder::default();
        for part in parts {
            builder.part(part);
        }
        builder.finish()
    }

    /// Wraps a digest computed elsewhere (for example a stored one).
    pub fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// A [`Fingerprint`] digested part by part, for callers whose number of parts is only known as
/// they go (selected headers, each value a part); the same parts give the same digest as
/// [`Fingerprint::new`].
#[derive(Default)]
pub(crate) struct FingerprintBuilder(Sha256);

impl FingerprintBuilder {
    pub(crate) fn part(&mut self, part: &[u8]) {
        self.0.update((part.len() as u64).to_be_bytes());
        self.0.update(part);
    }

    pub(crate) fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_length_prefixed() {
        let a = Fingerprint::new([b"ab".as_slice(), b"c"]);
        let b = Fingerprint::new([b"a".as_slice(), b"bc"]);
        assert_ne!(a, b);
        assert_eq!(a, Fingerprint::new([b"ab".as_slice(), b"c"]));
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Two lists of parts share a fingerprint only if they are the same parts: moving
        /// bytes across a boundary, or adding an empty part, changes it; built part by part it
        /// is the same.
        #[test]
        fn fingerprints_are_equal_only_for_equal_parts(
            a in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..3), 0..4),
            b in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..3), 0..4),
        ) {
            let of = |parts: &[Vec<u8>]| Fingerprint::new(parts.iter().map(Vec::as_slice));
            prop_assert_eq!(of(&a) == of(&b), a == b);
            let mut builder = FingerprintBuilder::default();
            for part in &a {
                builder.part(part);
            }
            prop_assert_eq!(builder.finish(), of(&a));
            prop_assert_eq!(Fingerprint::from_digest(*of(&a).as_bytes()), of(&a));
        }
    }
}
